"""Quarantine: what becomes of pages a step found bad, and of pages freed too early.

A page whose content was proven bad is quarantined: its holders keep it until they release it,
then its bytes are scrubbed and it returns to service (at once where nobody held it). The pages
are the step's agreed bad pages and the prefix-cache nodes its flagged requests wrote. A page
freed while a reader still validly held it is taken back from the engine's free list (reclaim).
This class decides which pages, and keeps the books: counts, metrics, the health's quarantine
cap, the escalation to verified reads, and the prefix-cache flush it asks for. The ledger makes
the page transitions; the actions reach the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvguard.actions import Actions
from kvguard.agreement import NO_PAGES, PageEpochs, union
from kvguard.health import GuardHealth
from kvguard.kernels.kv_checksum_ref import KvBuffer
from kvguard.ledger import PageLedger, PageState
from kvguard.metrics import GuardMetrics
from kvguard.verdict import Kind, StepVerdict

# After a quarantine, every read is verified (readers of a quarantined page whose bytes are
# intact go on) while quarantined pages are still held, for at most this many steps: past it a
# read of a still-quarantined page that was not verified that step is a violation again.
ESCALATION_STEPS = 1024


class Quarantine:
    def __init__(
        self,
        ledger: PageLedger,
        kv_buffers: Sequence[KvBuffer],
        metrics: GuardMetrics,
        health: GuardHealth,
        actions: Actions,
        now: Callable[[], int],
    ):
        """``now``: the guard's current step (a scrub's history entry names it)."""
        self.ledger = ledger
        self.kv_buffers = kv_buffers
        self.metrics = metrics
        self.health = health
        self.actions = actions
        self.now = now
        # A quarantine happened: the engine should drop its prefix cache at its next idle moment
        # (nodes over pages an engine bug touched; quarantined ones among them are scrubbed).
        self.flush_wanted = False
        # A violation happened since the prefix cache was last flushed: a node of it may hold a
        # page an engine bug handed to someone else (inserts then check what they would adopt)
        self.tree_suspect = False
        self.last_step = -(1 << 62)  # of the last quarantine
        self.num_quarantined_total = 0
        self.num_reclaimed_total = 0
        metrics.quarantined_pages.set(0)

    def escalated(self, step: int) -> bool:
        """Does step ``step`` verify every read (ESCALATION_STEPS)?"""
        return self.ledger.num_quarantined > 0 and step - self.last_step <= ESCALATION_STEPS

    def contain(
        self,
        verdict: StepVerdict | None,
        kinds: torch.Tensor,
        taint: PageEpochs | None,
        reclaim: PageEpochs | None,
        step: int,
    ) -> None:
        """After a flagged step (``kinds``: the agreed verdict bits): quarantine its agreed bad
        pages (``taint``) and the prefix-cache nodes its flagged requests wrote, take back
        ``reclaim``. Also run when acting failed part-way (reclaim None), so no request adopts
        them from the prefix cache before the idle flush (requests arriving at once leave the
        engine no idle moment). The pages are the agreed ones, the same on every rank (a failure
        on one rank alone still aborts that rank's whole batch: ``Guard.fail_closed``)."""
        self.tree_suspect = True  # the prefix cache may hold a node a fault touched
        self.flush_wanted = True  # ... until it is flushed at the next idle moment
        if (
            verdict is not None
            and bool(kinds.any())
            and not bool((kinds & int(Kind.GUARD_ERROR)).any())
        ):  # (a step some rank could not judge: that rank has no verdict to name pages from)
            poisoned = self._poisoned_nodes(verdict, kinds)
            if poisoned[0].numel():
                taint = poisoned if taint is None else union([taint, poisoned])
        if taint is not None and taint[0].numel():
            self.quarantine(taint[0], taint[1], step)
        if reclaim is not None and reclaim[0].numel():
            self.reclaim(reclaim[0], reclaim[1], step)

    def _poisoned_nodes(self, verdict: StepVerdict, kinds: torch.Tensor) -> PageEpochs:
        """Pages flagged requests wrote this step that the prefix cache holds by now: computed
        from what those requests read, they must never be adopted (a chunked prefill's chunk is
        checkpointed into the tree before its verdict is read; on a single rank the insert asks
        the unread verdict and bars it, with tensor parallelism it cannot). The same on every
        rank: the kinds are agreed and every ledger sees the same engine events."""
        x, c = verdict.inputs, verdict.check
        if x.write_slots.numel() == 0:
            return NO_PAGES
        flagged = kinds.to(self.ledger.device) != 0
        mine = flagged[x.batch_index()] & c.write_ok
        if not bool(mine.any()):
            return NO_PAGES
        pages = torch.unique(self.ledger.pages_of(c.targets[mine]))
        pages = pages[self.ledger.state[pages] == PageState.SHARED]
        return pages.cpu(), self.ledger.epoch[pages].cpu()

    def quarantine(self, pages: torch.Tensor, epochs: torch.Tensor, step: int) -> None:
        """Mark pages whose content was proven bad (unless handed out again since; ``epochs``:
        theirs when checked, one per page). Costs the pages, never the pool: the engine keeps
        holding them until its holders release them, and then they are scrubbed; those nobody
        held are scrubbed now."""
        keep = pages > 0  # page 0 is the engine's padding page
        pages, epochs = pages[keep], epochs[keep]
        if pages.numel():
            dev = self.ledger.device
            new, were_free = self.ledger.quarantine(pages.to(dev), epochs.to(dev), step)
            self.num_quarantined_total += int(new.numel())
            self.metrics.pages_quarantined.inc(int(new.numel()))
            if new.numel():
                self.last_step = step
                self.flush_wanted = True
            if were_free.numel():  # nobody holds them: back to service at once, scrubbed
                self.scrub(were_free)
        self._changed()

    def reclaim(self, pages: torch.Tensor, epochs: torch.Tensor, step: int) -> None:
        """Pages freed while a reader still validly held them (caught before reuse): take them
        back from the free list, so the reader's KV stays intact; report the engine bug.
        ``epochs``: theirs when checked, one per page."""
        keep = pages > 0
        pages, epochs = pages[keep], epochs[keep]
        if pages.numel() == 0:
            return
        dev = self.ledger.device
        back = self.ledger.reclaim(pages.to(dev), epochs.to(dev), step)
        if back.numel() == 0:
            return
        self.actions.withhold(back)
        self.num_reclaimed_total += int(back.numel())
        described = self.ledger.describe_many(back[:8].tolist())
        self.actions.engine_event(Kind.PREMATURE_FREE, step, described)

    def scrub(self, pages: torch.Tensor) -> torch.Tensor:
        """Quarantined pages nobody holds: bytes zeroed, entries reset, back in service. Returns
        those scrubbed (pages not quarantined are left alone)."""
        done = self.ledger.scrub(pages, self.kv_buffers, self.now())
        if done.numel():
            self.metrics.pages_scrubbed.inc(int(done.numel()))
            self._changed()
        return done

    def cleared(self, scrubbed: int) -> None:
        """The engine cleared its pool, and the ledger with it (its ``scrubbed`` quarantined pages
        scrubbed first): nothing quarantined, nothing left for a flush to drop."""
        if scrubbed:
            self.metrics.pages_scrubbed.inc(scrubbed)
        self._changed()
        self.flush_wanted = self.tree_suspect = False

    def holds(self, slots: torch.Tensor) -> bool:
        """Does this slot list touch a quarantined page?"""
        pages = self.ledger.pages_of(slots.to(self.ledger.device))
        return bool((self.ledger.state[pages] == PageState.QUARANTINED).any())

    def _changed(self) -> None:
        n = self.ledger.num_quarantined
        self.metrics.quarantined_pages.set(n)
        self.health.quarantined(n)

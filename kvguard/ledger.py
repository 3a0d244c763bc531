"""The page ledger: what the guard believes about every KV page, as device tensors it owns.

Per page (``kernels.guard_state.PageArrays``): state, the claim's epoch (fresh per claim, so a
stale reference never validates), owner row and generation, logical page index, sealed-token
count, token chain, digest of the sealed bytes, and a short event history for forensics. Every
change is a transition method here, run by the selected kernel backend; the checker only reads.
The state grows with the pool (72 bytes per page), never with rows x context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvguard.kernels import guard_ref
from kvguard.kernels.backend import GuardKernels, per_request
from kvguard.kernels.guard_ref import StepCheck, StepInputs
from kvguard.kernels.guard_state import NO_ROW, Event, PageArrays, PageState
from kvguard.kernels.kv_checksum_ref import KvBuffer, PageMajor
from kvguard.records import RowRecords

__all__ = ["Event", "IntegrityError", "PageLedger", "PageState"]


class IntegrityError(AssertionError):
    """The ledger and the engine disagree about a page (``PageLedger.check_integrity``)."""


class PageLedger:
    def __init__(
        self, num_slots: int, page_size: int, device: torch.device | str, kernels: GuardKernels
    ):
        if not 1 <= page_size <= 32767:
            raise ValueError(f"page size {page_size} out of range 1..32767")
        self.page_size = page_size
        self.num_slots = num_slots  # including the padding slots SGLang reserves
        self.num_pages = (num_slots + page_size - 1) // page_size
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        self.kernels = kernels
        # Queue transitions only where a separate entry costs more than the work: host kernels
        # on a CPU pool. A GPU (Triton) backend enqueues each transition as a launch anyway.
        self.queues = self._on_cpu and getattr(kernels, "name", "") != "triton"
        self._pages = PageArrays.empty(self.num_pages, self.device)
        self.num_quarantined = 0  # host count of pages QUARANTINED now
        # Transitions not yet applied: allocator hand-outs, and seals without checksums (tags
        # mode: a seal only records which tokens landed). On a CPU the forward evicts the
        # caches, and a separate cold entry into the guard costs ~20x the work it does (~75 us
        # vs ~4 us measured); so these are applied, in order, by whatever touches the pages next
        # (the next step check, as a rule). Every read of ``pages`` applies them first. A seal
        # that hashes bytes is never deferred: a late write must land after it, to be caught.
        self._pending: list[tuple[Any, ...]] = []

    # -- views ------------------------------------------------------------------------------------
    @property
    def pages(self) -> PageArrays:
        """The page arrays, with every hand-out applied."""
        if self._pending:
            self._apply_pending()
        return self._pages

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            if item[0] == "alloc":
                self.kernels.alloc_pages(self._pages, self._here(item[1]), self.page_size, item[2])
            else:
                self.kernels.seal_step(self._pages, item[1], item[2], [], self.page_size, False)

    @property
    def state(self) -> torch.Tensor:
        return self.pages.state

    @property
    def epoch(self) -> torch.Tensor:
        return self.pages.epoch

    def _here(self, t: torch.Tensor) -> torch.Tensor:
        if self._on_cpu and t.is_cpu:  # (``t.device`` builds a device object: slow when cold)
            return t
        return t if t.device == self.device else t.to(self.device)

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.div(slots.to(torch.int64), self.page_size, rounding_mode="floor")

    def nbytes(self) -> int:
        return self._pages.nbytes()

    # -- transitions (engine events) ----------------------------------------------------------------
    def allocate(self, slots: torch.Tensor, step: int) -> None:
        """The allocator handed out these slots (pages starting at them are new hand-outs),
        applied before the pages are next read or changed. A copy is queued: the engine's own
        tensor is the step's ``out_cache_loc``, which a bug (or the fault injector) may rewrite
        before the forward, and what the allocator handed out must stay what it handed out."""
        if not self.queues:
            self.kernels.alloc_pages(self.pages, self._here(slots), self.page_size, step)
            return
        self._pending.append(("alloc", slots.clone(), step))

    def release(self, pages: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages returned to the engine's free list: (which really go back, which are double
        frees)."""
        return self.kernels.release_pages(self.pages, self._here(pages), step)

    def attributable(self, records: RowRecords, pages: torch.Tensor, row: int) -> torch.Tensor:
        """Which of these pages a releasing row may free (not held by anyone else)."""
        fn = per_request(self.kernels, "attribute_free")
        keep: torch.Tensor = fn(self.pages, records.rows, self._here(pages), row)
        return keep

    def apply_step(self, records: RowRecords, x: StepInputs, check: StepCheck) -> None:
        """Claims, page chains and the claiming and adopting rows' records (one fused
        transition, after the check and before the forward)."""
        self.kernels.apply_step(self.pages, records.rows, x, check, self.page_size)

    def seal(
        self,
        x: StepInputs,
        check: StepCheck,
        buffers: Sequence[KvBuffer],
        checksums: bool,
        written: torch.Tensor | None = None,
    ) -> None:
        """After the forward: the tokens that landed are sealed (and hashed in checksum modes:
        from ``written``, the writer's sums per write, where the stores were digested; else from
        the pool). Without checksums the seal is queued like a hand-out."""
        if not checksums and self.queues:
            self._pending.append(("seal", x, check))
            return
        self.kernels.seal_step(self.pages, x, check, buffers, self.page_size, checksums, written)

    def share(self, records: RowRecords, slots: torch.Tensor, row: int, step: int) -> None:
        fn = per_request(self.kernels, "share_pages")
        fn(self.pages, records.rows, self.pages_of(self._here(slots)), row, step)

    def rebind(
        self,
        records: RowRecords,
        row: int,
        first_position: int,
        old_slots: torch.Tensor,
        new_slots: torch.Tensor,
        step: int,
    ) -> None:
        """The prefix cache replaced the row's slots from ``first_position`` by its own copies:
        the row's record follows, page by page (only whole pages move: inserts are page
        aligned)."""
        ps = self.page_size
        start = -(-first_position // ps) * ps
        skip = start - first_position
        old, new = old_slots[skip::ps], new_slots[skip::ps]
        if old.numel() and not torch.equal(old, new):
            fn = per_request(self.kernels, "rebind_row")
            old_pages, new_pages = self.pages_of(old), self.pages_of(new)
            fn(self.pages, records.rows, row, start // ps, old_pages, new_pages, ps, step)

    def adoptable(self, slots: torch.Tensor, tokens: list[int], seed: int) -> bool:
        """Would a reader with these prompt tokens (and chain seed) adopt these prefix-cache slots
        (whole pages, from position 0)? The backend's hand-off rule, else the reference's."""
        ps, n = self.page_size, slots.numel()
        if n == 0 or n % ps or len(tokens) < n:
            return n == 0
        rule = getattr(self.kernels, "adoptable", None) or guard_ref.adoptable
        return bool(rule(self.pages, slots[::ps], tokens[:n], seed, ps))

    def quarantine(
        self, pages: torch.Tensor, epochs: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages whose content was proven bad (unless handed out again since ``epochs``).
        Returns (pages quarantined now, those of them that were free)."""
        new, were_free = guard_ref.quarantine_pages(self.pages, pages, epochs, step)
        self.num_quarantined += int(new.numel())
        return new, were_free

    def scrub(self, pages: torch.Tensor, buffers: Sequence[KvBuffer], step: int) -> torch.Tensor:
        """Quarantined pages nobody holds any more go back to service: their bytes zeroed in
        every KV buffer (nothing of the bad content can be read again), their entry reset to
        FREE with QUARANTINED as its prior (a stale reader of it is a wrong owner, never a
        premature free to take back). Returns the pages scrubbed (each once)."""
        P, ps = self.pages, self.page_size
        pages = torch.unique(self._here(pages).to(torch.int64))
        pages = pages[P.state[pages] == PageState.QUARANTINED]
        if pages.numel() == 0:
            return pages
        slots = (pages[:, None] * ps + torch.arange(ps, device=pages.device)).reshape(-1)
        for b in buffers:
            if isinstance(b, PageMajor):  # slot s: row s % per_page of page s // per_page
                w = b.words
                s = slots[slots < w.shape[0] * w.shape[1]].to(w.device)
                w[s // w.shape[1], s % w.shape[1]] = 0
                continue
            rows = b.reshape(b.shape[0], -1).view(torch.uint8)  # FP8 has no fill kernels
            rows.index_fill_(0, slots[slots < rows.shape[0]].to(rows.device), 0)
        P.prior[pages] = PageState.QUARANTINED
        P.state[pages] = PageState.FREE
        P.fill[pages] = 0
        P.digest[pages] = 0
        P.chain[pages] = 0
        P.lpage[pages] = -1
        guard_ref._push_history(P, pages, Event.SCRUB, step, NO_ROW)
        self.num_quarantined -= int(pages.numel())
        return pages

    def reclaim(self, pages: torch.Tensor, epochs: torch.Tensor, step: int) -> torch.Tensor:
        return guard_ref.reclaim_pages(self.pages, pages, epochs, step)

    def reset(self, buffers: Sequence[KvBuffer] | None = None) -> None:
        """The engine cleared its pool (flush): every page free, nothing quarantined. Pages
        that were quarantined are scrubbed first: a flush must not hand their bytes out."""
        self._pending.clear()  # hand-outs before the clear are void
        if self.num_quarantined and buffers is not None:
            bad = torch.nonzero(self._pages.state == PageState.QUARANTINED).reshape(-1)
            self.scrub(bad, buffers, 0)
        fresh = PageArrays.empty(self.num_pages, self.device)
        for mine, new in zip(self._pages.tensors(), fresh.tensors()):
            mine.copy_(new)
        self.num_quarantined = 0

    def rebuild_free(self, held: torch.Tensor, step: int) -> torch.Tensor:
        """Idle repair after contained engine bugs: every page the engine does not hold
        (``held``: [num_pages] bool) and the guard has not quarantined is free. Returns them."""
        st = self.pages.state
        free = torch.nonzero(~held & (st != PageState.QUARANTINED)).reshape(-1)
        newly = free[st[free] != PageState.FREE]
        self.pages.prior[newly] = st[newly]
        self.pages.state[newly] = PageState.FREE
        guard_ref._push_history(self.pages, newly, Event.FREE, step, NO_ROW)
        return free

    def private_pages(self, records: RowRecords, row: int) -> torch.Tensor:
        """Pages the request on ``row`` owns privately (slow path: aborted requests)."""
        P = self.pages
        gen = records.rows.gen[row]
        mine = (P.owner == row) & (P.owner_gen == gen) & (P.state == PageState.OWNED)
        return torch.nonzero(mine).reshape(-1)

    # -- forensics and self-checks --------------------------------------------------------------------
    def describe(self, page: int) -> dict[str, object]:
        """Host-side snapshot of one page (slow path: violations only)."""
        return self.describe_many([page])[0]

    def describe_many(self, pages: list[int]) -> list[dict[str, object]]:
        """Host-side snapshots of these pages, read in one gather (slow path)."""
        if not pages:
            return []
        P = self.pages
        idx = torch.tensor(pages, dtype=torch.int64, device=P.state.device)
        cols = torch.stack(
            [
                P.state[idx].to(torch.int64),
                P.epoch[idx],
                P.owner[idx].to(torch.int64),
                P.lpage[idx].to(torch.int64),
                P.fill[idx].to(torch.int64),
            ],
            dim=1,
        ).cpu()
        hist = P.history[idx].cpu().tolist()
        out: list[dict[str, object]] = []
        for page, (state, epoch, owner, lpage, fill), entries in zip(pages, cols.tolist(), hist):
            events = []
            for v in entries:
                if v == 0:
                    continue
                row = v & NO_ROW
                events.append(
                    {
                        "step": v >> 24,
                        "event": Event((v >> 20) & 0xF).name.lower(),
                        "row": None if row == NO_ROW else row,
                    }
                )
            out.append(
                {
                    "page": page,
                    "state": PageState(state).name.lower(),
                    "epoch": epoch,
                    "owner_row": owner,
                    "logical_page": lpage,
                    "sealed_tokens": fill,
                    "history": events,
                }
            )
        return out

    def check_integrity(self, free_pages: torch.Tensor, tree_pages: torch.Tensor) -> None:
        """The ledger against the engine, when idle: every page in the engine's free list is
        FREE here, every page its prefix cache holds is SHARED (or QUARANTINED), no page is both,
        none is ALLOCATED or OWNED (no request runs), and the withheld count matches. Raises
        ``IntegrityError`` with the numbers."""
        st = self.pages.state.cpu()
        free = torch.unique(free_pages.to(torch.int64).cpu())
        tree = torch.unique(tree_pages.to(torch.int64).cpu())
        problems = []
        both = free[torch.isin(free, tree)]
        if both.numel():
            problems.append(f"{both.numel()} pages both free and cached (e.g. {both[:4].tolist()})")
        bad_free = free[st[free] != PageState.FREE]
        if bad_free.numel():
            problems.append(
                f"{bad_free.numel()} free pages not FREE in the ledger (e.g. {bad_free[:4].tolist()})"
            )
        tst = st[tree]
        bad_tree = tree[(tst != PageState.SHARED) & (tst != PageState.QUARANTINED)]
        if bad_tree.numel():
            problems.append(
                f"{bad_tree.numel()} cached pages not SHARED (e.g. {bad_tree[:4].tolist()})"
            )
        busy = torch.nonzero((st == PageState.OWNED) | (st == PageState.ALLOCATED)).reshape(-1)
        busy = busy[busy > 0]
        if busy.numel():
            problems.append(
                f"{busy.numel()} pages OWNED or ALLOCATED with no request running (e.g. {busy[:4].tolist()})"
            )
        quarantined = int((st == PageState.QUARANTINED).sum())
        if quarantined != self.num_quarantined:
            problems.append(
                f"{self.num_quarantined} pages counted quarantined but {quarantined} are"
            )
        if problems:
            raise IntegrityError("kvguard ledger disagrees with the engine: " + "; ".join(problems))

"""Tensor-parallel agreement: every rank acts on the same verdict.

Each rank hashes its own KV heads, so the ranks' verdicts of one step can differ. The batch's
verdict bits and one flag word are OR-ed over the ranks every step, and only on a step some rank
flagged do the flagged pages follow, as (page, epoch) lists: tainted on any rank, reclaimable on
every rank. So every rank aborts, quarantines and takes back exactly the same things. A rank
whose guard failed still joins the agreement, with a failure flag: no peer is left waiting.
Without peers (one rank) the words and pages are this rank's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvguard.config import ReadPath
from kvguard.healing import HealPolicy
from kvguard.kernels.guard_state import EPOCH_STEP_SHIFT
from kvguard.ledger import PageLedger
from kvguard.verdict import Kind, StepVerdict

PageEpochs = tuple[torch.Tensor, torch.Tensor]  # host (pages, their epochs when checked)
NO_PAGES: PageEpochs = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))

# The flag word that closes a step's agreement: what the per-request kinds do not say.
# BREAKER: some rank's recompute breaker is open (the step's violations abort on every rank).
TAINTED, RECLAIMING, FAILED, BREAKER = 1, 2, 4, 8


class PeerRanks(Protocol):
    """The tensor-parallel peers a verdict is agreed with (an engine adapter provides it). Every
    rank calls the same methods in the same order, once per step."""

    def or_words(self, words: torch.Tensor) -> torch.Tensor:
        """Bitwise OR of a small host int64 tensor over every rank."""
        ...

    def start_or(self, words: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The same, started now; the returned call waits for it and returns the result."""
        ...

    def gather(self, item: object) -> list[object]:
        """Every rank's ``item`` (a few pages at most), in rank order."""
        ...


def union(lists: list[PageEpochs]) -> PageEpochs:
    """Every page of any list, once, with the epoch of its first appearance."""
    pages = torch.cat([p for p, _ in lists])
    epochs = torch.cat([e for _, e in lists])
    if pages.numel() == 0:
        return NO_PAGES
    uniq, inverse = torch.unique(pages, return_inverse=True)
    first = torch.full_like(uniq, pages.numel()).scatter_reduce(
        0, inverse, torch.arange(pages.numel()), reduce="amin"
    )
    return uniq, epochs[first]


def intersection(lists: list[PageEpochs]) -> PageEpochs:
    """The pages of the first list that every other list holds too."""
    pages, epochs = lists[0]
    for other, _ in lists[1:]:
        keep = torch.isin(pages, other)
        pages, epochs = pages[keep], epochs[keep]
    return pages, epochs


class Agreement:
    def __init__(
        self,
        peers: PeerRanks | None,
        ledger: PageLedger,
        healing: HealPolicy,
        read_path: Callable[[], ReadPath],
        on_error: Callable[[str, BaseException], None],
    ):
        """``read_path``: the read path in force (``Guard.read_path``); ``on_error``: the guard's
        ``internal_error`` (a rank that cannot name its pages still joins the gather)."""
        self.peers = peers
        self.ledger = ledger
        self.healing = healing
        self.read_path = read_path
        self.on_error = on_error

    def start(self, verdict: StepVerdict, flags: tuple[bool, bool, bool]) -> None:
        """At the check, where its flags are host values (a CPU pool): start the step's agreement
        now, so that it completes during the forward. Not where attention's read is judged after
        the forward: its verdict is part of the words, so they are agreed at resolve."""
        if self.peers is None or self.read_path() is ReadPath.VERIFIED_IN_ATTENTION:
            return
        B = len(verdict.view.prefix_lens_host)
        verdict.agreement = self.peers.start_or(self.words(verdict, B, *flags))

    def mine(self, verdict: StepVerdict, B: int, events: bool) -> torch.Tensor | None:
        """At resolve, where no agreement is in flight: this rank's words, or None where there is
        nothing to agree on (one rank, a clean step, no engine ``events``)."""
        flagged, tainted, reclaim = verdict.check.flags()
        flagged = flagged or verdict.read_flagged
        if self.peers is None and not (events or flagged or tainted or reclaim):
            return None
        return self.words(verdict, B, flagged, tainted, reclaim)

    def words(
        self, verdict: StepVerdict, B: int, flagged: bool, tainted: bool, reclaim: bool
    ) -> torch.Tensor:
        """This rank's words for the step's agreement: the batch's verdict bits (the read's
        included), then a flag."""
        out = torch.zeros(B + 1, dtype=torch.int64)
        if flagged or self.peers is not None:
            out[:B] = verdict.check.kinds[:B].to(torch.int64).cpu()
        if verdict.read_flagged and verdict.read_bad is not None:
            out[:B] |= verdict.read_bad[:B].to(torch.int64) * int(Kind.READ_MISMATCH)
            tainted = tainted or bool(verdict.read_pages is not None and verdict.read_pages.numel())
        out[B] = (TAINTED if tainted else 0) | (RECLAIMING if reclaim else 0)
        if self.peers is not None and self.healing.breaker_open():
            out[B] |= BREAKER
        return out

    def agree(
        self, mine: torch.Tensor | None, in_flight: Callable[[], torch.Tensor] | None, B: int
    ) -> tuple[torch.Tensor, int]:
        """The step's agreed (verdict bits [B], flag word): ``in_flight``'s result where it was
        started at the check, else ``mine`` OR-ed over the ranks now (``mine`` None: this rank
        could not check the step, and it fails closed). FAILED on any rank: every request of
        the step is GUARD_ERROR."""
        if in_flight is not None:
            # Started when the check was done, and done during the forward. A seal that failed
            # since cannot be told to the peers this step: the tokens it did not record fail
            # their first read on this rank, and the agreed verdict aborts their readers then.
            words = in_flight()
        else:
            if mine is None:
                mine = torch.full((B + 1,), int(Kind.GUARD_ERROR), dtype=torch.int64)
                mine[B] = FAILED
            words = self.peers.or_words(mine) if self.peers is not None else mine
        kinds, word = words[:B], int(words[B])
        if word & FAILED:  # some rank could not check this step: nothing of it is served
            kinds = kinds | int(Kind.GUARD_ERROR)
        return kinds, word

    def all_ranks_ok(self, ok: bool) -> bool:
        """Whether every rank could plan its acting on a step all ranks act on (this rank's
        ``ok`` OR-ed as a failure flag over the ranks): one failing rank makes every rank fail
        the batch closed, so no rank heals a request another aborts. Called on flagged steps
        only, by every rank alike; without peers, ``ok`` itself."""
        if self.peers is None:
            return ok
        failed = self.peers.or_words(torch.tensor([0 if ok else FAILED], dtype=torch.int64))
        return not int(failed[0]) & FAILED

    def breaker_open(self, word: int) -> bool:
        """The step's recompute breaker: agreed over the ranks, else this server's own."""
        return bool(word & BREAKER) if self.peers is not None else self.healing.breaker_open()

    def pages(
        self, verdict: StepVerdict | None, word: int, host_reads_free: bool
    ) -> tuple[PageEpochs | None, PageEpochs | None]:
        """(tainted, reclaimable) pages with their epochs when checked, agreed over the ranks:
        tainted on any rank, reclaimable on every rank; (None, None) where the agreed ``word``
        says no rank has any. A rank that cannot say sends None: then nothing is taken back,
        and the others' tainted pages are still quarantined."""
        if not word & (TAINTED | RECLAIMING):
            return None, None
        mine: tuple[PageEpochs, PageEpochs] | None = None
        if verdict is not None:
            try:
                mine = self.my_pages(verdict, host_reads_free)
            except Exception as exc:
                self.on_error("resolve", exc)
        if self.peers is None:
            return mine if mine is not None else (NO_PAGES, NO_PAGES)
        every = self.peers.gather(mine)
        known = [m for m in every if m is not None]
        if not known:
            return NO_PAGES, NO_PAGES
        taint = union([m[0] for m in known])  # type: ignore[index]
        reclaim = intersection([m[1] for m in every]) if len(known) == len(every) else NO_PAGES  # type: ignore[index]
        return taint, reclaim

    def my_pages(
        self, verdict: StepVerdict, host_reads_free: bool
    ) -> tuple[PageEpochs, PageEpochs]:
        """This rank's flagged pages, as host (pages, epochs) pairs. A page claimed again after
        the check (its epoch names a later step: an epoch changes only at a claim) is its new
        owner's and is left out; one handed out but not claimed yet is left alone by quarantine
        and reclaim (ALLOCATED). So no epoch snapshot is taken at check time."""
        c = verdict.check
        read = verdict.read_pages if verdict.read_pages is not None else NO_PAGES[0]
        if verdict.suspects is not None:
            pages = verdict.suspects
        elif host_reads_free:  # CPU, nothing flagged by the check here
            pages = NO_PAGES[0]
        else:  # a GPU: the flags are read now, after the engine's sync
            pages = torch.nonzero(c.taint | c.reclaim).reshape(-1)
        t, r = c.taint[pages], c.reclaim[pages]
        if read.numel():  # pages whose bytes, as attention read them, failed their digest
            read = torch.unique(read).to(pages.device)  # once each, however many read them
            t = t | torch.isin(pages, read)
            extra = read[~torch.isin(read, pages)]
            pages = torch.cat((pages, extra))
            t = torch.cat((t, torch.ones(extra.numel(), dtype=torch.bool, device=t.device)))
            r = torch.cat((r, torch.zeros(extra.numel(), dtype=torch.bool, device=r.device)))
        epochs = self.ledger.epoch[pages]
        same = (epochs >> EPOCH_STEP_SHIFT) <= verdict.view.step
        pages, epochs, t, r = pages[same], epochs[same], t[same], r[same]
        pages, epochs, t, r = (x.cpu() for x in (pages, epochs, t, r))
        return (pages[t], epochs[t]), (pages[r], epochs[r])

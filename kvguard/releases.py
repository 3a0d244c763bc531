"""Releases: pages a request gives back to the engine's free list, checked against the ledger.

While a request is released (``attributed_to(row)``) its frees are attributed to it: a page
someone else now holds (its claim, the prefix cache's, a new hand-out) is kept from the free list,
the releasing request being its stale holder. A page released twice goes back once. A quarantined
page's last release returns it to service, scrubbed (``Quarantine.scrub``). Stale and double
frees are engine bugs, reported as engine events when the next verdict is resolved.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kvguard.actions import Actions
from kvguard.ledger import PageLedger
from kvguard.quarantine import Quarantine
from kvguard.records import RowRecords
from kvguard.verdict import Kind


class Releases:
    def __init__(
        self, ledger: PageLedger, records: RowRecords, quarantine: Quarantine, actions: Actions
    ):
        self.ledger = ledger
        self.records = records
        self.quarantine = quarantine
        self.actions = actions
        self.row: int | None = None  # of the request being released
        self.double_freed: list[torch.Tensor] = []  # pages released twice, reported at resolve
        self.stale_freed: list[torch.Tensor] = []  # pages a stale holder tried to free

    @contextmanager
    def attributed_to(self, row: int) -> Iterator[None]:
        """While the request on ``row`` is released: frees are attributed to it."""
        outer, self.row = self.row, row
        try:
            yield
        finally:
            self.row = outer

    def attribute(self, pages: torch.Tensor, row: int) -> torch.Tensor:
        """[n] bool: which of these pages the request on ``row`` may free."""
        keep = self.ledger.attributable(self.records, pages, row)
        if not bool(keep.all()):
            self.stale_freed.append(pages[~keep].to(torch.int64))
        return keep

    def release(self, pages: torch.Tensor, step: int) -> torch.Tensor:
        """Pages back to the free list: those that really may be reused (a double free is not
        pushed twice, a quarantined page goes back only scrubbed)."""
        pages = pages.to(torch.int64)
        keep, double = self.ledger.release(pages, step)
        if bool(double.any()):  # a sync on GPU, like the torch.unique SGLang's free already does
            self.double_freed.append(pages[double])
        out = pages[keep]
        if self.ledger.num_quarantined:  # a quarantined page's last holder let it go: scrub it
            bad = pages[~keep & ~double]
            if bad.numel():
                out = torch.cat((out, self.quarantine.scrub(bad).to(out.device)))
        return out

    @property
    def pending(self) -> bool:
        """Bad frees not reported yet."""
        return bool(self.double_freed or self.stale_freed)

    def report(self, step: int) -> None:
        """The bad frees since the last report, as one engine event per kind."""
        for kind, pending in (
            (Kind.DOUBLE_FREE, self.double_freed),
            (Kind.STALE_FREE, self.stale_freed),
        ):
            if pending:
                pages = torch.unique(torch.cat(pending)).cpu()
                pending.clear()
                self.actions.engine_event(kind, step, self.ledger.describe_many(pages[:8].tolist()))

    def clear(self) -> None:
        """The engine cleared its pool: nothing left to report."""
        self.double_freed.clear()
        self.stale_freed.clear()

"""Actions: the only layer that reaches back into the engine. Given a step's violations it aborts
the affected requests (through the engine adapter), quarantines pages, counts and logs."""

from __future__ import annotations

from typing import Protocol

import structlog
import torch

from kvguard.ledger import PageLedger, PageState
from kvguard.metrics import GuardMetrics
from kvguard.verdict import Violation

log = structlog.get_logger("kvguard")


class EngineControl(Protocol):
    """What an engine adapter lets the guard do."""

    def abort(self, request_handle: object, violation: Violation) -> None: ...

    def withhold_pages(self, pages: torch.Tensor) -> int:
        """Take pages out of the engine's free list (they are quarantined); returns how many
        were there."""
        ...


class Actions:
    def __init__(self, ledger: PageLedger, metrics: GuardMetrics, engine: EngineControl | None):
        self.ledger = ledger
        self.metrics = metrics
        self.engine = engine
        self.history: list[Violation] = []  # recent violations, for tests and the debug endpoint
        self.num_violations = 0  # since start: the engine's own consistency checks may now trip
        self.num_quarantined_total = 0

    def apply(
        self, violations: list[Violation], handles: list[object], bad_pages: torch.Tensor, step: int
    ):
        for violation, handle in zip(violations, handles):
            for kind in violation.kinds.names():
                self.metrics.violations.labels(kind=kind).inc()
            log.error("kv_integrity_violation", **violation.as_event())
            if handle is not None and self.engine is not None:
                self.engine.abort(handle, violation)
                self.metrics.requests_aborted.inc()
            self.history.append(violation)
            self.num_violations += 1
        del self.history[:-256]
        self.quarantine(bad_pages, step)

    def quarantine(self, pages: torch.Tensor, step: int):
        if pages.numel() == 0:
            return
        pages = torch.unique(pages.to(torch.int64))
        pages = pages[pages > 0]  # page 0 is the engine's padding page
        if pages.numel() == 0:
            return
        new = pages[self.ledger.state[pages] != PageState.QUARANTINED]
        self.num_quarantined_total += int(new.numel())
        self.ledger.quarantine(pages, step)
        self.metrics.pages_quarantined.inc(int(new.numel()))
        if self.engine is not None:
            # Pages the engine still holds are counted by it until it releases them;
            # only pages taken out of its free list are the guard's to account for.
            self.ledger.num_quarantined += self.engine.withhold_pages(new)

    def engine_event(self, violation: Violation):
        """A violation with no request to abort (e.g. a double free): count and log it."""
        self.apply([violation], [None], torch.empty(0, dtype=torch.int64), violation.step)

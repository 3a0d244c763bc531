"""Actions: the only layer that reaches back into the engine. Given a step's verdict it heals
(recomputes) or aborts the affected requests (through the engine adapter; ``healing`` decides
which), withholds the pages ``kvguard.quarantine`` takes back, records engine events (bad
frees), counts and logs."""

from __future__ import annotations

from enum import Enum
from typing import Protocol

import torch

from kvguard.config import OnViolation
from kvguard.healing import HealPolicy
from kvguard.ledger import PageLedger
from kvguard.metrics import GuardMetrics
from kvguard.ratelimit import RateLimitedLog
from kvguard.verdict import Kind, Violation, new_violation_id


class Heal(Enum):
    """How a flagged request is healed: sent back now, or on its way already."""

    RECOMPUTE = "recompute"
    AGAIN = "again"


# Per flagged request: its violation, its engine handle, how it is healed (None: aborted).
ActionPlan = list[tuple[Violation, object, "Heal | None"]]


class EngineControl(Protocol):
    """What an engine adapter lets the guard do."""

    def abort(self, request_handle: object, violation: Violation) -> bool:
        """Finish the request with an error naming the violation. False: it had finished
        already (a step in flight flagged it again): nothing more is aborted."""
        ...

    def recomputes(self, request_handle: object) -> int:
        """How often this request was sent back to be recomputed so far."""
        ...

    def emitted(self, request_handle: object) -> int:
        """Output tokens of this request already appended (and sent), before this step's: what
        a recompute keeps."""
        ...

    def recomputing(self, request_handle: object) -> bool:
        """Already on its way to a re-prefill (sent back and not re-queued yet, or retracted by
        the engine itself): a step in flight that read its old KV changes nothing."""
        ...

    def recompute(self, request_handle: object, violation: Violation) -> bool:
        """Send the request back to be recomputed: this step's output dropped, its KV released,
        re-queued with its prompt and produced tokens. False: the engine cannot for this
        request (it is aborted instead)."""
        ...

    def withhold_pages(self, pages: torch.Tensor) -> int:
        """Take pages out of the engine's free list; returns how many were there."""
        ...


class Actions:
    def __init__(
        self,
        ledger: PageLedger,
        metrics: GuardMetrics,
        engine: EngineControl | None,
        log: RateLimitedLog | None = None,
        healing: HealPolicy | None = None,
    ):
        self.ledger = ledger
        self.healing = healing
        self.metrics = metrics
        self.engine = engine
        self.log = log or RateLimitedLog(metrics)
        self.history: list[Violation] = []  # recent violations, for tests and the debug endpoint
        self.num_violations = 0  # since start: the engine's own consistency checks may now trip

    def plan(
        self, violations: list[Violation], handles: list[object], breaker_open: bool = False
    ) -> ActionPlan:
        """Decide, for each flagged request, heal or abort, touching nothing in the engine (so a
        failure here leaves every rank free to fail the step closed alike). ``breaker_open``:
        the step's recompute breaker (agreed over tensor-parallel ranks), so every rank decides
        alike."""
        return [(v, h, self._heal_plan(v, h, breaker_open)) for v, h in zip(violations, handles)]

    def apply(self, plan: ActionPlan) -> None:
        """Carry out a plan: heal (send back for recompute) or abort each request."""
        for violation, handle, heal in plan:
            if heal is not None and self._heal(violation, handle, heal):
                continue
            self._abort(violation, handle)

    def act(
        self, violations: list[Violation], handles: list[object], breaker_open: bool = False
    ) -> None:
        """Plan and apply at once (one rank, nothing to agree on)."""
        self.apply(self.plan(violations, handles, breaker_open))

    def abort(self, violations: list[Violation], handles: list[object]) -> None:
        """Abort every one of them (a step the guard could not judge)."""
        for violation, handle in zip(violations, handles):
            self._abort(violation, handle)

    def _abort(self, violation: Violation, handle: object) -> None:
        engine = self.engine
        if handle is not None and engine is not None:
            if engine.abort(handle, violation):
                self.metrics.requests_aborted.inc()
            else:  # it had finished: nothing of it is served again, nothing to abort
                violation.action = "none"
        self._record(violation)

    def _heal_plan(self, violation: Violation, handle: object, breaker_open: bool) -> Heal | None:
        """How the request is healed (``AGAIN``: it is on its way already, ``RECOMPUTE``: send
        it back), or None: abort it (``violation.why_not_healed`` says why, where recompute was
        asked)."""
        engine = self.engine
        if handle is None or engine is None or self.healing is None:
            return None
        if self.healing.config.on_violation is not OnViolation.RECOMPUTE:
            return None
        done = engine.recomputes(handle)
        violation.recomputes = done
        if engine.recomputing(handle):
            # Seen again by a step launched before it was sent back (or while SGLang itself had
            # retracted it): that step's output is dropped with it and it re-prefills anyway.
            return Heal.AGAIN
        why = self.healing.why_not(violation.kinds, done, breaker_open, engine.emitted(handle))
        if why is None:
            return Heal.RECOMPUTE
        violation.action, violation.why_not_healed = "abort", why
        return None

    def _heal(self, violation: Violation, handle: object, heal: Heal) -> bool:
        """True: the request is healed (sent back now, or already on its way); else it is to be
        aborted (``violation.why_not_healed`` says why)."""
        assert self.engine is not None and self.healing is not None
        violation.action = "recompute"
        if heal is Heal.AGAIN:
            self._record(violation)
            return True
        done = violation.recomputes
        violation.recomputes = done + 1
        if self.engine.recompute(handle, violation):
            self.healing.healed()
            self._record(violation)
            return True
        why = violation.why_not_healed or "the engine cannot requeue this request"
        violation.action, violation.recomputes, violation.why_not_healed = "abort", done, why
        return False

    def withhold(self, pages: torch.Tensor) -> None:
        """Take these pages out of the engine's free list (``Quarantine.reclaim``)."""
        if self.engine is not None:
            self.engine.withhold_pages(pages)

    def engine_event(self, kinds: Kind, step: int, pages: list[dict[str, object]]) -> None:
        """A violation with no request to abort (double free, stale free, premature free)."""
        self._record(Violation(new_violation_id(), kinds, step, None, None, pages))

    def _record(self, violation: Violation) -> None:
        for kind in violation.kinds.names():
            self.metrics.violations.labels(kind=kind).inc()
        self.log("error", "kv_integrity_violation", **violation.as_event())
        self.history.append(violation)
        del self.history[:-256]
        self.num_violations += 1

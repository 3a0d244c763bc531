"""Healing: whether a request whose KV the guard found bad is recomputed instead of aborted.

A request is healed only where no token computed from bad bytes can have left the server:
healing keeps the tokens it already emitted, so they must have come from bytes verified as
attention read them. That is the read path in force (``ReadPath``, decided once by the guard), not
the mode asked for:

* ``verified_in_attention`` (``verified``, ``paranoid`` with the attention read hashed): a flagged
  step's tokens are dropped and everything the request already produced came from verified
  reads: healed.
* ``pre_forward_check`` (the same modes on another attention backend or a GPU pool): a read
  checked before the forward may change during it; the token computed from it leaves, and only
  the next step's check flags the request. So a read violation of a request that already emitted
  tokens is aborted; one found before its first token (a prefill), or on this step's writes
  alone (refused before they land), is still healed.
* ``none`` (``tags``, ``sampled``: content checked late or not at all): aborted.

A step the guard could not judge (``guard_error``) is aborted too.

Healing must not hide a broken deployment: each request is healed at most ``recompute_budget``
times, and a server-wide breaker switches to abort while more than
``recompute_breaker_per_minute`` recomputes happened in the trailing minute. Under tensor
parallelism the breaker's state is agreed with the step's verdict (its own flag bit), so every
rank takes the same decision for the same request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import structlog

from kvguard.config import GuardConfig, OnViolation, ReadPath
from kvguard.metrics import GuardMetrics
from kvguard.verdict import Kind

log = structlog.get_logger("kvguard")
WINDOW_S = 60.0
# Kinds found on the step's own writes, before the forward, which firewalls them: they say nothing
# of what the request read. Every other kind may (a kind the write check shares with the read
# check, as wrong_owner, counts as a read).
WRITE_KINDS = Kind.TABLE_MISMATCH | Kind.WRITE_TO_SHARED | Kind.OVERWRITE | Kind.DOUBLE_ALLOCATION


class HealPolicy:
    def __init__(
        self,
        config: GuardConfig,
        metrics: GuardMetrics,
        clock: Callable[[], float] = time.monotonic,
        read_path: Callable[[], ReadPath] | None = None,
    ):
        """``read_path``: the read path in force (the guard's ``Guard.read_path``); without one,
        the weaker of the mode's (reads not hashed in attention)."""
        self.config = config
        self.read_path: Callable[[], ReadPath] = read_path or (lambda: self.config.read_path(False))
        self.metrics = metrics
        self.clock = clock
        self._recent: deque[float] = deque()  # when the trailing minute's recomputes happened
        self._open = False

    def breaker_open(self) -> bool:
        """This server's recompute rate is past the breaker's threshold (rank-local: under TP the
        guard agrees it over the ranks before acting)."""
        limit = self.config.recompute_breaker_per_minute
        if limit == 0 or self.config.on_violation is not OnViolation.RECOMPUTE:
            return False
        horizon = self.clock() - WINDOW_S
        while self._recent and self._recent[0] < horizon:
            self._recent.popleft()
        is_open = len(self._recent) >= limit
        if is_open != self._open:
            self._open = is_open
            self.metrics.recompute_breaker_open.set(int(is_open))
            if is_open:
                log.error(
                    "kvguard_recompute_breaker_open",
                    recomputes_last_minute=len(self._recent),
                    limit=limit,
                    hint="requests whose KV goes bad are aborted until the rate falls: "
                    "the deployment is faulting too often to heal",
                )
            else:
                log.warning("kvguard_recompute_breaker_closed")
        return is_open

    def why_not(self, kinds: Kind, recomputes: int, breaker_open: bool, emitted: int) -> str | None:
        """None: heal this request; else why it is aborted. ``recomputes``: how often it was
        healed already; ``breaker_open``: the step's (agreed) breaker state; ``emitted``: tokens
        it already sent (appended before this step's), which healing would keep."""
        c = self.config
        if c.on_violation is not OnViolation.RECOMPUTE:
            return "on_violation=abort"
        path = self.read_path()
        if path is ReadPath.NONE:
            return f"mode {c.mode.value} does not verify reads before tokens leave"
        if kinds & Kind.GUARD_ERROR:
            return "the guard could not judge the step"
        if path is ReadPath.PRE_FORWARD_CHECK and emitted > 0 and int(kinds) & ~int(WRITE_KINDS):
            return (
                "read path pre_forward_check: reads are checked before the forward, so the "
                f"{emitted} token(s) already emitted may come from bytes changed since"
            )
        if recomputes >= c.recompute_budget:
            return f"recompute budget spent ({c.recompute_budget})"
        if breaker_open:
            return "recompute breaker open"
        return None

    def healed(self) -> None:
        """A request was sent back to be recomputed."""
        self._recent.append(self.clock())
        self.metrics.requests_recomputed.inc()

"""Whether the guard can still vouch for what its server serves.

The guard fails closed, never open: when it cannot check (its hooks keep failing) or when the
pool it guards is too damaged (quarantine at its cap), it says so here; the engine adapter then
reports the server unhealthy (a router drains it) and refuses new requests with a clear error,
while running requests finish under the guard. Quarantine recovers by itself (pages are scrubbed
and return to service as their holders release them); repeated internal failures latch until a
restart, since a guard that cannot run its own code is a deployment problem to look at.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

# Failed checks among the last CHECK_WINDOW steps that turn the server unhealthy: 8 in a row, or
# intermittent failures at a rate of 1 in 8 (each of which aborted a batch while /health said 200).
FAILURES_TO_FAIL_CLOSED = 8
CHECK_WINDOW = 64


class GuardHealth:
    def __init__(self, quarantine_cap_pages: int) -> None:
        self.quarantine_cap_pages = quarantine_cap_pages
        self.consecutive_failures = 0
        self._recent: deque[bool] = deque(maxlen=CHECK_WINDOW)  # True: that step's check failed
        self._failed: str | None = None  # latched: internal failures
        self._over_cap: str | None = None  # clears once quarantine is back under half the cap
        self.listeners: list[Callable[[str | None], None]] = []

    @property
    def healthy(self) -> bool:
        return self.reason is None

    @property
    def reason(self) -> str | None:
        """Why the guard failed closed (None: healthy)."""
        return self._failed or self._over_cap

    def step_failed(self, where: str) -> None:
        self.consecutive_failures += 1
        self._recent.append(True)
        failed = sum(self._recent)
        if failed >= FAILURES_TO_FAIL_CLOSED and self._failed is None:
            self._set(
                "_failed",
                f"kvguard failed {failed} of its last {len(self._recent)} checks (last in "
                f"{where}); restart the server",
            )

    def latch(self, reason: str) -> None:
        """Fail closed until a restart."""
        if self._failed is None:
            self._set("_failed", reason)

    def step_succeeded(self) -> None:
        self.consecutive_failures = 0
        self._recent.append(False)

    def quarantined(self, pages_now: int) -> None:
        cap = self.quarantine_cap_pages
        if pages_now >= cap and self._over_cap is None:
            self._set(
                "_over_cap",
                f"kvguard quarantined {pages_now} KV pages (cap {cap}): the engine is "
                "corrupting KV faster than it can be contained",
            )
        elif pages_now < max(1, cap // 2) and self._over_cap is not None:  # no flapping
            self._set("_over_cap", None)

    def _set(self, field: str, value: str | None) -> None:
        before = self.reason
        setattr(self, field, value)
        if self.reason != before:
            for listener in self.listeners:
                listener(self.reason)

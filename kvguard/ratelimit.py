"""Log lines under a storm: at most a few per event and window, the rest counted.

A fault every step must not turn the scheduler into a log writer. Each event name gets
``burst`` lines per ``window_s`` (64 per 10 s: every forensic record of an incident, not of a storm); the lines it drops are counted (``kvguard_log_suppressed_total``)
and the next line it writes says how many were dropped since the last one.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from kvguard.metrics import GuardMetrics


class RateLimitedLog:
    def __init__(
        self, metrics: GuardMetrics, burst: int = 64, window_s: float = 10.0, logger: Any = None
    ) -> None:
        self.metrics = metrics
        self.burst, self.window_s = burst, window_s
        self.log = logger or structlog.get_logger("kvguard")
        self._windows: dict[str, tuple[float, int, int]] = {}  # event: (start, written, dropped)

    def __call__(self, level: str, event: str, **fields: Any) -> bool:
        """Write the line unless its event is over budget. Returns whether it was written."""
        now = time.monotonic()
        start, written, dropped = self._windows.get(event, (now, 0, 0))
        if now - start >= self.window_s:
            start, written = now, 0
        if written >= self.burst:
            self._windows[event] = (start, written, dropped + 1)
            self.metrics.log_suppressed.inc()
            return False
        if dropped:
            fields["suppressed_since_last"] = dropped
        self._windows[event] = (start, written + 1, 0)
        getattr(self.log, level)(event, **fields)
        return True

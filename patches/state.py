"""Per-scheduler-process state of the SGLang adapter: the guard, its scheduler, and the batch
whose forward is in flight on this thread. One guard per scheduler process (the plugin loads
into each); every hook module reads it from here."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from kvguard.guard import Guard

log = structlog.get_logger("kvguard")

guard: Guard | None = None
# the guard's engine control (patches.control.SGLangControl: requests sent back)
control: Any = None
scheduler: Any = None
local = threading.local()  # .batch: the ScheduleBatch of the forward in flight; .verdict
# Benchmarks only: a file whose content ("off", "tags", ...) switches the mode between steps.
mode_file = os.environ.get("KVGUARD_MODE_FILE")
_mode_mtime: int | None = None


def active_guard() -> Guard | None:
    return guard


def on() -> bool:
    """A guard is attached and checking (a benchmark may switch it to ``off`` at run time: then
    every hook is inert, and the ledger is reset by the pool flush that precedes the next mode)."""
    return guard is not None and guard.active


def single_rank() -> bool:
    """Host-side decisions from a rank's own unread verdict are only safe without tensor
    parallelism: ranks' checksum verdicts differ until they are OR-reduced at resolve."""
    return scheduler is not None and getattr(scheduler, "tp_size", 1) == 1


def reload_mode() -> None:
    global _mode_mtime
    if mode_file is None or guard is None:
        return
    try:
        mtime = os.stat(mode_file).st_mtime_ns
        if mtime != _mode_mtime:
            _mode_mtime = mtime
            with open(mode_file) as f:
                guard.set_mode(f.read().strip())
            log.info("kvguard_mode_switched", mode=guard.config.mode.value)
    except (OSError, ValueError):
        pass

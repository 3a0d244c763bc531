"""Report the guard's state in SGLang's scheduler start-up handshake.

Each scheduler process answers its parent with ``Scheduler.get_init_info()`` once it is ready; the
parent keeps the answers (``Engine._scheduler_init_result.scheduler_infos``) and merges rank 0's
into ``Engine.get_server_info()`` and HTTP ``/server_info``. An AFTER hook adds one key,
``"kvguard"``, so that the process that started the engine can see, without a round trip, that the
guard really runs inside every scheduler: ``kvguard.install`` checks it.
"""

from __future__ import annotations

import os
from typing import Any

STATUS_KEY = "kvguard"  # the key added to each scheduler's handshake


def guard_status() -> dict[str, Any]:
    """This scheduler process's guard, as plain builtins (the handshake is pickled)."""
    from kvguard.patches.state import active_guard

    guard = active_guard()
    status: dict[str, Any] = {"active": guard is not None, "pid": os.getpid()}
    if guard is not None:
        try:
            status.update(guard.status())
        except Exception as exc:  # the handshake must not fail with the guard
            guard.internal_error("status", exc)
            status["error"] = repr(exc)
    return status


# -- Scheduler.get_init_info (AFTER) -------------------------------------------------------------
def add_to_init_info(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    if isinstance(result, dict):
        result[STATUS_KEY] = guard_status()
    return result


def scheduler_statuses(engine: Any) -> list[dict[str, Any] | None]:
    """One guard report per scheduler process of an in-process ``engine`` (None: that scheduler
    has no guard), read back from SGLang's handshake in the parent."""
    init = getattr(engine, "_scheduler_init_result", None)  # every rank's handshake (SGLang 0.5.23)
    infos = getattr(init, "scheduler_infos", None)
    if infos is None:
        infos = [engine.get_server_info()]  # public, rank 0 only
    return [info.get(STATUS_KEY) if isinstance(info, dict) else None for info in infos]

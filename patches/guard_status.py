"""Report the guard's state in SGLang's scheduler start-up handshake.

Each scheduler process answers its parent with ``Scheduler.get_init_info()`` once it is ready; the
parent keeps the answers (``Engine._scheduler_init_result.scheduler_infos``) and merges rank 0's
into ``Engine.get_server_info()`` and HTTP ``/server_info``. An AFTER hook adds one key,
``"kvguard"``, so that the process that started the engine can see, without a round trip, that the
guard really runs inside every scheduler: ``kvguard.install`` checks it.
"""

from __future__ import annotations

import os

from kvguard.engine_status import STATUS_KEY


def guard_status() -> dict:
    """This scheduler process's guard, as plain builtins (the handshake is pickled)."""
    from kvguard.patches.state import active_guard

    guard = active_guard()
    status: dict = {"active": guard is not None, "pid": os.getpid()}
    if guard is not None:
        try:
            status.update(guard.status())
        except Exception as exc:  # the handshake must not fail with the guard
            guard.internal_error("status", exc)
            status["error"] = repr(exc)
    return status


# -- Scheduler.get_init_info (AFTER) -------------------------------------------------------------
def add_to_init_info(result, scheduler, *args, **kwargs):
    if isinstance(result, dict):
        result[STATUS_KEY] = guard_status()
    return result

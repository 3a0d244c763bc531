"""Failures of the guard itself, injected inside a live scheduler: does a guard that breaks fail
closed (its step's requests aborted, their writes firewalled) and keep the server serving?

A plan entry ``{"cls": "guard_fault", "hook": "alloc", "after": 3, "count": 1}`` in the fuzz
control file arms one: the hook's calls after arming are counted, and the ``count`` calls after
the first ``after`` raise. Hooks, by what the engine does when it reaches them: ``alloc``
(allocator hand-out), ``free`` (pages back to the free list), ``row`` (a page-table row handed to a
request), ``match`` (a prefix-cache hit judged), ``insert`` (a request's KV enters the prefix
cache), ``check`` (before the forward), ``seal`` (after it), ``resolve`` (acting on a verdict:
on flagged steps). Each failure is logged as a
``guard_fault`` event.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

# hook name -> the Guard method the engine reaches it through
HOOKS = {
    "alloc": "on_alloc",
    "free": "on_release",
    "row": "on_rows_allocated",
    "match": "adoptable",
    "insert": "on_share",
    "check": "before_forward",
    "seal": "after_forward",
    "resolve": "plan_actions",
}


class InjectedGuardFailure(RuntimeError):
    """A failure the fuzz tool made the guard raise."""


_armed: dict[str, list[int]] = {}  # hook -> [calls to let pass, calls to fail]
_installed = False


def arm(entry: dict, log: Callable[[dict], None]) -> None:
    """Arm a plan entry's fault in this process."""
    global _installed
    hook = entry.get("hook")
    if hook not in HOOKS:
        raise ValueError(f"guard_fault: hook {hook!r}, expected one of {list(HOOKS)}")
    if not _installed:
        from kvguard.guard import Guard

        for name, method in HOOKS.items():
            setattr(Guard, method, _failing(getattr(Guard, method), name, log))
        _installed = True
    _armed[hook] = [int(entry.get("after", 0)), int(entry.get("count", 1))]


def _failing(original, hook: str, log: Callable[[dict], None]):  # type: ignore[no-untyped-def]
    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        left = _armed.get(hook)
        if left is not None:
            if left[0] > 0:
                left[0] -= 1
            elif left[1] > 0:
                left[1] -= 1
                log({"event": "guard_fault", "hook": hook, "step": self.step})
                raise InjectedGuardFailure(f"kvguard fuzz: injected {hook} failure")
        return original(self, *args, **kwargs)

    return wrapper

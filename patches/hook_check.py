"""Every hook applied, or no start.

SGLang's ``HookRegistry.apply_hooks`` logs a target it cannot patch and goes on, and it never says
whether a hook is still in place afterwards. On another SGLang build a missing target (say
``Scheduler.process_batch_result``) would let tokens leave unchecked while the guard reports
itself active. So the plugin names the rows this process needs (:func:`require`), and right after
SGLang applied every plugin's hooks, in the same process, each row is checked:

- the target resolves (SGLang has that function);
- walking the attribute's chain of HookRegistry wrappers from the outside in, kvguard's hook is
  there with the row's hook type;
- below it the chain ends at the very object the target named before any hook was applied
  (resolved just before ``apply_hooks``), not at another plugin's REPLACE or a stand-in.

A row not in place refuses the start in one line naming the target: :class:`HooksNotApplied`, a
``SystemExit`` (SGLang's plugin loader and scheduler catch ``Exception`` only). Uncaught, it
prints ``kvguard: error: ...`` and exits 1: a scheduler dies before it builds anything, and the
server that spawned it fails to start; ``kvguard-serve`` catches it in its own process and
refuses with ``kvguard-serve: error: ...``, exit 2. The check costs one attribute walk per row.

Test switch: ``KVGUARD_TEST_DROP_HOOK=<dotted target>`` leaves that target's rows unregistered
(as when SGLang could not apply them) in every process; ``children:<dotted target>`` only in
processes another process started (the schedulers), so the HTTP process starts and the
scheduler refuses.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Row = tuple[str, str, str, str]  # (dotted target, hook type, hook in kvguard.patches, why)

DROP_HOOK = "KVGUARD_TEST_DROP_HOOK"
_CHILDREN = "children:"


class HooksNotApplied(SystemExit):
    """A row of this process's hook tables is not in place. ``line`` names it (one line);
    uncaught, the process prints ``kvguard: error: <line>`` and exits 1."""

    def __init__(self, line: str) -> None:
        super().__init__(f"kvguard: error: {line}")
        self.line = line


class Unresolved:
    """A target SGLang does not have (why, in one line)."""

    def __init__(self, error: BaseException) -> None:
        first = str(error).strip().splitlines()
        self.why = f"{type(error).__name__}: {first[0]}" if first else type(error).__name__


# -- the rows this process needs, checked after SGLang applied the hooks --------------------------
_required: list[Row] = []
_originals: dict[str, object] = {}  # target -> what it named before any hook (or Unresolved)


def require(rows: Iterable[Row]) -> None:
    """The plugin's rows for this process: checked as soon as SGLang applied the hooks (its
    ``HookRegistry.apply_hooks``, called by ``load_plugins()`` after every plugin registered)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    _required.extend(rows)
    if getattr(HookRegistry.apply_hooks, "__kvguard_checked__", False):
        return
    apply: Callable[[], None] = HookRegistry.apply_hooks

    def apply_hooks_checked(cls: type) -> None:
        _originals.update({t: o for t, o in snapshot(_required).items() if t not in _originals})
        apply()
        refuse_unless_applied(_required, _originals)

    apply_hooks_checked.__kvguard_checked__ = True  # type: ignore[attr-defined]
    HookRegistry.apply_hooks = classmethod(apply_hooks_checked)


def rows_registered(rows: Sequence[Row]) -> list[Row]:
    """``rows`` less those the test switch :data:`DROP_HOOK` drops in this process."""
    value = os.environ.get(DROP_HOOK, "")
    if value.startswith(_CHILDREN):
        value = value.removeprefix(_CHILDREN) if multiprocessing.parent_process() else ""
    return [row for row in rows if row[0] != value] if value else list(rows)


def refuse_unless_applied(rows: Sequence[Row], originals: Mapping[str, object]) -> None:
    """Raise :class:`HooksNotApplied` naming the first row not in place (and how many more)."""
    lines = not_in_place(rows, originals)
    if not lines:
        return
    if multiprocessing.parent_process() is not None:  # a scheduler: the log says which rows
        import structlog

        structlog.get_logger("kvguard").error("kvguard_hooks_not_applied", rows=lines)
    more = len(lines) - 1
    raise HooksNotApplied(lines[0] + (f" (and {more} more row(s) not in place)" if more else ""))


# -- the check ------------------------------------------------------------------------------------
def snapshot(rows: Iterable[Row]) -> dict[str, object]:
    """What each row's target names now (before the hooks are applied), in SGLang's order of
    application (by name): the object a hook must end up wrapping, or :class:`Unresolved`."""
    out: dict[str, object] = {}
    for target in sorted({row[0] for row in rows}):
        try:
            out[target] = _raw_attribute(target)
        except Exception as e:  # ImportError, AttributeError, ...: SGLang's apply fails alike
            out[target] = Unresolved(e)
    return out


def not_in_place(rows: Sequence[Row], originals: Mapping[str, object]) -> list[str]:
    """One line per row whose hook is not in place, naming its target: the target does not
    resolve, kvguard's hook is not in its chain of HookRegistry wrappers, or the chain does not
    end at ``originals[target]`` (SGLang's function, before the hooks were applied)."""
    wrappers = _wrapper_codes()
    out = []
    for target, hook_type, hook_path, _why in rows:
        what = f"{target}: kvguard's {hook_type} hook {hook_path}"
        original = originals.get(target)
        if isinstance(original, Unresolved):
            out.append(f"{target}: this SGLang has no such target ({original.why})")
            continue
        try:
            current = _raw_attribute(target)
        except Exception as e:
            out.append(f"{target}: this SGLang has no such target ({Unresolved(e).why})")
            continue
        try:
            module, fn = hook_path.rsplit(".", 1)
            hook = getattr(importlib.import_module(f"kvguard.patches.{module}"), fn)
        except Exception as e:
            out.append(f"{what} cannot be imported ({Unresolved(e).why})")
            continue
        found, base = _find(current, hook, hook_type, wrappers)
        if not found:
            out.append(f"{what} was not applied (the target is {_now(current, original)})")
        elif target not in originals:
            out.append(f"{what}: what it wraps was not recorded before the hooks were applied")
        elif base is not original:
            out.append(f"{what} does not wrap SGLang's function (it wraps {_name(base)})")
    return out


def _find(
    fn: object, hook: object, hook_type: str, wrappers: Mapping[Any, str]
) -> tuple[bool, object]:
    """Walk ``fn``'s HookRegistry wrappers outside in: whether ``hook`` of ``hook_type`` is one,
    and what the chain ends at (SGLang's function, or a REPLACE wrapper: the end of the calls)."""
    found = False
    while (kind := wrappers.get(getattr(fn, "__code__", None))) is not None and kind != "REPLACE":
        found = found or (kind == hook_type and _closure(fn).get("hook") is hook)
        fn = fn.__wrapped__  # type: ignore[attr-defined]
    return found, fn


def _wrapper_codes() -> dict[Any, str]:
    """The code of each of HookRegistry's wrappers (``_wrap_fn``), by hook type name."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    def probe(*args: Any, **kwargs: Any) -> None:
        return None

    return {_wrap_fn(probe, probe, t).__code__: t.name for t in HookType}


def _closure(fn: Any) -> dict[str, Any]:
    cells = fn.__closure__ or ()
    return {name: cell.cell_contents for name, cell in zip(fn.__code__.co_freevars, cells)}


def _raw_attribute(target: str) -> object:
    """The target as HookRegistry takes it: a class's own classmethod or staticmethod unwrapped
    (its ``__func__``), anything else as ``getattr`` gives it."""
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    value = getattr(owner, attr)
    if isinstance(owner, type):
        raw = owner.__dict__.get(attr)
        if isinstance(raw, (classmethod, staticmethod)):
            return raw.__func__
    return value


def _now(current: object, original: object) -> str:
    """What a target without kvguard's hook is, in a few words."""
    if current is original:
        return "SGLang's function, unwrapped"
    if _wrapper_codes().get(getattr(current, "__code__", None)) not in (None, "REPLACE"):
        return "wrapped by other hooks only"
    return _name(current)


def _name(obj: object) -> str:
    kind = _wrapper_codes().get(getattr(obj, "__code__", None))
    if kind == "REPLACE":
        return f"another plugin's REPLACE hook {_name(_closure(obj).get('hook'))}"
    module = getattr(obj, "__module__", None) or "?"
    return f"{module}.{getattr(obj, '__qualname__', type(obj).__name__)}"

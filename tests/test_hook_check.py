"""Every hook applied, or no start (patches/hook_check.py).

Fast: the check against real SGLang targets and kvguard's real hooks, wrapped the way SGLang's
HookRegistry wraps them (its own ``_wrap_fn``): rows in place pass; a target SGLang does not have,
a hook not applied, a hook applied as another type, a target replaced after the hooks were
applied, and a hook wrapping another plugin's REPLACE are each reported by name.
Engine: ``kvguard-serve`` with one row dropped (test switch ``KVGUARD_TEST_DROP_HOOK``) refuses in
its own process (one line, exit 2, before any scheduler starts) and, dropped in the schedulers
only, fails to start: the scheduler refuses before it builds anything, and nothing is served."""

from __future__ import annotations

import pkgutil
import re

import pytest

from kvguard.patches import targets
from kvguard.patches.hook_check import (
    DROP_HOOK,
    HooksNotApplied,
    not_in_place,
    refuse_unless_applied,
    rows_registered,
    snapshot,
)

SCHED = "sglang.srt.managers.scheduler.Scheduler"
RESULTS = f"{SCHED}.process_batch_result"


def row(target: str, hook_type: str | None = None) -> tuple[str, str, str, str]:
    """The row of targets.py for ``target`` (of ``hook_type`` where a target has several)."""
    tables = [rows for name, rows in vars(targets).items() if name.endswith("_TARGETS")]
    return next(r for rows in tables for r in rows if r[0] == target and hook_type in (None, r[1]))


ROWS = [
    row(RESULTS),  # AROUND: the verdict read before tokens leave
    row(f"{SCHED}.__init__", "BEFORE"),  # two rows, one target
    row(f"{SCHED}.__init__", "AFTER"),
    row("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc"),  # AFTER
    # a classmethod: HookRegistry wraps its function and puts the classmethod back
    row(
        "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry"
        ".get_handler"
    ),
]


@pytest.fixture(autouse=True)
def sglangs_own_functions(monkeypatch):
    """Each target of ROWS as SGLang defines it, for the test: an in-process engine started by an
    earlier test in this process (its tokenizer side loads the plugins) left the hooks applied."""
    from kvguard.patches.hook_check import _find, _wrapper_codes

    wrappers = _wrapper_codes()
    for target in {r[0] for r in ROWS}:
        owner_path, attr = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        raw = owner.__dict__.get(attr)
        method = isinstance(raw, classmethod)
        current = raw.__func__ if method else getattr(owner, attr)
        _, base = _find(current, None, "", wrappers)
        if base is not current:
            monkeypatch.setattr(owner, attr, classmethod(base) if method else base)


@pytest.fixture
def registry():
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    return HookType, _wrap_fn


def _hook(hook_path: str):
    import importlib

    module, fn = hook_path.rsplit(".", 1)
    return getattr(importlib.import_module(f"kvguard.patches.{module}"), fn)


def apply(monkeypatch, registry, rows, hook_type: str | None = None) -> None:
    """Apply ``rows`` as HookRegistry._apply_target does (restored after the test)."""
    HookType, wrap = registry
    for target, row_type, hook_path, _why in rows:
        owner_path, attr = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else None
        method = isinstance(raw, classmethod)
        current = raw.__func__ if method else getattr(owner, attr)
        wrapped = wrap(current, _hook(hook_path), HookType[hook_type or row_type])
        monkeypatch.setattr(owner, attr, classmethod(wrapped) if method else wrapped)


def test_rows_in_place_pass(monkeypatch, registry):
    originals = snapshot(ROWS)
    apply(monkeypatch, registry, ROWS)
    assert not_in_place(ROWS, originals) == []


def test_other_hooks_around_kvguard_s_pass(monkeypatch, registry):
    """Another plugin's hook outside kvguard's, calling through, leaves kvguard's in place."""
    HookType, wrap = registry
    originals = snapshot(ROWS)
    apply(monkeypatch, registry, ROWS)
    owner = pkgutil.resolve_name(SCHED)
    outer = wrap(owner.process_batch_result, lambda result, *a, **k: None, HookType.AFTER)
    monkeypatch.setattr(owner, "process_batch_result", outer)
    assert not_in_place(ROWS, originals) == []


def test_hook_not_applied_is_named(monkeypatch, registry):
    originals = snapshot(ROWS)
    apply(monkeypatch, registry, [r for r in ROWS if r[0] != RESULTS])
    assert not_in_place(ROWS, originals) == [
        f"{RESULTS}: kvguard's AROUND hook forward_hooks.around_process_batch_result was not "
        "applied (the target is SGLang's function, unwrapped)"
    ]


def test_target_sglang_does_not_have_is_named(monkeypatch, registry):
    """A renamed method and a module that is gone: what another SGLang build may lack."""
    gone = [
        (f"{RESULTS}_v2", *row(RESULTS)[1:]),
        ("sglang.srt.managers.scheduler_gone.Scheduler.run", *row(RESULTS)[1:]),
    ]
    originals = snapshot(ROWS + gone)
    apply(monkeypatch, registry, ROWS)
    lines = not_in_place(ROWS + gone, originals)
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{RESULTS}_v2: this SGLang has no such target (AttributeError: ")
    assert lines[1].startswith(
        "sglang.srt.managers.scheduler_gone.Scheduler.run: this SGLang has no such target "
        "(AttributeError: module 'sglang.srt.managers' has no attribute 'scheduler_gone')"
    )


def test_hook_applied_as_another_type_is_not_in_place(monkeypatch, registry):
    alloc = row("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc")
    originals = snapshot([alloc])
    apply(monkeypatch, registry, [alloc], hook_type="BEFORE")
    (line,) = not_in_place([alloc], originals)
    assert line.startswith(
        f"{alloc[0]}: kvguard's AFTER hook pool_hooks.on_slots_allocated was not"
    )


def test_target_replaced_after_the_hooks_is_named(monkeypatch, registry):
    """Something rebinds the method after SGLang applied the hooks: kvguard's hook is gone."""
    originals = snapshot(ROWS)
    apply(monkeypatch, registry, ROWS)

    def process_batch_result(self, batch, result):
        return None

    owner = pkgutil.resolve_name(SCHED)
    monkeypatch.setattr(owner, "process_batch_result", process_batch_result)
    (line,) = not_in_place(ROWS, originals)
    assert line.startswith(f"{RESULTS}: kvguard's AROUND hook forward_hooks.around_process_batch")
    assert re.search(
        r"was not applied \(the target is \S+\.<locals>\.process_batch_result\)$", line
    ), line


def test_hook_wrapping_another_plugin_s_replacement_is_named(monkeypatch, registry):
    """HookRegistry applies REPLACE first: kvguard's hook runs, SGLang's function never does."""
    HookType, wrap = registry
    originals = snapshot(ROWS)
    owner = pkgutil.resolve_name(SCHED)

    def their_results(self, batch, result):
        return None

    replaced = wrap(owner.process_batch_result, their_results, HookType.REPLACE)
    monkeypatch.setattr(owner, "process_batch_result", replaced)
    apply(monkeypatch, registry, ROWS)
    (line,) = not_in_place(ROWS, originals)
    assert re.fullmatch(
        rf"{re.escape(RESULTS)}: kvguard's AROUND hook forward_hooks\.around_process_batch_result "
        r"does not wrap SGLang's function \(it wraps another plugin's REPLACE hook "
        r"\S+\.their_results\)",
        line,
    ), line


def test_refusal_is_one_line_naming_the_first_row(monkeypatch, registry):
    originals = snapshot(ROWS)
    with pytest.raises(HooksNotApplied) as exc:
        refuse_unless_applied(ROWS, originals)
    assert isinstance(exc.value, SystemExit)  # SGLang's loader and scheduler catch Exception only
    assert exc.value.line.startswith(f"{RESULTS}: kvguard's AROUND hook ")
    assert exc.value.line.endswith(f"(and {len(ROWS) - 1} more row(s) not in place)")
    assert exc.value.code == f"kvguard: error: {exc.value.line}"  # printed, exit 1, uncaught
    assert "\n" not in exc.value.line
    apply(monkeypatch, registry, ROWS)
    refuse_unless_applied(ROWS, originals)  # all in place: nothing raised


def test_drop_switch(monkeypatch):
    monkeypatch.setenv(DROP_HOOK, RESULTS)
    assert [r[0] for r in rows_registered(ROWS)] == [r[0] for r in ROWS[1:]]
    monkeypatch.setenv(DROP_HOOK, f"children:{RESULTS}")  # this process started no other
    assert rows_registered(ROWS) == ROWS
    monkeypatch.delenv(DROP_HOOK)
    assert rows_registered(ROWS) == ROWS


# -- a real start ---------------------------------------------------------------------------------
LINE = (
    f"{RESULTS}: kvguard's AROUND hook forward_hooks.around_process_batch_result was not applied "
    "(the target is SGLang's function, unwrapped)"
)


@pytest.mark.engine
def test_kvguard_serve_refuses_a_hook_not_in_place(serve_processes):
    """Dropped everywhere: the HTTP process refuses as SGLang's plugins load, before it starts a
    scheduler: exit 2, the line last, no traceback."""
    with pytest.raises(pytest.fail.Exception) as exc:
        serve_processes([], env={DROP_HOOK: RESULTS})
    out = str(exc.value)
    assert "kvguard-serve exited with 2 during start-up" in out, out[-3000:]
    assert out.strip().splitlines()[-1] == f"kvguard-serve: error: {LINE}", out[-3000:]
    assert "Traceback" not in out and "sglang::scheduler" not in out, out[-3000:]


@pytest.mark.engine
def test_scheduler_refuses_a_hook_not_in_place(serve_processes):
    """Dropped in the schedulers only (the HTTP process has every row): the scheduler refuses
    before it builds anything, and the server fails to start instead of serving unguarded."""
    with pytest.raises(pytest.fail.Exception) as exc:
        serve_processes([], env={DROP_HOOK: f"children:{RESULTS}"})
    out = str(exc.value)
    assert re.search(r"kvguard-serve exited with [1-9]\d* during start-up", out), out[-3000:]
    assert f"kvguard: error: {LINE}" in out.splitlines(), out[-3000:]
    assert "kvguard-serve: error: SGLang stopped: " in out, out[-3000:]
    assert "Load weight begin" not in out, out[-3000:]  # refused before the model loads

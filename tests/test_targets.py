"""Every row of every table in patches/targets.py (and the fuzz plugin's FUZZ_TARGETS) resolves
against the installed SGLang: a hooked target exists and is callable, its hook function exists in
kvguard.patches, and every other SGLang name the patches touch (SGLANG_NAMES) is still there.
A version bump that renames any of them fails here, in seconds, instead of inside a scheduler."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable
from typing import Any

import pytest

from kvguard.fuzz.plugin import FUZZ_TARGETS
from kvguard.patches import targets

HOOK_TYPES = {"BEFORE", "AFTER", "AROUND", "REPLACE"}


def hook_tables() -> dict[str, list[tuple[str, str, str, str]]]:
    """Every ``*_TARGETS`` table of targets.py (new tables are picked up by name)."""
    return {
        name: rows
        for name, rows in vars(targets).items()
        if name.endswith("_TARGETS") and isinstance(rows, list)
    }


HOOK_ROWS = [
    pytest.param(table, *row, id=f"{table}:{row[0].rsplit('.', 2)[-2]}.{row[0].rsplit('.', 1)[-1]}")
    for table, rows in hook_tables().items()
    for row in rows
]


def test_every_table_is_registered_by_the_plugin():
    """A table the plugin does not import is dead: its hooks would never be registered."""
    source = inspect.getsource(importlib.import_module("kvguard.patches.plugin"))
    for name in hook_tables():
        assert re.search(rf"\b{name}\b", source), f"patches/plugin.py never registers {name}"


def test_hook_types_are_sglangs():
    from sglang.srt.plugins.hook_registry import HookType

    assert {t.name for t in HookType} >= HOOK_TYPES


@pytest.mark.parametrize("table, target, hook_type, hook_path, why", HOOK_ROWS)
def test_hook_row_resolves(table, target, hook_type, hook_path, why):
    owner, _, attr = target.rpartition(".")
    resolved = getattr(pkgutil.resolve_name(owner), attr)
    assert callable(resolved), f"{target} is not callable"
    assert hook_type in HOOK_TYPES, hook_type
    module, fn = hook_path.rsplit(".", 1)
    hook = getattr(importlib.import_module(f"kvguard.patches.{module}"), fn)
    assert callable(hook), hook_path
    assert why.strip(), f"{target}: say why it is hooked"


@pytest.mark.parametrize(
    "target, hook_type, why", FUZZ_TARGETS, ids=[row[0].rsplit(".", 2)[-2] for row in FUZZ_TARGETS]
)
def test_fuzz_row_resolves(target, hook_type, why):
    owner, _, attr = target.rpartition(".")
    assert callable(getattr(pkgutil.resolve_name(owner), attr)), target
    assert hook_type in HOOK_TYPES and why.strip()


# -- SGLANG_NAMES: the names patches use without hooking them ------------------------------------
def _sglang_classes(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.startswith("sglang.")]


@functools.cache
def _source(klass: type) -> str:
    return inspect.getsource(klass)


def _declares(cls: type, name: str) -> bool:
    """``name`` is an instance attribute of ``cls``: a class-level name or property, an annotated
    field (dataclass, NamedTuple, msgspec), or assigned ``self.<name> =`` in a class's source."""
    if hasattr(cls, name):
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=(?!=)")
    for klass in _sglang_classes(cls):
        if name in getattr(klass, "__annotations__", {}):
            return True
        if assigned.search(_source(klass)):
            return True
    return False


def _check_callable(obj: Any, name: str) -> None:
    assert callable(obj), f"{name} is not callable"


def _check_frozen_field(owner: Any, attr: str) -> None:
    assert dataclasses.is_dataclass(owner), f"{owner} is no longer a dataclass"
    assert attr in {f.name for f in dataclasses.fields(owner)}, f"{owner} has no field {attr}"
    # object.__setattr__ is only needed (and only safe to keep) while the dataclass is frozen
    assert owner.__dataclass_params__.frozen, f"{owner} is no longer frozen"


KIND_CHECKS: dict[str, Callable[[Any, str, str], None]] = {
    "callable": lambda owner, attr, name: _check_callable(getattr(owner, attr), name),
    "value": lambda owner, attr, name: getattr(owner, attr),
    "module_attr": lambda owner, attr, name: _check_callable(getattr(owner, attr), name),
    "attribute": lambda owner, attr, name: _assert(_declares(owner, attr), f"{name}: not found"),
    "frozen_field": lambda owner, attr, name: _check_frozen_field(owner, attr),
    "parameter": lambda owner, attr, name: _assert(
        attr in inspect.signature(owner).parameters, f"{name}: no such parameter"
    ),
}


def _assert(ok: bool, message: str) -> None:
    assert ok, message


@pytest.mark.parametrize(
    "name, kind, user, why",
    targets.SGLANG_NAMES,
    ids=[row[0].removeprefix("sglang.srt.") for row in targets.SGLANG_NAMES],
)
def test_sglang_name_resolves(name, kind, user, why):
    owner_path, _, attr = name.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    assert kind in KIND_CHECKS, f"{name}: unknown kind {kind!r}"
    if kind in ("attribute", "frozen_field"):
        assert inspect.isclass(owner), f"{owner_path} is not a class"
    if kind == "module_attr":
        assert inspect.ismodule(owner), f"{owner_path} is not a module"
    KIND_CHECKS[kind](owner, attr, name)
    for module in user.split(", "):  # the patch modules the row names exist
        importlib.import_module(f"kvguard.patches.{module}")
    assert why.strip()


NOT_SGLANG = {"aten", "torch", "sys", "os"}  # receivers whose private names are not SGLang's


def test_private_names_used_in_patches_are_listed():
    """Every private SGLang attribute a patch module uses (``x._name``, not its own) is a row of
    SGLANG_NAMES or a hooked target: private names are the first to change in a bump."""
    listed = {row[0].rsplit(".", 1)[-1] for row in targets.SGLANG_NAMES}
    listed |= {row[0].rsplit(".", 1)[-1] for rows in hook_tables().values() for row in rows}
    patches_dir = importlib.import_module("kvguard.patches").__path__[0]
    own = re.compile(r"^_[a-z0-9_]+$")
    missing = {}
    for info in pkgutil.iter_modules([patches_dir]):
        module = importlib.import_module(f"kvguard.patches.{info.name}")
        source = inspect.getsource(module)
        defined = set(re.findall(r"^\s*(?:def|class)\s+(_\w+)", source, re.M))
        defined |= set(re.findall(r"^(_\w+)\s*[:=]", source, re.M))
        defined |= set(re.findall(r"\bself\.(_\w+)\s*=", source))
        for owner, name in set(re.findall(r"\b([a-z_][a-z0-9_]*)\.(_[a-z][a-z0-9_]*)\b", source)):
            if owner in NOT_SGLANG or not own.match(name) or name in defined | listed:
                continue
            missing.setdefault(info.name, set()).add(name)
    assert not missing, f"private SGLang names used but not listed in targets.py: {missing}"

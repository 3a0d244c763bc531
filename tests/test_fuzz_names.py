"""Every SGLang name the fuzz tool reads or calls without hooking it (fuzz/plugin.py FUZZ_NAMES,
which extends the guard's SGLANG_NAMES: each name in one table, once) still resolves against the installed SGLang, checked as tests/test_targets.py checks the patches'
own SGLANG_NAMES: a version bump that renames one fails here, not as injector errors mid-campaign."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from test_targets import KIND_CHECKS

from kvguard.fuzz.plugin import FUZZ_NAMES
from kvguard.patches.targets import SGLANG_NAMES


@pytest.mark.parametrize(
    "name, kind, user, why",
    FUZZ_NAMES,
    ids=[row[0].removeprefix("sglang.srt.") for row in FUZZ_NAMES],
)
def test_fuzz_name_resolves(name, kind, user, why):
    owner_path, _, attr = name.rpartition(".")
    owner = pkgutil.resolve_name(owner_path)
    assert kind in KIND_CHECKS, f"{name}: unknown kind {kind!r}"
    if kind == "attribute":
        assert inspect.isclass(owner), f"{owner_path} is not a class"
    KIND_CHECKS[kind](owner, attr, name)
    for module in user.split(", "):  # the fuzz modules the row names exist
        importlib.import_module(f"kvguard.fuzz.{module}")
    assert why.strip()


def test_fuzz_names_extend_the_guard_s_each_name_once():
    """The fuzz tool's table lists only names the guard's own table does not (which is resolved
    by tests/test_targets.py), each once; so does the guard's."""
    guard = [row[0] for row in SGLANG_NAMES]
    fuzz = [row[0] for row in FUZZ_NAMES]
    assert len(set(guard)) == len(guard), sorted(n for n in guard if guard.count(n) > 1)
    assert len(set(fuzz)) == len(fuzz), sorted(n for n in fuzz if fuzz.count(n) > 1)
    assert not set(fuzz) & set(guard), sorted(set(fuzz) & set(guard))

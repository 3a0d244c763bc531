"""Every SGLang name the fuzz tool reads or calls without hooking it (fuzz/plugin.py FUZZ_NAMES)
still resolves against the installed SGLang, checked as tests/test_targets.py checks the patches'
own SGLANG_NAMES: a version bump that renames one fails here, not as injector errors mid-campaign."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from test_targets import KIND_CHECKS

from kvguard.fuzz.plugin import FUZZ_NAMES


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
    importlib.import_module(f"kvguard.fuzz.{user}")  # the fuzz module the row names exists
    assert why.strip()

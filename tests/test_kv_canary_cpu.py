"""The CPU compatibility hooks for SGLang's kv-canary: CPU behaviour, pass-through elsewhere, and
targets that exist in the installed SGLang."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

from kvguard.patches import kv_canary_cpu as k
from kvguard.patches.targets import CANARY_TARGETS


def test_targets_resolve():
    for target, hook_type, hook_path, _why in CANARY_TARGETS:
        owner, _, attr = target.rpartition(".")
        assert hasattr(pkgutil.resolve_name(owner), attr), target
        module, fn = hook_path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(f"kvguard.patches.{module}"), fn))
        assert hook_type == "AROUND"


def test_stream_on_cpu_and_elsewhere():
    assert isinstance(k.create_stream(None, torch.device("cpu")), torch.cpu.Stream)
    assert isinstance(k.create_stream(None, "cpu"), torch.cpu.Stream)
    assert k.create_stream(lambda dev: ("sglang", dev), "cuda:1") == ("sglang", "cuda:1")


def test_device_to_host_on_cpu():
    from sglang.srt.kv_canary.runner.future_tensor import FutureTensors

    x = torch.arange(6)
    fut = k.device_to_host(None, FutureTensors, x, d2h_stream=torch.cpu.Stream())
    x.zero_()  # the host copy is a snapshot
    assert torch.equal(fut.wait(), torch.arange(6))
    fut = k.device_to_host(None, FutureTensors, {"a": torch.ones(2), "n": 3}, d2h_stream=None)
    got = fut.wait()
    assert torch.equal(got["a"], torch.ones(2)) and got["n"] == 3


def test_device_to_host_elsewhere_is_sglangs():
    calls = []
    meta = torch.empty(2, device="meta")
    k.device_to_host(lambda *a, **kw: calls.append((a, kw)), "cls", meta, d2h_stream="s")
    assert calls == [(("cls", meta), {"d2h_stream": "s"})]


class _Checker:
    def __init__(self, device):
        self._device = device
        self._phase = torch.tensor(0, dtype=torch.int32)
        self._enable_assert_device = torch.zeros(1, dtype=torch.int32)


def test_phase_check_on_cpu():
    c = _Checker(torch.device("cpu"))
    k.phase_update(None, c, expect_phase=5, next_phase=1)  # assert not enabled yet: advances
    assert int(c._phase) == 1
    c._enable_assert_device.fill_(1)
    k.phase_update(None, c, expect_phase=1, next_phase=2)
    assert int(c._phase) == 2
    with pytest.raises(AssertionError, match="phase mismatch"):
        k.phase_update(None, c, expect_phase=1, next_phase=2, caller_name="pre")


def test_phase_check_elsewhere_is_sglangs():
    calls = []
    c = _Checker("cuda")
    k.phase_update(lambda *a, **kw: calls.append(kw), c, expect_phase=1, next_phase=2)
    assert calls == [{"expect_phase": 1, "next_phase": 2, "caller_name": ""}]

"""SGLang's own KV canary (``--kv-canary log|raise``) on a CPU-only machine.

SGLang 0.5.23 ships torch reference kernels for the canary off CUDA, but two host-side details
assume an accelerator and stop it at start-up on CPU:

- ``CanaryManager.__init__`` builds its device-to-host stream with ``torch.cpu.Stream(device=...)``,
  which torch's CPU stream does not accept (``TypeError: ... unexpected keyword argument
  'device'``);
- ``FutureTensors.device_to_host`` stages its copies in pinned host memory, which needs a CUDA
  driver;
- ``SimplePhaseChecker.update`` (the canary's pre/post-forward bracket check) is a one-thread
  Triton kernel, and Triton has no CPU driver.

On CPU the "device" already is the host: the stream is made without the keyword, and the staged
copy is a plain clone (complete at once, so its event is recorded immediately), and the phase
check is the kernel's three lines in torch on the CPU tensors. On every other
device both hooks call SGLang's own code unchanged. Nothing else of the canary is touched: its
checks, sweeps and log lines are SGLang's.
"""

from __future__ import annotations

import torch


def create_stream(original, device):
    """``create_device_stream`` for the canary's d2h stream: CPU streams take no device."""
    if torch.device(device).type == "cpu":
        return torch.cpu.Stream()
    return original(device)


def device_to_host(original, cls, xs_device, *, d2h_stream):
    """``FutureTensors.device_to_host``: on CPU, an immediate clone instead of a pinned copy."""
    from sglang.srt.kv_canary.runner.future_tensor import _DUMMY_DICT_KEY

    payload = xs_device if isinstance(xs_device, dict) else {_DUMMY_DICT_KEY: xs_device}
    first = next((x for x in payload.values() if isinstance(x, torch.Tensor)), None)
    if first is None or first.device.type != "cpu":
        return original(cls, xs_device, d2h_stream=d2h_stream)
    data = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in payload.items()}
    event = torch.cpu.Event()
    event.record()
    return cls(_data=data, _event=event, _retained_device_clones={})


def phase_update(original, checker, *, expect_phase, next_phase, caller_name=""):
    """``SimplePhaseChecker.update``: the kernel's check-and-advance, in torch on CPU."""
    if torch.device(checker._device).type != "cpu":
        return original(
            checker, expect_phase=expect_phase, next_phase=next_phase, caller_name=caller_name
        )
    if int(checker._enable_assert_device[0]) and int(checker._phase) != int(expect_phase):
        raise AssertionError(
            f"SimplePhaseChecker: phase mismatch (caller={caller_name!r} "
            f"expect={int(expect_phase)} next={int(next_phase)} actual={int(checker._phase)})"
        )
    checker._phase.fill_(int(next_phase))

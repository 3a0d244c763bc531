"""SGLang's prefill/decode disaggregation (``--disaggregation-mode prefill|decode``, the mooncake
transfer backend) on a CPU-only machine. Hook functions named in ``targets.py`` (PD_CPU_TARGETS).

Every hook acts only on SGLang's CPU route (``SGLANG_USE_CPU_ENGINE=1``, which kvguard-serve sets
for ``--device cpu``) and calls SGLang's code unchanged otherwise. The targets run only on a
prefill or decode server: a single server never reaches them.

* Transfer engine. ``mooncake-transfer-engine``'s wheel links ``libcudart.so.12``,
  ``libcuda.so.1``, ``libibverbs.so.1`` and ``libmlx5.so.1``; without a GPU and an RDMA NIC its
  import fails. ``before_transfer_engine`` loads, for each that cannot be loaded, kvguard's
  no-device library of the same SONAME (``patches/csrc/nodevice_*.c``, built by
  ``scripts/setup.sh``: every call answers "no device"), so the dynamic linker finds it when the
  engine imports, and selects mooncake's TCP transport (``MC_FORCE_TCP=1``,
  ``MOONCAKE_PROTOCOL=tcp``) unless the environment chose one. The KV still moves through
  mooncake's own transfer code, over loopback or the network.
* Prefill send. ``send_kv_chunk`` stages a chunk's page indices in pinned host memory behind a
  CUDA event when the sender ``supports_host_tensor_indices`` (mooncake's does). On CPU the
  indices already are host memory and nothing is in flight: ``around_send_kv_chunk`` takes
  SGLang's other branch (plain host indices) for the request's sender.
* Early send of a cached prefix. ``maybe_send_cached_prefix_chunk`` records a CUDA event on the
  forward stream under the overlap scheduler, so the transfer waits for the prior forward's
  writes. On CPU a forward runs to completion on the scheduler's thread before that call:
  ``around_early_send`` runs it as without overlap (no event, nothing to wait for).
* SGLang's own hand-off checksum (``--disaggregation-enable-kv-checksum``). Its digest is a JIT
  CUDA kernel (``adler32_strided_checksum``: Adler-32 over the selected items of every KV
  buffer, buffer by buffer, item by item) fed page indices on the device. ``around_kv_checksum``
  computes the same Adler-32 over the same bytes in the same order on the host (zlib's
  ``adler32``, reading each item at its address) when the indices are host tensors; SGLang's
  checksum buffers, comparison and abort are its own.

What else a CPU decode server needs is an argument, not a patch: the retraction backup that
SGLang infers for a decode server (``host_pool``) registers its buffer with
``torch.cuda.cudart()``; ``--disaggregation-decode-retraction-backup cpu_tensor`` keeps it in
per-request CPU tensors (kvguard-serve's default on CPU).
"""

from __future__ import annotations

import ctypes
import os
import zlib
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Any

# The SONAMEs the transfer engine's wheel links; kvguard's no-device build of each is
# nodevice/<name><extension suffix> (pyproject.toml builds them like Python extensions, so a wheel
# and an editable install both carry them; they are loaded with ctypes, never imported).
NO_DEVICE_LIBRARIES = ("libcudart.so.12", "libcuda.so.1", "libibverbs.so.1", "libmlx5.so.1")
NO_DEVICE_DIR = Path(__file__).resolve().parent / "nodevice"
TCP_TRANSPORT = {"MC_FORCE_TCP": "1", "MOONCAKE_PROTOCOL": "tcp"}

_loaded: list[ctypes.CDLL] = []  # kept for the life of the process


def _on_cpu() -> bool:
    from sglang.srt.utils import is_cpu

    return bool(is_cpu())


def load_no_device_libraries() -> list[str]:
    """Load kvguard's no-device library for each SONAME in :data:`NO_DEVICE_LIBRARIES` that the
    dynamic linker cannot load itself; return those SONAMEs. Idempotent."""
    substituted = []
    for soname in NO_DEVICE_LIBRARIES:
        try:
            ctypes.CDLL(soname)  # the real library, or one loaded here before
            continue
        except OSError:
            pass
        path = NO_DEVICE_DIR / (soname.split(".so")[0] + EXTENSION_SUFFIXES[0])
        if not path.is_file():
            raise ImportError(
                f"{soname} is missing and kvguard's no-device build of it ({path}) is not "
                "installed: run scripts/setup.sh"
            )
        _loaded.append(ctypes.CDLL(str(path)))
        substituted.append(soname)
    return substituted


# -- distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.__init__ ----
def before_transfer_engine(engine: object, *args: Any, **kwargs: Any) -> None:
    """BEFORE: on CPU, the no-device libraries and mooncake's TCP transport."""
    if not _on_cpu():
        return None
    for key, value in TCP_TRANSPORT.items():
        os.environ.setdefault(key, value)
    substituted = load_no_device_libraries()
    if substituted:
        import structlog

        structlog.get_logger("kvguard").info(
            "kvguard_pd_cpu_transfer_engine", no_device_libraries=substituted, **TCP_TRANSPORT
        )
    return None


# -- disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk (AROUND) ------------
def around_send_kv_chunk(original, scheduler, req, *args: Any, **kwargs: Any):
    """On CPU, the sender takes host page indices directly (no pinned staging, no CUDA event)."""
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is not None and _on_cpu():
        sender.supports_host_tensor_indices = False
    return original(scheduler, req, *args, **kwargs)


# -- disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk ---
def around_early_send(original, scheduler, *args: Any, **kwargs: Any):
    """AROUND: on CPU no forward is in flight here: no CUDA event to wait on."""
    if not (scheduler.enable_overlap and _on_cpu()):
        return original(scheduler, *args, **kwargs)
    scheduler.enable_overlap = False
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        scheduler.enable_overlap = True


# -- disaggregation.checksum.KvChecksumComputer.compute (AROUND) -----------------------------------
def around_kv_checksum(original, computer, kv_page_indices, state_indices=None):
    """AROUND: with host page indices (CPU), the Adler-32 SGLang's CUDA kernel computes, on the
    host: over every buffer in turn (KV, then state), each selected item's bytes in index order."""
    if kv_page_indices.is_cuda:
        return original(computer, kv_page_indices, state_indices)
    ptrs = list(computer._kv_data_ptrs)
    lens = list(computer._kv_item_lens)
    indices = [kv_page_indices] * len(ptrs)
    if computer._state_data_ptrs:
        assert state_indices is not None, "a state buffer without state indices"
        ptrs += computer._state_data_ptrs
        lens += computer._state_item_lens
        indices += [state_indices] * len(computer._state_data_ptrs)
    return adler32_items(ptrs, lens, [i.tolist() for i in indices])


def adler32_items(ptrs: list[int], item_lens: list[int], indices: list[list[int]]) -> int:
    """Adler-32 of the items ``indices[b]`` of buffer ``b`` (base address ``ptrs[b]``, items of
    ``item_lens[b]`` bytes), buffers in order; 1 (Adler-32 of nothing) when there are none."""
    digest = 1
    for base, item_len, items in zip(ptrs, item_lens, indices):
        for i in items:
            digest = zlib.adler32(ctypes.string_at(base + int(i) * item_len, item_len), digest)
    return digest

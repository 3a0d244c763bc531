"""FP8 (e4m3) KV cache on CPU without Intel AMX, for SGLang's ``torch_native`` attention backend.

What SGLang 0.5.23 already does, and what this file adds (hook functions named in ``targets.py``):

* Pool: with ``--kv-cache-dtype fp8_e4m3`` on CPU the configurator builds an ``MHATokenToKVPool``
  whose quant method is SGLang's own ``CPUFP8KVCacheMethod``: per-layer ``float8_e4m3fn`` K/V
  buffers (1 byte per element, no scale buffers), ``quantize_and_store`` = ``(k / k_scale).to(fp8)``.
  It refuses to do so without AMX and the ``intel_amx`` backend. ``around_configure`` lifts that
  one refusal when every configured attention backend is ``torch_native``; nothing else changes.
* Read: ``torch_native`` gathers each request's K/V rows from the pool and casts them to the query
  dtype before SDPA (``per_req_key.to(per_req_query.dtype)``): with scale 1.0 that cast already is
  the dequantization, but it ignores scales and converts float8 element by element (slow on CPU).
  ``kv_read.py`` dequantizes instead, with the tables of ``read_tables``: the rows the batch reads
  are gathered once per layer and looked up in a 256-entry table (FP8 byte -> value * scale, in
  the query dtype), and SGLang's own SDPA loop runs on that compact copy through a remapped page
  table. With scale 1.0 the values are bit-identical to SGLang's cast.
* Write scales: SGLang's torch_native backend never passes the layer's ``k_scale``/``v_scale`` to
  the pool. Where a model carries per-layer KV scales (an FP8 checkpoint's ``k_scale``/``v_scale``,
  or ``--quantization-param-path``), ``supply_scales`` hands them to the write (stored byte =
  fp8(k / k_scale)) and the read tables multiply them back. Without model scales they are 1.0.

MLA models (DeepSeek-V3 / Kimi K2 architecture, ``MLATokenToKVPool``): one latent row per token
and layer (kv_lora_rank + qk_rope_head_dim values; ``get_value_buffer`` is a view of its first
kv_lora_rank values). SGLang refuses FP8 for MLA on CPU before its AMX gate; ``around_configure``
lets that one check (``current_platform.is_cpu()``, the gate's first call) answer "not a CPU", and
SGLang builds its own MLA pool with FP8 storage (uint8 bytes, viewed as float8_e4m3fn on read;
its ``set_kv_buffer`` casts the latent row). K and V are the same bytes, so the row has one scale:
the layer's ``k_scale`` (as SGLang's FlashMLA backend reads it), 1.0 without one. ``scale_mla_write``
divides the row by it before SGLang's cast, and the read dequantizes the rows once (V is the first
kv_lora_rank values of the same copy). Per-layer scales come from an FP8 checkpoint's
``attn_mqa.k_scale`` or from ``--quantization-param-path``, which SGLang's DeepSeek model cannot
load itself (``around_load_kv_cache_scales`` sets them on each layer's ``attn_mqa``).

Every hook is a no-op unless this file itself lifted the gate for the pool in question: GPU pools,
non-FP8 pools and SGLang's own AMX route are left exactly as SGLang made them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref

import structlog
import torch

log = structlog.get_logger("kvguard")

_CPU_FP8_METHOD = "cpu_fp8_e4m3"  # SGLang's name for CPUFP8KVCacheMethod
_fp8_pools: weakref.WeakSet = weakref.WeakSet()  # pools built through around_configure


class FP8KVConfigError(ValueError):
    """FP8 KV cache requested in a CPU configuration this file cannot serve."""


# -- KVCacheConfigurator.configure (AROUND) ---------------------------------------------------------------
def around_configure(original, configurator, *args, **kwargs):
    if not _wants_torch_native_fp8(configurator):
        return original(configurator, *args, **kwargs)
    from sglang.srt.mem_cache import kv_cache_configurator as kvc

    if configurator.use_mla_backend:
        with _mla_gate_lifted(kvc):
            result = original(configurator, *args, **kwargs)
        return _register_mla_pool(result)
    with _amx_gate_lifted(kvc):
        result = original(configurator, *args, **kwargs)
    pool = result.token_to_kv_pool
    k_buf = getattr(pool, "k_buffer", None)
    method = getattr(getattr(pool, "quant_method", None), "name", None)
    if method != _CPU_FP8_METHOD or not k_buf or k_buf[0].dtype != torch.float8_e4m3fn:
        raise FP8KVConfigError(
            f"kvguard expected SGLang to build a {_CPU_FP8_METHOD} MHA pool with float8_e4m3fn "
            f"buffers, got {type(pool).__name__} (method {method!r}); see patches/targets.py"
        )
    _fp8_pools.add(pool)
    log.info(
        "kvguard_cpu_fp8_kv",
        layers=len(k_buf),
        slots=k_buf[0].shape[0],
        bytes_per_token=sum(b[0].numel() * b.element_size() for b in k_buf + pool.v_buffer),
    )
    return result


MLA_POOL = "MLATokenToKVPool"  # exactly: subclasses store more than the latent rows
# DSA's pool packs its FP8 latent rows with per-block scales; dsa_cpu.py reads and writes them
DSA_POOL = "DSATokenToKVPool"


def _register_mla_pool(result):
    pool = result.token_to_kv_pool
    buffers = getattr(pool, "kv_buffer", None)
    if (
        type(pool).__name__ not in (MLA_POOL, DSA_POOL)
        or getattr(pool, "dtype", None) != torch.float8_e4m3fn
        or not buffers
        or buffers[0].dtype != torch.uint8
    ):
        raise FP8KVConfigError(
            f"FP8 KV cache on CPU serves MHA pools, the plain {MLA_POOL} and {DSA_POOL}; "
            f"SGLang built {type(pool).__name__} (dtype {getattr(pool, 'dtype', None)}) "
            "for this model. Serve it with --no-fp8-kv (or --kv-cache-dtype auto)."
        )
    _fp8_pools.add(pool)
    log.info(
        "kvguard_cpu_fp8_kv",
        pool="dsa" if type(pool).__name__ == DSA_POOL else "mla",
        layers=len(buffers),
        slots=buffers[0].shape[0],
        bytes_per_token=sum(b[0].numel() * b.element_size() for b in buffers),
    )
    return result


def _wants_torch_native_fp8(configurator) -> bool:
    from sglang.srt.platforms import current_platform

    if not current_platform.is_cpu() or configurator.kv_cache_dtype != torch.float8_e4m3fn:
        return False
    from sglang.srt.runtime_context import attention_backends
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():
        return False  # SGLang's own intel_amx route
    backends = set(attention_backends()) - {None}
    if backends != {"torch_native"}:
        raise FP8KVConfigError(
            "FP8 KV cache on a CPU without AMX is served by kvguard through the torch_native "
            f"attention backend only; configured backends: {sorted(backends)}. "
            "Pass --attention-backend torch_native."
        )
    if not configurator.spec_algorithm.is_none():
        raise FP8KVConfigError(
            "FP8 KV cache on CPU without AMX: speculative decoding is not supported."
        )
    return True


@contextlib.contextmanager
def _amx_gate_lifted(kvc):
    """Answer configure()'s AMX gate (its first ``cpu_has_amx_support()`` and the
    ``attention_backends()`` call right after it) as if AMX were present, once each; every
    later call in the configurator gets the real answer. Both rebindings are undone on exit."""
    real_amx, real_backends = kvc.cpu_has_amx_support, kvc.attention_backends
    pending = {"amx", "backends"}

    def amx_once():
        if "amx" in pending:
            pending.discard("amx")
            return True
        return real_amx()

    def backends_once():
        if "backends" in pending and "amx" not in pending:
            pending.discard("backends")
            return ("intel_amx", "intel_amx")
        return real_backends()

    kvc.cpu_has_amx_support, kvc.attention_backends = amx_once, backends_once
    try:
        yield
    finally:
        kvc.cpu_has_amx_support, kvc.attention_backends = real_amx, real_backends
    if pending:
        raise FP8KVConfigError(
            "SGLang's CPU FP8 KV gate in KVCacheConfigurator.configure changed shape "
            f"(not consulted: {sorted(pending)}); update patches/cpu_fp8_kv.py"
        )


class _PlatformAnsweringNotCpuOnce:
    """SGLang's ``current_platform`` whose first ``is_cpu()`` says False: configure()'s FP8 gate
    (which refuses MLA before anything else) is skipped, every later call gets the truth."""

    def __init__(self, real):
        self._real = real
        self.consulted = False

    def is_cpu(self) -> bool:
        if not self.consulted:
            self.consulted = True
            return False
        return self._real.is_cpu()

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextlib.contextmanager
def _mla_gate_lifted(kvc):
    real = kvc.current_platform
    once = _PlatformAnsweringNotCpuOnce(real)
    kvc.current_platform = once
    try:
        yield
    finally:
        kvc.current_platform = real
    if not once.consulted:
        raise FP8KVConfigError(
            "SGLang's CPU FP8 KV gate in KVCacheConfigurator.configure changed shape "
            "(current_platform.is_cpu() not consulted); update patches/cpu_fp8_kv.py"
        )


# -- per-layer scales ----------------------------------------------------------------------------------
def layer_kv_scales(layer) -> tuple[float, float]:
    """(k_scale, v_scale) SGLang loaded for this attention layer; 1.0 where it has none."""
    return _scale(layer, "k"), _scale(layer, "v")


def mla_kv_scale(layer) -> float:
    """The one scale of an MLA layer's latent row (K and V are the same bytes): its k_scale."""
    return _scale(layer, "k")


def _scale(layer, kind: str) -> float:
    for name in (f"{kind}_scale_float", f"{kind}_scale"):
        value = getattr(layer, name, None)
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise FP8KVConfigError(
                    f"layer {layer.layer_id}: {name} has {value.numel()} elements; "
                    "FP8 KV on CPU supports per-tensor (per-layer) scales only"
                )
            value = float(value)
        value = float(value)
        if value <= 0.0:  # SGLang's "not loaded" placeholder (-1) before post-load processing
            continue
        if not math.isfinite(value):
            raise FP8KVConfigError(f"layer {layer.layer_id}: {name}={value} is not finite")
        return value
    return 1.0


# -- MHATokenToKVPool.set_kv_buffer (BEFORE) --------------------------------------------------------------
def supply_scales(pool, layer=None, *args, **kwargs):
    if (
        layer is None
        or pool not in _fp8_pools
        or kwargs.get("k_scale") is not None
        or len(args) > 3
    ):
        return None  # not ours, or the caller already passes scales
    k_scale, v_scale = layer_kv_scales(layer)
    if k_scale == 1.0 and v_scale == 1.0:
        return None
    kwargs.update(k_scale=k_scale, v_scale=v_scale)
    return (pool, layer, *args), kwargs


# -- MLATokenToKVPool.set_kv_buffer (BEFORE) --------------------------------------------------------------
def scale_mla_write(pool, layer, loc_info, cache_k, *args, **kwargs):
    """Stored byte = fp8(latent / k_scale); SGLang's MLA pool casts without a scale."""
    if pool not in _fp8_pools or layer is None:
        return None
    scale = mla_kv_scale(layer)
    if scale == 1.0:
        return None
    return (pool, layer, loc_info, cache_k / scale, *args), kwargs


# -- the read (patches/kv_read.py gathers; these are its FP8 tables) -----------------------------------
def read_tables(pool, layer, dtype: torch.dtype):
    """(K, V) dequantization tables of this layer's read, or None where the pool is not one this
    file made FP8 (GPU pools, BF16 pools, SGLang's own AMX route)."""
    scales = kv_scales(pool, layer)
    return None if scales is None else dequant_tables(*scales, dtype=dtype)


def kv_scales(pool, layer) -> tuple[float, float] | None:
    """(k_scale, v_scale) this layer's FP8 KV is written and read with (an MLA latent row has
    one), or None where the pool is not one this file made FP8."""
    if pool not in _fp8_pools:
        return None
    if type(pool).__name__ == MLA_POOL:
        scale = mla_kv_scale(layer)
        return scale, scale
    return layer_kv_scales(layer)


@functools.lru_cache(maxsize=64)
def dequant_tables(k_scale: float, v_scale: float, dtype: torch.dtype):
    """float8_e4m3fn byte -> ``dtype`` value times the scale, for K and V (256 entries each)."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return (values * k_scale).to(dtype), (values * v_scale).to(dtype)


def dequantize_rows(cache: torch.Tensor, rows: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[cache[rows]]`` in torch: the specification of the compiled read's FP8 lookup
    (``kernels.read_verify.gather_rows``), which serves it."""
    flat = cache.view(torch.uint8).reshape(cache.shape[0], -1)
    out = table.index_select(0, flat[rows].reshape(-1).to(torch.int32))
    return out.view(rows.shape[0], *cache.shape[1:])


# -- load_model_utils.load_kv_cache_scales (AROUND) -------------------------------------------------
def around_load_kv_cache_scales(original, *args, **kwargs):
    """``--quantization-param-path`` for MLA models: SGLang's DeepSeek model has no
    ``load_kv_cache_scales`` (SGLang would raise); set each layer's latent scale on its
    ``attn_mqa`` from the same file format, read by SGLang's own loader."""
    model, kv_cache_dtype = kwargs.get("model"), kwargs.get("kv_cache_dtype")
    from sglang.srt.runtime_context import get_model

    path = get_model().quantization_param_path
    mla = _mla_attention_by_layer(model)
    if (
        kv_cache_dtype != "fp8_e4m3"
        or path is None
        or not mla
        or callable(getattr(model, "load_kv_cache_scales", None))
    ):
        return original(*args, **kwargs)
    from sglang.srt.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from sglang.srt.model_loader.weight_utils import kv_cache_scales_loader

    loaded = {}
    for layer_id, factor in kv_cache_scales_loader(
        path,
        get_tensor_model_parallel_rank(),
        get_tensor_model_parallel_world_size(),
        model.config.num_hidden_layers,
        model.config.model_type,
    ):
        attn = mla.get(int(layer_id))
        if attn is None:
            continue  # a layer of another pipeline rank, or an MTP layer not built
        attn.k_scale = attn.v_scale = float(factor)
        loaded[int(layer_id)] = float(factor)
    log.info("kvguard_mla_kv_scales", path=str(path), layers=len(loaded), scales=loaded)
    return None


def _mla_attention_by_layer(model) -> dict:
    """layer id -> the RadixAttention that reads an MLA layer's latent cache (``attn_mqa``)."""
    if model is None:
        return {}
    return {
        m.attn_mqa.layer_id: m.attn_mqa
        for m in model.modules()
        if hasattr(m, "attn_mqa") and hasattr(m, "kv_lora_rank")
    }

"""The forward's KV stores, where the guard takes each written token's digest from the bytes the
layer hands its pool: the writer's digest (hook functions named in ``targets.py``,
WRITE_TARGETS; the CPU DSA path's own stores call :func:`digest_store`).

A seal hashed from the pool after the forward certifies whatever the pool holds: a store that
never landed (the slot keeps its old bytes), landed in another slot, or was changed between the
layer's store and attention's read. So each store is hashed on its way in, from the rows it was
handed after the cast to the storage dtype (the bytes that should land), into one accumulator
per written token (the forward's write order, ``out_cache_loc``), layer after layer. After the
forward the guard seals those digests (``Guard.after_forward``): the verified read of this very
forward, and every later read, a prefix-cache adoption, a transfer's landing, are checked against
what the writer meant, not against what the pool kept.

A store this file cannot digest (an unmodelled pool layout or quantization, a store of other
tokens than the forward's writes) marks the record failed: the seal refuses it and the step fails
closed. Nothing here changes what SGLang stores.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from kvguard.kernels.kv_checksum_ref import KvBuffer
from kvguard.patches import cpu_fp8_kv, state
from kvguard.step import WriteSums

_local = threading.local()  # this forward's write record


@dataclass(slots=True)
class WriteRecord:
    """One forward's stores, digested as they were handed their bytes."""

    num_writes: int  # tokens the forward writes (its out_cache_loc)
    acc: torch.Tensor  # [num_writes] int64: the writer's inner sums, write order
    buffers: list[int] = field(default_factory=list)  # guarded buffers stored, one per store
    failed: str | None = None  # why a store could not be digested (the seal then refuses)


class UndigestedStore(RuntimeError):
    """A forward's stores could not all be digested: its seal fails, the step fails closed."""


def begin(guard, forward_batch) -> None:
    """A guarded forward starts: its stores are digested into a fresh record (none when the
    guard does not take writers' digests)."""
    loc = getattr(forward_batch, "out_cache_loc", None)
    if guard is None or not guard.digests_writes or loc is None:
        _local.record = None
        return
    _local.record = WriteRecord(loc.numel(), torch.zeros(loc.numel(), dtype=torch.int64))


def take_sums() -> WriteSums:
    """This forward's writer digests (cleared). Raises where a store could not be digested."""
    rec = getattr(_local, "record", None)
    _local.record = None
    if rec is None:
        raise UndigestedStore("no write record: the forward's stores were not digested")
    if rec.failed is not None:
        raise UndigestedStore(rec.failed)
    return WriteSums(rec.acc, rec.buffers)


def recording() -> bool:
    """Is this forward's store being digested (so a store site should hand its bytes over)?"""
    rec = getattr(_local, "record", None)
    return rec is not None and rec.failed is None


def digest_store(buffer: KvBuffer, loc: torch.Tensor, rows: torch.Tensor) -> None:
    """A store of ``rows`` [n, ...] (the bytes that should land, in the buffer's storage dtype)
    into ``buffer`` at ``loc`` [n], one row per token the forward writes, in write order."""
    rec = getattr(_local, "record", None)
    if rec is None or rec.failed is not None:
        return
    guard = state.guard
    t0 = time.thread_time()
    try:
        index = guard.buffer_index(buffer) if guard is not None else None
        if index is None:
            raise UndigestedStore(f"a store into a KV buffer the guard does not hold {buffer}")
        if loc.numel() != rec.num_writes or rows.shape[0] != rec.num_writes:
            raise UndigestedStore(
                f"a store of {rows.shape[0]} rows at {loc.numel()} slots in a forward writing "
                f"{rec.num_writes} tokens"
            )
        from kvguard.kernels import read_verify

        read_verify.hash_rows(rows.reshape(rows.shape[0], -1), index, rec.acc)
        rec.buffers.append(index)
        guard.account_in_forward(time.thread_time() - t0)
    except Exception as exc:  # never the store's failure: the seal refuses the step instead
        rec.failed = f"{type(exc).__name__}: {exc}"


# The FP8 scales each layer's KV was first written (or read) with, by (pool, layer): attention
# dequantizes with the layer's scales, so a scale that changes after KV was written would read
# every byte of that layer wrong while its digests hold. A store or read with other scales than
# those pinned is refused (the step fails closed).
_scales: weakref.WeakKeyDictionary[object, dict[int, tuple[float, float]]] = (
    weakref.WeakKeyDictionary()
)


def check_scales(pool, layer_id: int, scales: tuple[float, float] | None) -> None:
    """Pin this layer's FP8 scales at first use; raise ValueError if they differ later."""
    if scales is None:
        return
    pinned = _scales.setdefault(pool, {}).setdefault(int(layer_id), scales)
    if pinned != scales:
        raise ValueError(
            f"layer {layer_id}'s FP8 KV scales are {scales}; its KV was written with {pinned}"
        )


def _loc(loc_info) -> torch.Tensor:
    """SGLang's bare loc, or a ``KVWriteLoc``'s."""
    return loc_info if isinstance(loc_info, torch.Tensor) else loc_info.loc


def _fail(why: str) -> None:
    rec = getattr(_local, "record", None)
    if rec is not None and rec.failed is None:
        rec.failed = why


# -- MHATokenToKVPool.set_kv_buffer (AROUND) -----------------------------------------------------
def around_mha_store(original, pool, layer, loc_info, cache_k, cache_v, *args, **kwargs):
    """Digest K and V as SGLang will store them (computed before the call: SGLang's own cast may
    divide ``cache_k`` in place)."""
    if getattr(_local, "record", None) is not None:
        try:
            k_rows, v_rows = mha_stored_rows(pool, layer, cache_k, cache_v, *args, **kwargs)
            lid = _layer_id(layer, args[2] if len(args) > 2 else kwargs.get("layer_id_override"))
            check_scales(pool, lid, _fp8_scales(pool, *args, **kwargs))
            loc = _loc(loc_info)
            digest_store(pool.k_buffer[lid - pool.start_layer], loc, k_rows)
            digest_store(pool.v_buffer[lid - pool.start_layer], loc, v_rows)
        except Exception as exc:
            _fail(f"MHA store not digested: {type(exc).__name__}: {exc}")
    return original(pool, layer, loc_info, cache_k, cache_v, *args, **kwargs)


def mha_stored_rows(
    pool, layer, cache_k, cache_v, k_scale=None, v_scale=None, layer_id_override=None,
    dcp_kv_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The K and V rows ``MHATokenToKVPool.set_kv_buffer`` stores for these arguments (SGLang
    0.5.23's cast, reproduced; ``tests/patches`` hold it to the bytes that land)."""
    if dcp_kv_mask is not None or getattr(pool, "use_hnd", False):
        raise UndigestedStore("a masked (DCP) or head-major MHA store is not modelled")
    if pool.is_quantized_kv_cache:
        method = getattr(pool.quant_method, "name", None)
        if method != "cpu_fp8_e4m3":
            raise UndigestedStore(f"KV quantization {method!r} is not modelled")
        gid = layer.layer_id if layer is not None else _layer_id(layer, layer_id_override)
        k_scale, v_scale = pool._quantized_scales(gid, k_scale, v_scale)
        k_scale = 1.0 if k_scale is None else k_scale
        v_scale = 1.0 if v_scale is None else v_scale
        fp8 = torch.float8_e4m3fn
        return (cache_k / k_scale).to(fp8), (cache_v / v_scale).to(fp8)
    k, v = cache_k, cache_v
    if k.dtype != pool.dtype:
        if k_scale is not None:
            k = k / k_scale
        if v_scale is not None:
            v = v / v_scale
        k, v = k.to(pool.dtype), v.to(pool.dtype)
    if pool.store_dtype != pool.dtype:
        k, v = k.view(pool.store_dtype), v.view(pool.store_dtype)
    return k, v


def _fp8_scales(pool, k_scale=None, v_scale=None, *args, **kwargs) -> tuple[float, float] | None:
    """The write scales an FP8 MHA store was handed (1.0 where none: SGLang's CPU FP8 store)."""
    if not pool.is_quantized_kv_cache:
        return None
    return (1.0 if k_scale is None else float(k_scale), 1.0 if v_scale is None else float(v_scale))


def _layer_id(layer, override) -> int:
    return int(override) if override is not None else int(layer.layer_id)


# -- MLATokenToKVPool.set_kv_buffer / set_mla_kv_buffer (AROUND) ----------------------------------
def around_mla_store(original, pool, layer, loc_info, cache_k, cache_v, *args, **kwargs):
    """Digest the latent row as SGLang's MLA pool stores it (one row per token and layer)."""
    if getattr(_local, "record", None) is not None:
        try:
            lid = _layer_id(layer, args[0] if args else kwargs.get("layer_id_override"))
            check_scales(pool, lid, cpu_fp8_kv.kv_scales(pool, layer))  # the write scaled by it
            _digest_latent(pool, lid, loc_info, [cache_k])
        except Exception as exc:
            _fail(f"MLA store not digested: {type(exc).__name__}: {exc}")
    return original(pool, layer, loc_info, cache_k, cache_v, *args, **kwargs)


def _digest_latent(pool, lid: int, loc_info, parts: list[torch.Tensor]) -> None:
    """Digest the latent row made of ``parts`` as the MLA pool stores it: each cast to the
    pool's dtype, concatenated, viewed as its storage dtype."""
    parts = [p.to(pool.dtype) if p.dtype != pool.dtype else p for p in parts]
    rows = (
        parts[0] if len(parts) == 1 else torch.cat([p.reshape(p.shape[0], -1) for p in parts], -1)
    )
    if pool.store_dtype != pool.dtype:
        rows = rows.view(pool.store_dtype)
    digest_store(pool.kv_buffer[lid - pool.start_layer], _loc(loc_info), rows)


def around_mla_split_store(original, pool, layer, loc_info, nope, rope, *args, **kwargs):
    """The latent written as its two parts (no RoPE-less or DSA-FP8 layout is modelled here)."""
    if getattr(_local, "record", None) is not None:
        try:
            if getattr(pool, "dsa_kv_cache_store_fp8", False):
                raise UndigestedStore("SGLang's packed DSA FP8 latent store is not modelled")
            lid = _layer_id(layer, args[0] if args else kwargs.get("layer_id_override"))
            parts = [nope] if rope is None or rope.numel() == 0 else [nope, rope]
            _digest_latent(pool, lid, loc_info, [p.reshape(p.shape[0], -1) for p in parts])
        except Exception as exc:
            _fail(f"MLA store not digested: {type(exc).__name__}: {exc}")
    return original(pool, layer, loc_info, nope, rope, *args, **kwargs)

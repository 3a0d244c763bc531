"""Triton KV token checksum, bit-identical to ``kv_checksum_ref.token_digests_ref``.

token_digest(s, p) = fmix64(inner(s) XOR splitmix64(POS_SEED + p)),
inner(s) = sum_b sum_j zext64(word_b,j(s)) * C[b, j]   (mod 2**64);
see ``kv_checksum_ref`` for the full definition and the detection argument.

Design (one launch per KV buffer, no host-device sync):
* One launch per buffer, not one fused launch over all layers: buffers differ
  in dtype, row size and base pointer, and a per-buffer launch needs no
  pointer table on the device (which would need a host->device copy per call
  or a cache tied to pool lifetime). Launch count is 2 * layers.
* Each program owns BLOCK_N slots and loops over the row in BLOCK_W-word
  tiles, so no atomics are needed and the partial sums are reduced in
  registers; the [N] int64 accumulator is read-modify-written once per buffer.
  The row of a slot is contiguous, so each tile row is a coalesced load.
* Words are loaded as int32 and bitcast to uint32 before widening, so the
  widening is a zero-extension; all hash math is uint64 (wrapping multiply,
  logical shifts), which matches the int64 reference bit for bit.
* FIRST stores instead of accumulating (no zero-fill launch); LAST fuses the
  poskey XOR + fmix64 finalizer into the last buffer's launch (no extra
  launch). The constants C[b, :] are read from a small cached table (the
  same one the reference uses) rather than recomputed per tile.
* The constant table is built once per (shape, device) and cached; the first
  call on a device therefore does a host->device copy, so call once before
  capturing a CUDA graph.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from .kv_checksum_ref import (
    FMIX_M1,
    FMIX_M2,
    POS_SEED,
    SM_GAMMA,
    SM_M1,
    SM_M2,
    KvBuffer,
    _row_word_views,
    block_digests,
    row_words,
    token_digests_ref,
    word_constants,
)

try:  # the CPU engine path must work without triton
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


if HAVE_TRITON:
    # Globals used inside @triton.jit must be constexpr. Values >= 2**63 are
    # materialised by Triton as uint64 constants.
    _SM_GAMMA = tl.constexpr(SM_GAMMA)
    _SM_M1 = tl.constexpr(SM_M1)
    _SM_M2 = tl.constexpr(SM_M2)
    _FMIX_M1 = tl.constexpr(FMIX_M1)
    _FMIX_M2 = tl.constexpr(FMIX_M2)
    _POS_SEED = tl.constexpr(POS_SEED)

    @triton.jit  # type: ignore[untyped-decorator]
    def _kv_checksum_kernel(  # type: ignore[no-untyped-def]
        words_ptr,  # int32 view of the buffer: [num_slots, W], row stride `stride_slot`
        consts_ptr,  # int64 C[b, 0:W] for this buffer
        slots_ptr,  # int32/int64 [N]
        pos_ptr,  # int32/int64 [N] (read only when LAST)
        acc_ptr,  # int64 [N]: inner sums so far; digests after LAST
        N,
        W,
        stride_slot,  # in int32 words (between a page's rows, for a page-major buffer)
        stride_page,  # in int32 words (page-major only)
        per_page,  # rows per page (page-major only)
        PAGED: tl.constexpr,  # slot s is row s % per_page of page s // per_page
        FIRST: tl.constexpr,
        LAST: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        slot = tl.load(slots_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
        if PAGED:
            row_ptr = words_ptr + (slot // per_page) * stride_page + (slot % per_page) * stride_slot
        else:
            row_ptr = words_ptr + slot * stride_slot  # int64 offsets: big pools
        offs_w = tl.arange(0, BLOCK_W)

        tile = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.uint64)
        for w0 in range(0, W, BLOCK_W):
            cols = w0 + offs_w
            mask_w = cols < W
            c = tl.load(consts_ptr + cols, mask=mask_w, other=0)
            c = c.to(tl.uint64, bitcast=True)
            m2 = mask_n[:, None] & mask_w[None, :]
            wd = tl.load(row_ptr[:, None] + cols[None, :], mask=m2, other=0)
            # bitcast int32->uint32 first so the widening zero-extends
            wd = wd.to(tl.uint32, bitcast=True).to(tl.uint64)
            tile += wd * c[None, :]  # wrapping uint64 multiply-add
        inner = tl.sum(tile, axis=1)  # wrapping uint64 sum

        if not FIRST:
            prev = tl.load(acc_ptr + offs_n, mask=mask_n, other=0)
            inner += prev.to(tl.uint64, bitcast=True)

        if LAST:
            # poskey(p) = splitmix64(POS_SEED + p); positions sign-extend to
            # 64 bits exactly like the reference's .to(torch.int64).
            p = tl.load(pos_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
            z = p.to(tl.uint64, bitcast=True) + _POS_SEED
            z = z + _SM_GAMMA
            z = (z ^ (z >> 30)) * _SM_M1  # >> on uint64 is logical
            z = (z ^ (z >> 27)) * _SM_M2
            z = z ^ (z >> 31)
            # fmix64(inner ^ poskey)
            x = inner ^ z
            x = x ^ (x >> 33)
            x = x * _FMIX_M1
            x = x ^ (x >> 33)
            x = x * _FMIX_M2
            x = x ^ (x >> 33)
            inner = x

        tl.store(acc_ptr + offs_n, inner.to(tl.int64, bitcast=True), mask=mask_n)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _use_triton(device: torch.device) -> bool:
    if not HAVE_TRITON:
        return False
    if os.environ.get("KVGUARD_FORCE_TRITON", "") == "1":
        return True
    return device.type == "cuda"


def token_digests_triton(
    buffers: Sequence[KvBuffer],
    slots: torch.Tensor,
    positions: torch.Tensor,
    block_n: int = 64,
    block_w: int | None = None,
) -> torch.Tensor:
    """Triton path: one launch per buffer, last one finalizes. No host sync."""
    if not HAVE_TRITON:  # pragma: no cover
        raise RuntimeError("triton is not available")
    n = slots.numel()
    device = slots.device
    out = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return out
    views = [row_words(b) for b in buffers]
    wmax = max(v.shape[-1] for v in views)
    consts = word_constants(len(views), max(wmax, 1), device)
    nb = len(views)
    for bi, v in enumerate(views):
        assert v.device == device, "KV buffers, slots and positions must share a device"
        w, paged = v.shape[-1], v.dim() == 3
        bw = block_w or min(64, _next_pow2(max(w, 1)))
        grid = (triton.cdiv(n, block_n),)
        _kv_checksum_kernel[grid](
            v,
            consts[bi],
            slots,
            positions,
            out,
            n,
            w,
            v.stride(1) if paged else v.stride(0),
            v.stride(0) if paged else 0,
            v.shape[1] if paged else 1,
            PAGED=paged,
            FIRST=bi == 0,
            LAST=bi == nb - 1,
            BLOCK_N=block_n,
            BLOCK_W=bw,
        )
    return out


def token_digests(
    buffers: Sequence[KvBuffer], slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Token digests, int64 [N]; ``buffers`` = [k0, v0, k1, v1, ...] (each [num_slots, ...] or
    ``PageMajor``).

    Dispatch: Triton when the tensors are on CUDA (or KVGUARD_FORCE_TRITON=1,
    e.g. with TRITON_INTERPRET=1 on CPU tensors), else the torch reference.
    """
    if len(buffers) == 0:
        raise ValueError("need at least one KV buffer")
    if slots.dim() != 1 or positions.dim() != 1 or slots.numel() != positions.numel():
        raise ValueError("slots and positions must be 1-D of equal length")
    if slots.dtype not in (torch.int32, torch.int64) or positions.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError("slots and positions must be int32 or int64")
    device = buffers[0].device
    if any(b.device != device for b in buffers):
        raise ValueError("all KV buffers must be on the same device")
    _row_word_views(buffers)  # validates row contiguity, row size % 4, alignment (cached per pool)
    if _use_triton(device):
        if slots.device != device or positions.device != device:
            raise ValueError("slots/positions must be on the KV buffers' device")
        return token_digests_triton(buffers, slots.contiguous(), positions.contiguous())
    return token_digests_ref(buffers, slots.to(device), positions.to(device))


__all__ = [
    "HAVE_TRITON",
    "block_digests",
    "token_digests",
    "token_digests_ref",
    "token_digests_triton",
    "word_constants",
]

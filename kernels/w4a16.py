"""Triton W4A16 matmul on GPTQ tensors: ``y = x @ W`` with ``W`` decoded from ``qweight``,
``qzeros`` and ``scales`` on the fly (layout and math: ``w4a16_ref``).

Design:
* One program owns a [BLOCK_M, BLOCK_N] output tile and walks K in BLOCK_K steps. BLOCK_K
  divides ``group_size``, so every K step lies in one group: the tile needs one row of scales
  and one row of (packed) zeros per step, not one per element.
* The packed weight is read as the [BLOCK_K, BLOCK_N] grid ``qweight[k // 8, n]``: each int32
  word is fetched for 8 consecutive k (same cache line, so one memory transaction) and its
  nibble ``(k % 8) * 4`` is shifted out in registers. Nothing is unpacked in memory.
* Decode in float32, ``(code - zero) * scale``, cast to the activation dtype, ``tl.dot`` with
  float32 accumulation; the result is stored in the activation dtype. (float32 activations
  dot in float32, i.e. TF32 on tensor-core GPUs unless Triton is told otherwise.)
* K need not be a power of two (only a multiple of BLOCK_K); M and N are masked.
Used on GPUs where SGLang has no better GPTQ kernel (Marlin covers sm80+ symmetric checkpoints).
"""

from __future__ import annotations

import os

import torch

from .w4a16_ref import PACK, check_gptq_shapes, w4a16_matmul_ref

try:  # the CPU serving path must work without triton
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False


if HAVE_TRITON:
    # Triton kernel arguments are pointers and ints that Triton specializes on; annotations other
    # than tl.constexpr would change that, so this one function stays unannotated.
    @triton.jit  # type: ignore[untyped-decorator]
    def _w4a16_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        qw_ptr,
        qz_ptr,
        s_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        stride_xm,
        stride_qwk,
        stride_qzg,
        stride_sg,
        stride_ym,
        GROUP_SIZE: tl.constexpr,
        ZERO_OFFSET: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ) -> None:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < M
        mask_n = offs_n < N
        nib_k = (offs_k % 8) * 4  # BLOCK_K is a multiple of 8: same for every K step
        nib_n = (offs_n % 8) * 4

        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=mask_m[:, None], other=0.0
            )
            words = tl.load(
                qw_ptr + (k // 8)[:, None] * stride_qwk + offs_n[None, :],
                mask=mask_n[None, :],
                other=0,
            )
            codes = (words >> nib_k[:, None]) & 0xF
            g = k0 // GROUP_SIZE
            scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)
            zword = tl.load(qz_ptr + g * stride_qzg + offs_n // 8, mask=mask_n, other=0)
            zero = ((zword >> nib_n) & 0xF) + ZERO_OFFSET
            w = (codes - zero[None, :]).to(tl.float32) * scale.to(tl.float32)[None, :]
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), w, out_dtype=tl.float32)
            else:
                acc += tl.dot(a, w.to(a.dtype), out_dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            out,
            mask=mask_m[:, None] & mask_n[None, :],
        )


# Triton's CPU interpreter computes tl.dot in numpy, which has no bfloat16: there (tests only)
# bf16 tiles are widened to float32 before the dot. Compiled kernels dot in bf16.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"


def _use_triton(device: torch.device) -> bool:
    if not HAVE_TRITON:
        return False
    if os.environ.get("KVGUARD_FORCE_TRITON", "") == "1":
        return True
    return device.type == "cuda"


def _block_k(group_size: int) -> int:
    """Largest of 64/32/16 dividing group_size (tl.dot needs K tiles >= 16)."""
    for bk in (64, 32, 16):
        if group_size % bk == 0:
            return bk
    raise ValueError(f"the Triton W4A16 kernel needs group_size a multiple of 16, got {group_size}")


def w4a16_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zero_offset: int = 1,
    bias: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int | None = None,
) -> torch.Tensor:
    """Triton path; ``x`` [..., K] float16/bfloat16/float32, result [..., N] in ``x.dtype``."""
    if not HAVE_TRITON:  # pragma: no cover
        raise RuntimeError("triton is not available")
    k, n = check_gptq_shapes(qweight, qzeros, scales, group_size)
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, the weight expects {k}"
    assert zero_offset in (0, 1), zero_offset
    bk = block_k or _block_k(group_size)
    assert bk % PACK == 0 and group_size % bk == 0, (bk, group_size)
    for t in (qweight, qzeros, scales):
        assert t.device == x.device and t.stride(1) == 1, (
            "GPTQ tensors: same device, contiguous rows"
        )
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), "bias: contiguous [N]"
    bm = block_m or (16 if m <= 16 else 64)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x2,
        qweight,
        qzeros,
        scales,
        bias if bias is not None else y,
        y,
        m,
        n,
        k,
        x2.stride(0),
        qweight.stride(0),
        qzeros.stride(0),
        scales.stride(0),
        y.stride(0),
        GROUP_SIZE=group_size,
        ZERO_OFFSET=zero_offset,
        HAS_BIAS=bias is not None,
        DOT_FP32=x.dtype == torch.float32 or (_INTERPRETED and x.dtype == torch.bfloat16),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=bk,
    )
    return y.reshape(*x.shape[:-1], n)


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zero_offset: int = 1,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W (+ bias)``. Triton on CUDA (or KVGUARD_FORCE_TRITON=1, e.g. under
    TRITON_INTERPRET=1 on CPU tensors) when group_size is a multiple of 16; else the reference."""
    if _use_triton(x.device) and group_size % 16 == 0:
        return w4a16_matmul_triton(x, qweight, qzeros, scales, group_size, zero_offset, bias)
    return w4a16_matmul_ref(x, qweight, qzeros, scales, group_size, zero_offset, bias)


__all__ = ["HAVE_TRITON", "w4a16_matmul", "w4a16_matmul_ref", "w4a16_matmul_triton"]

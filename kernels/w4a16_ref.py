"""W4A16 (4-bit weights, 16-bit activations) in the GPTQ checkpoint layout: the torch reference.

Layout (``quant_method: gptq``, ``desc_act: false``, what AutoGPTQ / GPTQModel write and what
SGLang's GPTQ loaders read), for a linear layer ``y = x @ W`` with ``W`` of shape [K, N]
(in_features K, out_features N) and ``G = K / group_size`` groups along K:

* ``qweight`` int32 [K/8, N]: ``codes[8i + j, n]`` (0..15) in bits 4j..4j+3 of ``qweight[i, n]``.
* ``qzeros``  int32 [G, N/8]: ``stored_zero[g, 8c + j]`` in bits 4j..4j+3 of ``qzeros[g, c]``.
  Checkpoint format ``gptq`` (v1) stores ``zero - 1``, ``gptq_v2`` stores ``zero``:
  ``zero = stored_zero + zero_offset`` with ``zero_offset`` 1 (v1) or 0 (v2).
* ``scales``  [G, N] (float16 in checkpoints).
* ``W[k, n] = (codes[k, n] - zero[k // group_size, n]) * scales[k // group_size, n]``.

Symmetric 4-bit GPTQ (``sym: true``) has ``zero = 8`` everywhere (v1 stores 7).
The Triton kernel in ``w4a16.py`` computes ``x @ W`` from the same tensors.
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit codes per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j at bits 4j


def _to_int32_words(acc: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> the int32 with the same 32 bits (two's complement)."""
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def _check_codes(codes: torch.Tensor) -> None:
    if codes.dim() != 2:
        raise ValueError(f"expected a 2-D code matrix, got shape {tuple(codes.shape)}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("4-bit codes must lie in 0..15")


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[K, N] codes -> int32 [K/8, N], 8 consecutive rows per word (``qweight``)."""
    _check_codes(codes)
    k, n = codes.shape
    if k % PACK:
        raise ValueError(f"rows ({k}) must be a multiple of {PACK} to pack 4-bit codes")
    c = codes.to(torch.int64).view(k // PACK, PACK, n)
    acc = (c << _SHIFTS.to(torch.int64).view(1, PACK, 1)).sum(dim=1)
    return _to_int32_words(acc)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [K/8, N] -> int32 codes [K, N]."""
    shifts = _SHIFTS.to(words.device).view(1, PACK, 1)
    codes = (words.unsqueeze(1) >> shifts) & 0xF
    return codes.reshape(words.shape[0] * PACK, words.shape[1])


def pack_cols(codes: torch.Tensor) -> torch.Tensor:
    """[G, N] codes -> int32 [G, N/8], 8 consecutive columns per word (``qzeros``)."""
    _check_codes(codes)
    g, n = codes.shape
    if n % PACK:
        raise ValueError(f"columns ({n}) must be a multiple of {PACK} to pack 4-bit codes")
    c = codes.to(torch.int64).view(g, n // PACK, PACK)
    acc = (c << _SHIFTS.to(torch.int64).view(1, 1, PACK)).sum(dim=2)
    return _to_int32_words(acc)


def unpack_cols(words: torch.Tensor) -> torch.Tensor:
    """int32 [G, N/8] -> int32 codes [G, N]."""
    shifts = _SHIFTS.to(words.device).view(1, 1, PACK)
    codes = (words.unsqueeze(2) >> shifts) & 0xF
    return codes.reshape(words.shape[0], words.shape[1] * PACK)


def check_gptq_shapes(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> tuple[int, int]:
    """Validate a GPTQ tensor triple; returns (K, N)."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("qweight and qzeros must be int32")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must be positive and divide in_features {k}")
    groups = k // group_size
    if tuple(scales.shape) != (groups, n):
        raise ValueError(f"scales shape {tuple(scales.shape)} != ({groups}, {n})")
    if tuple(qzeros.shape) != (groups, n // PACK):
        raise ValueError(f"qzeros shape {tuple(qzeros.shape)} != ({groups}, {n // PACK})")
    return k, n


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zero_offset: int = 1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The [K, N] weight the GPTQ tensors encode, computed in float32, returned as ``dtype``."""
    k, _n = check_gptq_shapes(qweight, qzeros, scales, group_size)
    codes = unpack_rows(qweight)  # [K, N]
    zeros = unpack_cols(qzeros) + zero_offset  # [G, N]
    group = torch.arange(k, device=qweight.device) // group_size
    w = (codes - zeros[group]).to(torch.float32) * scales.to(torch.float32)[group]
    return w.to(dtype)


def w4a16_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    zero_offset: int = 1,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ W (+ bias)`` for x [..., K]: float32 math, result in ``x.dtype``."""
    w = dequantize(qweight, qzeros, scales, group_size, zero_offset)
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {w.shape[0]}")
    y: torch.Tensor = x.to(torch.float32) @ w
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def quantize_rtn(
    w: torch.Tensor, group_size: int, sym: bool = True, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of a [K, N] weight, per (group of K, column).

    Symmetric (the GPTQ convention): ``scale = 2 * max|w| / 15``, ``zero = 8``,
    ``code = clamp(round(w / scale) + 8, 0, 15)``. Asymmetric: min/max over the group.
    Scales are rounded to ``scale_dtype`` (what the checkpoint stores) before coding.
    Returns (codes int32 [K, N], zeros int32 [G, N], scales float32 [G, N]).
    """
    k, n = w.shape
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size {group_size} must be positive and divide in_features {k}")
    g = w.to(torch.float32).reshape(k // group_size, group_size, n)
    scales, zeros = group_params(g, sym, scale_dtype)
    codes = torch.clamp(torch.round(g / scales[:, None, :]) + zeros[:, None, :], 0, 15)
    return codes.reshape(k, n).to(torch.int32), zeros.to(torch.int32), scales


def group_params(
    g: torch.Tensor, sym: bool, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales, zeros) float32 [G, N] of 4-bit groups ``g`` [G, group, N] (GPTQ's quantizer)."""
    wmin = torch.clamp(g.amin(dim=1), max=0.0)
    wmax = torch.clamp(g.amax(dim=1), min=0.0)
    if sym:
        wmax = torch.maximum(wmin.abs(), wmax)
        wmin = -wmax
    empty = (wmin == 0) & (wmax == 0)
    wmin, wmax = torch.where(empty, -1.0, wmin), torch.where(empty, 1.0, wmax)
    scales = torch.clamp((wmax - wmin) / 15, min=torch.finfo(scale_dtype).tiny)
    scales = scales.to(scale_dtype).to(torch.float32)
    zeros = torch.full_like(scales, 8.0) if sym else torch.round(-wmin / scales)
    return scales, zeros

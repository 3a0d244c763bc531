"""The writer's digest on a GPU pool: ``read_verify_ref.hash_rows`` as one Triton launch.

``acc[i] +=`` the inner sum of row ``i`` of the rows a layer hands its pool's store (after the
cast to the storage dtype): each 32-bit word times its buffer's odd constant, summed mod 2**64,
as ``w * lo + ((w * hi) << 32)`` (32-bit multiplies, as ``triton_seal._token_inner`` sums a
token's words). The compiled CPU path is ``guard_cpu.c``'s ``hash_rows``; the torch reference
is the specification both are tested against (``tests/test_writer_digests.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_checksum_ref import row_words
from .triton_common import _sum

# mypy: disable-error-code="untyped-decorator,no-untyped-def"

_ROWS = 16  # rows per program
_WORDS = 64  # words per inner block


@triton.jit
def _hash_rows(src, row_stride, words, lo, hi, acc, n, BR: tl.constexpr, BWORD: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < n
    cols = tl.arange(0, BWORD)
    lo_acc = tl.full([BR, BWORD], 0, tl.uint64)
    hi_acc = tl.full([BR, BWORD], 0, tl.uint32)
    for w0 in range(0, words, BWORD):
        cw = w0 + cols
        mw = cw < words
        clo = tl.load(lo + cw, mask=mw, other=0).to(tl.uint32, bitcast=True)
        chi = tl.load(hi + cw, mask=mw, other=0).to(tl.uint32, bitcast=True)
        ptr = src + rows.to(tl.int64)[:, None] * row_stride + cw[None, :]
        x = tl.load(ptr, mask=rmask[:, None] & mw[None, :], other=0).to(tl.uint32, bitcast=True)
        lo_acc += x.to(tl.uint64) * clo.to(tl.uint64)[None, :]
        hi_acc += x * chi[None, :]
    total = _sum(lo_acc, axis=1) + (_sum(hi_acc, axis=1).to(tl.uint64) << 32)
    old = tl.load(acc + rows, mask=rmask, other=0).to(tl.uint64, bitcast=True)
    tl.store(acc + rows, (old + total).to(tl.int64, bitcast=True), mask=rmask)


def hash_rows(src: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, acc: torch.Tensor) -> None:
    """``acc[i] +=`` the inner sum of row ``i`` of ``src`` [n, ...] (each row contiguous, whole
    32-bit words) with the buffer's constant halves ``lo``, ``hi`` (int32 bits, on ``src``'s
    device: ``read_verify.constant_halves``); ``acc`` [n] int64, contiguous."""
    n = src.shape[0]
    if n == 0:
        return
    words = row_words(src.reshape(n, -1))
    w = words.shape[1]
    if lo.numel() < w or hi.numel() < w:
        raise ValueError(f"hash_rows: {w} words a row, constants for {min(lo.numel(), hi.numel())}")
    _hash_rows[(triton.cdiv(n, _ROWS),)](
        words, words.stride(0), w, lo, hi, acc, n, BR=_ROWS, BWORD=_WORDS
    )

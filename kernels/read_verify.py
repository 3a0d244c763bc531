"""Verified reads on a CPU pool: ``_read_verify`` (``csrc/read_verify.c``) behind the functions of
``read_verify_ref`` (the specification; same arguments, same results bit for bit). The writer's
digest (``hash_rows``) also runs on a GPU pool's rows, through ``triton_write_digest``.

``gather_rows`` is what attention calls once per KV buffer and layer; ``verify_reads`` what the
guard calls once per step, after the last layer. Neither dispatches a torch operator on the hot
path beyond allocating the gathered copy attention reads anyway.
"""

from __future__ import annotations

from array import array

import torch

from . import _read_verify as C  # built by setup.sh / pip install (setuptools ext-modules)
from .read_verify_ref import buffer_constants

_HALVES: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def constant_halves(
    buffer_index: int, row_bytes: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffer's word constants split in 32-bit halves (int32 tensors with the uint32 bits),
    on ``device``: w * C = w * lo + ((w * hi) << 32) mod 2**64, which vectorizes as 32-bit
    multiplies."""
    key = (buffer_index, row_bytes, str(device))
    hit = _HALVES.get(key)
    if hit is None:
        c = buffer_constants(buffer_index, row_bytes)
        lo = (c & 0xFFFFFFFF).to(torch.int64).to(torch.uint32).view(torch.int32).contiguous()
        hi = ((c >> 32) & 0xFFFFFFFF).to(torch.uint32).view(torch.int32).contiguous()
        hit = _HALVES[key] = (lo.to(device), hi.to(device))
    return hit


def _slot_layout(cache: torch.Tensor) -> tuple[int, int]:
    """(slot stride, row bytes) of a pool buffer whose slot rows are contiguous."""
    row_bytes = cache[0].numel() * cache.element_size() if cache.shape[0] else 0
    if cache.dim() > 1 and not cache[0].is_contiguous():
        raise ValueError("each slot's KV row must be contiguous")
    return cache.stride(0) * cache.element_size(), row_bytes


def gather_rows(
    cache: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor | None = None,
    buffer_index: int | None = None,
    acc: torch.Tensor | None = None,
) -> torch.Tensor:
    """``read_verify_ref.gather_rows`` with the buffer named by index (its constants cached)."""
    if not (cache.is_cpu and rows.is_cpu and rows.dtype == torch.int64 and rows.is_contiguous()):
        raise ValueError("gather_rows: a CPU cache and contiguous int64 rows")
    stride, row_bytes = _slot_layout(cache)
    n = rows.shape[0]
    if table is None:
        out = torch.empty((n, *cache.shape[1:]), dtype=cache.dtype)
        t_ptr, elem = 0, 0
    else:
        if cache.element_size() != 1 or table.numel() != 256 or not table.is_contiguous():
            raise ValueError("gather_rows: a lookup table maps one-byte (FP8) rows, 256 entries")
        out = torch.empty((n, *cache.shape[1:]), dtype=table.dtype)
        t_ptr, elem = table.data_ptr(), table.element_size()
    lo_ptr = hi_ptr = acc_ptr = 0
    if acc is not None and buffer_index is not None:
        if acc.dtype != torch.int64 or not acc.is_contiguous() or acc.numel() != n:
            raise ValueError("gather_rows: acc must be contiguous int64 with one entry per row")
        lo, hi = constant_halves(buffer_index, row_bytes)
        lo_ptr, hi_ptr, acc_ptr = lo.data_ptr(), hi.data_ptr(), acc.data_ptr()
    C.gather_rows(
        cache.data_ptr(), stride, row_bytes, cache.shape[0], rows.data_ptr(), n, t_ptr, elem,
        out.data_ptr(), lo_ptr, hi_ptr, acc_ptr,
    )  # fmt: skip
    return out


def hash_rows(src: torch.Tensor, buffer_index: int, acc: torch.Tensor) -> None:
    """``read_verify_ref.hash_rows`` with the buffer named by index (its constants cached):
    ``acc[i] +=`` the inner part of row ``i`` of ``src`` [n, ...] (rows of whole 32-bit words,
    each contiguous; a strided slot dimension is fine)."""
    n = src.shape[0]
    if not (acc.device == src.device and acc.dtype == torch.int64 and acc.is_contiguous()):
        raise ValueError("hash_rows: contiguous int64 sums on the rows' device")
    if acc.numel() != n:
        raise ValueError(f"hash_rows: {n} rows for {acc.numel()} sums")
    if n == 0:
        return
    if src.is_cuda:  # a GPU pool: one Triton launch (Triton imported only where it runs)
        from .triton_write_digest import hash_rows as hash_rows_triton

        row_bytes = src[0].numel() * src.element_size()
        lo, hi = constant_halves(buffer_index, row_bytes, src.device)
        hash_rows_triton(src, lo, hi, acc)
        return
    if not src.is_cpu:
        raise ValueError(f"hash_rows: rows on {src.device}: CPU or CUDA")
    if src.dim() > 1 and not src[0].is_contiguous():
        src = src.contiguous()
    stride, row_bytes = _slot_layout(src)
    lo, hi = constant_halves(buffer_index, row_bytes)
    C.hash_rows(src.data_ptr(), stride, row_bytes, n, lo.data_ptr(), hi.data_ptr(), acc.data_ptr())


_MAX_BAD_PAGES = 64


def verify_reads(
    acc: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: list[int],
    req_rows: torch.Tensor,
    page_size: int,
    num_slots: int,
    digest: torch.Tensor,
    fill: torch.Tensor,
    epoch: torch.Tensor,
    agg: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``read_verify_ref.verify_reads``, compiled. Called once per step on a cache-cold CPU: a
    clean step allocates no tensor (host arrays in, a shared empty result out)."""
    B = len(seq_lens)
    if sum(seq_lens) > min(acc.numel(), rows.numel()) or req_rows.numel() != B:
        raise ValueError("verify_reads: rows and sums must cover every request's positions")
    for t, dtype in ((acc, torch.int64), (rows, torch.int64), (req_rows, torch.int64),
                     (digest, torch.int64), (fill, torch.int16), (epoch, torch.int64),
                     (agg, torch.int64)):  # fmt: skip
        if t.dtype != dtype or not t.is_contiguous() or not t.is_cpu:
            raise ValueError("verify_reads: contiguous CPU tensors of the ledger's dtypes")
    if min(seq_lens, default=0) < 0:
        raise ValueError("verify_reads: a negative read length")
    lens = array("q", seq_lens)
    bad = array("B", bytes(max(B, 1)))
    pages = array("q", bytes(8 * _MAX_BAD_PAGES))
    r = C.verify_reads(
        acc.data_ptr(), rows.data_ptr(), lens.buffer_info()[0], req_rows.data_ptr(), B,
        page_size, num_slots, agg.numel(), digest.data_ptr(), fill.data_ptr(), epoch.data_ptr(),
        agg.data_ptr(), bad.buffer_info()[0], pages.buffer_info()[0], _MAX_BAD_PAGES,
    )  # fmt: skip
    if r >> 32 == 0:
        return _clean(B), _NO_PAGES
    n = r & 0xFFFFFFFF
    return torch.tensor(bad[:B], dtype=torch.bool), torch.tensor(pages[:n], dtype=torch.int64)


_NO_PAGES = torch.empty(0, dtype=torch.int64)
_CLEAN: dict[int, torch.Tensor] = {}


def _clean(B: int) -> torch.Tensor:
    """A shared all-False verdict of B requests (read only)."""
    out = _CLEAN.get(B)
    if out is None:
        out = _CLEAN[B] = torch.zeros(B, dtype=torch.bool)
    return out

"""Torch implementations of the ``sgl_kernel`` ``*_cpu`` ops that SGLang's CPU engine imports.

PyPI has no CPU build of ``sgl_kernel`` (it is compiled from source for Intel AMX machines), yet
with ``SGLANG_USE_CPU_ENGINE=1`` eight SGLang modules import these names at import time. This module
is served as ``sgl_kernel`` only when no real ``sgl_kernel`` is importable (see ``finder.py``).
Each op below follows the semantics of the Triton kernel SGLang runs on GPU for the same call site;
``tests/test_sgl_kernel_compat.py`` checks them against those kernels under the Triton interpreter.
Ops that only serve features kvguard does not support on CPU raise a clear error instead.
"""

from __future__ import annotations

import ctypes

import torch

KVGUARD_COMPAT = True  # lets callers tell this module from a real sgl_kernel


class UnsupportedOnCpu(RuntimeError):
    """A kernel that only a feature unsupported on CPU (without a real sgl_kernel) would call."""


def _packed_rows(start_offset: torch.Tensor, end_offset: torch.Tensor):
    """For spans [start_i, end_i) packed back to back: (span id, column) of every packed element."""
    lens = (end_offset - start_offset).to(torch.int64)
    span = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens  # packed offset where each span begins
    col = (
        start_offset.to(torch.int64)[span]
        + torch.arange(span.numel(), device=lens.device)
        - first[span]
    )
    return span, col


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[row_i, start_i:end_i] = the i-th packed span of out_cache_loc."""
    span, col = _packed_rows(start_offset, end_offset)
    rows = req_pool_indices.to(torch.int64)[span]
    req_to_token[rows, col] = out_cache_loc[: span.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Inverse of the above: pack req_to_token[row_i, start_i:end_i] into out_cache_loc."""
    span, col = _packed_rows(start_offset, end_offset)
    rows = req_pool_indices.to(torch.int64)[span]
    out_cache_loc[: span.numel()] = req_to_token[rows, col].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols
):
    """out_cache_loc[i*topk*num_cols + k] = req_to_token[row_i, seq_len_i + k]."""
    width = topk * num_cols
    bs = seq_lens.numel()
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(width, device=seq_lens.device)
    rows = req_pool_indices.to(torch.int64)[:, None].expand(bs, width)
    out_cache_loc[: bs * width] = req_to_token[rows, cols].reshape(-1).to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[i] = accept_tokens.flat[accept_stride*i + accept_lens[i] - 1]."""
    bs = accept_lens.numel()
    idx = (
        torch.arange(bs, device=accept_lens.device) * accept_stride
        + accept_lens.to(torch.int64)
        - 1
    )
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact out_cache_loc[accept_index[j]] for every accept_index[j] != -1, in order."""
    src = accept_index.reshape(-1)
    src = src[src != -1].to(torch.int64)
    accept_out_cache_loc[: src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (base address, bytes per slot): rows[tgt_loc] = rows[src_loc].

    SGLang passes raw base addresses (the GPU kernel casts them to pointers). On CPU the memory
    is host memory, so each buffer is viewed in place through ctypes, gathered, then scattered:
    the gather-then-scatter order keeps overlapping src/tgt sets correct, as the tiled kernel does.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    num_rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (num_rows * stride)).from_address(base)
        rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, stride)
        rows.index_copy_(0, tgt, rows.index_select(0, src))


def _unsupported(name: str, feature: str):
    def op(*args, **kwargs):
        raise UnsupportedOnCpu(
            f"sgl_kernel.{name} is not available: {feature} needs a real sgl_kernel build "
            "(kvguard's CPU compatibility layer does not implement it). "
            "Disable speculative decoding or run on a machine with sgl_kernel installed."
        )

    op.__name__ = name
    return op


# EAGLE tree building and verification: every EAGLE / NEXTN draft and verify step on CPU reaches
# these, topk 1 included (docs/glm.md, MTP on CPU).
build_tree_kernel_efficient_cpu = _unsupported(
    "build_tree_kernel_efficient_cpu", "EAGLE tree speculative decoding"
)
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu", "EAGLE tree speculative decoding")

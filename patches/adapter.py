"""SGLang's batches and pools as the guard sees them: a ``StepView`` per forward, the KV buffers
by pool kind. Reads SGLang's objects; changes nothing (the firewall, in the guard, redirects a
bad write target in ``out_cache_loc``)."""

from __future__ import annotations

from array import array

import torch

from kvguard.kernels.kv_checksum_ref import KvBuffer, page_major, row_words
from kvguard.patches import state
from kvguard.patches.tenancy import tenant_seeds
from kvguard.step import StepView


def step_view(fb, batch, step: int) -> StepView | None:
    """SGLang ForwardBatch -> StepView, or None for a batch that runs no model forward over KV
    (idle). Anything else the guard does not model is refused at start (speculative decoding) or
    counted as unchecked. On the decode path no torch operator runs here: the guard takes
    SGLang's own tensors (the firewall redirects ``out_cache_loc`` in place)."""
    mode = fb.forward_mode
    guard = state.guard
    assert guard is not None
    loc = fb.out_cache_loc
    if loc.dtype != torch.int64:
        raise TypeError(
            f"out_cache_loc is {loc.dtype}; the write firewall needs SGLang's int64 slots"
        )
    if mode.is_decode():
        lens = fb.seq_lens_cpu.tolist() if fb.seq_lens_cpu is not None else fb.seq_lens.tolist()
        prefix_host = [n - 1 for n in lens]
        write_batch = None  # one token per request, in batch order
        prefix_tokens = None
    elif mode.is_extend() and fb.extend_prefix_lens is not None:
        prefix_host = list(fb.extend_prefix_lens_cpu)
        counts = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
        write_batch = torch.repeat_interleave(
            torch.arange(len(counts), device=loc.device), fb.extend_seq_lens.to(torch.int64)
        )
        # Our own prompt's prefix tokens: a prefix-cache page is adopted only if it holds them.
        tokens = array("q")
        for req, n in zip(batch.reqs, prefix_host):
            tokens.extend(req.full_untruncated_fill_ids[:n])
        prefix_tokens = (
            torch.frombuffer(tokens, dtype=torch.int64)
            if tokens
            else torch.empty(0, dtype=torch.int64)
        )
        prefix_tokens = prefix_tokens.to(loc.device, non_blocking=True)
    else:
        return None
    rows = fb.req_pool_indices
    return StepView(
        step=step,
        rows=rows if rows.dtype == torch.int64 else rows.to(torch.int64),
        prefix_lens_host=prefix_host,
        write_slots=loc,
        write_batch=write_batch,
        write_pos=fb.positions
        if fb.positions.dtype == torch.int64
        else fb.positions.to(torch.int64),
        write_tokens=fb.input_ids
        if fb.input_ids.dtype == torch.int64
        else fb.input_ids.to(torch.int64),
        page_table=state.scheduler.req_to_token_pool.req_to_token,
        prefix_tokens=prefix_tokens,
        tenant_seeds=(
            tenant_seeds(batch.reqs, loc.device, True) if guard.config.tenant_isolation else None
        ),
        request_ids=[req.rid for req in batch.reqs],
        pad_slot=0,  # SGLang's padding slot: written by padded tokens, read by no request
    )


class UnsupportedPoolError(RuntimeError):
    """The scheduler's KV pool is of a kind the guard cannot model: refused at start, never served
    unchecked."""


# Pool kinds the guard models, by exact class name (a subclass may store more than these buffers,
# e.g. FP4 scales or a compressed index-key tail, so it is refused until it is modelled).
_MHA_POOLS = ("MHATokenToKVPool",)
_MLA_POOLS = ("MLATokenToKVPool",)
DSA_POOLS = ("DSATokenToKVPool",)


def guarded_kv_buffers(pool) -> tuple[str, list[KvBuffer]]:
    """The pool's per-slot KV buffers by kind, every stored byte: MHA ``[k0, v0, k1, v1, ...]``
    (``k_buffer``/``v_buffer``, one tensor per layer), MLA ``[latent0, latent1, ...]``
    (``kv_buffer``: one compressed latent row per token and layer), DSA the MLA latents, then
    each indexer layer's index keys and their scales (``index_key_buffers``). Returns (kind,
    buffers)."""
    name = type(pool).__name__
    buffers: list[KvBuffer]
    if name in _MHA_POOLS:
        k, v = pool.k_buffer, pool.v_buffer
        kind, buffers = "mha", [b for pair in zip(k, v) for b in pair]
    elif name in _MLA_POOLS:
        kind, buffers = "mla", list(pool.kv_buffer)
    elif name in DSA_POOLS:
        kind, buffers = "dsa", list(pool.kv_buffer)
    else:
        kind, buffers = "", []
    if kind:
        try:  # the checksum reads every stored byte as 32-bit words of contiguous slot rows
            for b in buffers:
                row_words(b)
            if kind == "dsa":
                buffers += index_key_buffers(pool, num_slots=buffers[0].shape[0])
        except ValueError as exc:
            raise UnsupportedPoolError(
                f"kvguard cannot guard the KV pool {name}: {exc} (shape {tuple(buffers[0].shape)}, "
                f"{buffers[0].dtype}); run with --kvguard-mode off to serve this model without the guard"
            ) from None
        return kind, buffers
    known = ", ".join(_MHA_POOLS + _MLA_POOLS + DSA_POOLS)
    raise UnsupportedPoolError(
        f"kvguard cannot guard the KV pool {name} (guarded pools: {known}); "
        "run with --kvguard-mode off to serve this model without the guard"
    )


def index_key_layout(pool) -> tuple[int, int, int]:
    """(page size, key bytes, scale bytes) of a DSA pool's index keys (SGLang's
    ``index_k_with_scale_buffer``, DeepGEMM's layout): page p, the allocator's page p, holds the
    FP8 keys of its slots token-major (``index_head_dim`` bytes each), then their fp32 scales.
    The one definition the guard's hashing and the fuzz oracle's byte access share. Raises
    ValueError for a layout the guard does not model (pooled or compressed index pages)."""
    ps, dim = pool.page_size, pool.index_head_dim
    if pool.index_kpool != 1 or pool.index_page_size != ps or pool.kpool_use_compress:
        raise ValueError(
            f"index keys pooled {pool.index_kpool} pages per row (index page "
            f"{pool.index_page_size}, compressed {pool.kpool_use_compress}): not modelled"
        )
    return ps, dim, dim // pool.quant_block_size * 4


def index_key_layers(pool) -> list[torch.Tensor]:
    """The index-key buffers of the indexer layers that store keys (a layer reusing the
    previous one's top-k has 0 rows), each checked against :func:`index_key_layout`."""
    ps, dim, scale_bytes = index_key_layout(pool)
    out = []
    for buf in pool.index_k_with_scale_buffer:
        if buf.shape[0] == 0:
            continue
        if buf.dtype != torch.uint8 or buf.shape[1] != ps * (dim + scale_bytes):
            raise ValueError(f"an index-key buffer {tuple(buf.shape)} {buf.dtype}")
        out.append(buf)
    return out


def index_key_buffers(pool, num_slots: int) -> list[KvBuffer]:
    """A DSA pool's index keys, two page-major views per indexer layer
    (:func:`index_key_layout`). Raises ValueError for a layout the guard does not model."""
    ps, dim, scale_bytes = index_key_layout(pool)
    out: list[KvBuffer] = []
    for buf in index_key_layers(pool):
        if buf.shape[0] * ps < num_slots:
            raise ValueError(f"{buf.shape[0]} index pages do not cover {num_slots} slots")
        out += index_key_views(buf, ps, dim, scale_bytes)
    return out


def index_key_views(buf, page_size: int, dim: int, scale_bytes: int) -> list[KvBuffer]:
    """One indexer layer's buffer as its two page-major views, (keys, scales): what the guard
    hashes, and what a verified read of that layer's index keys hashes as it reads."""
    keys = page_major(buf, offset=0, slot_bytes=dim, row_bytes=dim, per_page=page_size)
    scales = page_major(
        buf, offset=page_size * dim, slot_bytes=scale_bytes, row_bytes=scale_bytes,
        per_page=page_size,
    )  # fmt: skip
    return [keys, scales]

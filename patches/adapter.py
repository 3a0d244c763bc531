"""SGLang's batches and pools as the guard sees them: a ``StepView`` per forward, the KV buffers
by pool kind. Reads SGLang's objects; changes nothing."""

from __future__ import annotations

from array import array

import torch

from kvguard.patches import state
from kvguard.step import StepView


def failed_verdict(batch):
    """A verdict that aborts every request of the batch: what cannot be checked is not served."""
    from kvguard.checker import StepVerdict
    from kvguard.verdict import Kind

    n = len(batch.reqs)
    dev = state.guard.ledger.device
    rows = torch.zeros(n, dtype=torch.int64, device=dev)
    view = StepView(
        step=state.guard.step,
        rows=rows,
        prefix_lens=rows,
        max_prefix_len=0,
        write_slots=rows[:0],
        write_batch=rows[:0],
        write_pos=rows[:0],
        write_tokens=rows[:0],
        page_table=state.scheduler.req_to_token_pool.req_to_token,
        request_ids=[r.rid for r in batch.reqs],
    )
    kinds = torch.full((n,), int(Kind.GUARD_ERROR), dtype=torch.int64, device=dev)
    return StepVerdict(
        view=view,
        kinds=kinds,
        taint=torch.zeros(state.guard.ledger.num_pages, dtype=torch.bool, device=dev),
    )


def step_view(fb, batch, step: int) -> StepView | None:
    """SGLang ForwardBatch -> StepView. None for batches the guard does not model (idle, spec)."""
    mode = fb.forward_mode
    rows = fb.req_pool_indices.to(torch.int64)
    if mode.is_decode():
        prefix = fb.seq_lens.to(torch.int64) - 1
        max_prefix = (
            int(fb.seq_lens_cpu.max()) - 1 if fb.seq_lens_cpu is not None else int(prefix.max())
        )
        write_batch = torch.arange(rows.numel(), device=rows.device)
        prefix_tokens = None
    elif mode.is_extend() and fb.extend_prefix_lens is not None:
        prefix = fb.extend_prefix_lens.to(torch.int64)
        max_prefix = max(fb.extend_prefix_lens_cpu) if fb.extend_prefix_lens_cpu else 0
        write_batch = torch.repeat_interleave(
            torch.arange(rows.numel(), device=rows.device), fb.extend_seq_lens.to(torch.int64)
        )
        # Our own prompt's prefix tokens: a prefix-cache page is adopted only if it holds them.
        tokens = array("q")
        for req, n in zip(batch.reqs, fb.extend_prefix_lens_cpu):
            tokens.extend(req.full_untruncated_fill_ids[:n])
        prefix_tokens = (
            torch.frombuffer(tokens, dtype=torch.int64)
            if tokens
            else torch.empty(0, dtype=torch.int64)
        )
        prefix_tokens = prefix_tokens.to(rows.device, non_blocking=True)
    else:
        return None
    return StepView(
        step=step,
        rows=rows,
        prefix_lens=prefix,
        max_prefix_len=max(int(max_prefix), 0),
        write_slots=fb.out_cache_loc.to(torch.int64),
        write_batch=write_batch,
        write_pos=fb.positions.to(torch.int64),
        write_tokens=fb.input_ids.to(torch.int64),
        page_table=state.scheduler.req_to_token_pool.req_to_token,
        prefix_tokens=prefix_tokens,
        request_ids=[req.rid for req in batch.reqs],
    )


class UnsupportedPoolError(RuntimeError):
    """The scheduler's KV pool is of a kind the guard cannot model: refused at start, never served
    unchecked."""


# Pool kinds the guard models, by exact class name (a subclass may store more than these buffers,
# e.g. FP4 scales or an index-key cache, so it is refused until it is modelled).
_MHA_POOLS = ("MHATokenToKVPool",)
_MLA_POOLS = ("MLATokenToKVPool",)


def guarded_kv_buffers(pool) -> tuple[str, list[torch.Tensor]]:
    """The pool's per-slot KV buffers by kind, every stored byte: MHA ``[k0, v0, k1, v1, ...]``
    (``k_buffer``/``v_buffer``, one tensor per layer), MLA ``[latent0, latent1, ...]``
    (``kv_buffer``: one compressed latent row per token and layer). Returns (kind, buffers)."""
    name = type(pool).__name__
    if name in _MHA_POOLS:
        k, v = pool.k_buffer, pool.v_buffer
        return "mha", [b for pair in zip(k, v) for b in pair]
    if name in _MLA_POOLS:
        return "mla", list(pool.kv_buffer)
    known = ", ".join(_MHA_POOLS + _MLA_POOLS)
    raise UnsupportedPoolError(
        f"kvguard cannot guard the KV pool {name} (guarded pools: {known}); "
        "run with --kvguard-mode off to serve this model without the guard"
    )

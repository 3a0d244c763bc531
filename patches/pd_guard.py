"""The guard on a prefill/decode pair: on the decode server the KV transfer is a writer the guard
checks (``kvguard.transfers``). Hook functions named in ``targets.py`` (PD_GUARD_TARGETS).

SGLang 0.5.23's decode path (``disaggregation/decode.py``), and what the guard does there:

* ``DecodePreallocQueue._pre_alloc``: a request's row (``DecodeReqToTokenPool.alloc``) and its
  KV slots (``alloc_for_decode_prealloc``: the allocator's ``alloc`` / ``alloc_extend``, hooked
  like any hand-out) are allocated, and the slots written into its row; they are the transfer's
  destination (``pop_preallocated`` sends them to the prefill as page indices). ``after_pre_alloc``
  claims them for the request now, unsealed.
* ``DecodeTransferQueue.pop_transferred``: a request whose poll is ``KVPoll.Success`` on every
  rank is committed (``_commit_transfer_to_req``: its first token from the metadata buffer) and
  leaves the transfer queue for the waiting queue, whose prebuilt batch (``PREBUILT``: no
  forward) merges it into the running batch; its first decode forward reads the transferred KV.
  ``around_commit_transfer`` seals the landed bytes there if the claim is unchanged, else aborts
  the request through SGLang's own path (``pop_transferred`` streams and releases a request
  that ``_commit_transfer_to_req`` left aborted).
* A failed or aborted transfer releases the slots through ``_release_request`` ->
  ``release_kv_cache(checkpoint=False)`` (at once, or from ``resolve_deferred_releases`` after a
  drain or a timeout): the hooked, attributed release. Its claim is dropped when the row is
  handed out again (``around_decode_rows_alloc``).

The prefill server needs nothing here: its forwards are checked as a single server's; SGLang
sends a request's KV after its forward (``process_batch_result_disagg_prefill`` ->
``send_kv_chunk``) and releases its pages only once the sender reports the transfer done
(``process_disagg_prefill_inflight_queue`` -> ``release_kv_cache``), so the guard never sees a
send from freed pages; the send reads KV and writes none of this pool.

Test switch: ``KVGUARD_TEST_PD_FLIP_ROOM=<bootstrap room>`` flips one byte of that request's KV
right after its transfer landed and was sealed (before its first read), as SGLang's
``SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB`` fakes a mismatch for its own checksum.
"""

from __future__ import annotations

import os

import torch

from kvguard.patches import pool_hooks, state
from kvguard.patches.tenancy import namespace_of, namespace_seed

FLIP_ROOM = "KVGUARD_TEST_PD_FLIP_ROOM"


# -- DecodeReqToTokenPool.alloc (AROUND) -------------------------------------------------------------
def around_decode_rows_alloc(original, pool, reqs, *args, **kwargs):
    """The decode server's page-table rows (``ReqToTokenPool.alloc_rows`` on other servers)."""
    fresh = [r for r in reqs if not r.kv.holds_kv]
    out = original(pool, reqs, *args, **kwargs)
    if out is not None and fresh and state.guard is not None:
        pool_hooks.on_rows_allocated([int(r.kv.req_pool_idx) for r in fresh], pool)
    return out


# -- DecodePreallocQueue._pre_alloc (AFTER) ------------------------------------------------------------
def after_pre_alloc(result, queue, req, *args, **kwargs):
    """The transfer's destination slots (``result``, positions [0, n) of the request's row) are
    claimed for the request. A claim the guard could not make is flagged when the transfer
    lands (no claim)."""
    guard = state.guard
    if not state.on() or not isinstance(result, torch.Tensor):
        return result
    try:
        n = int(req.kv.kv_committed_len)
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[:n]
        seed = namespace_seed(*namespace_of(req)) if guard.config.tenant_isolation else 0
        slots = result.to(torch.int64)
        if slots.numel() != n or len(tokens) != n:  # a decode-side prefix: not modelled
            raise RuntimeError(f"transfer of {slots.numel()} slots for {n} positions")
        guard.on_transfer_issued(
            int(req.kv.req_pool_idx), slots, torch.tensor(tokens, dtype=torch.int64), seed
        )
    except Exception as exc:
        guard.internal_error("transfer", exc)
    return result


# -- DecodeTransferQueue._commit_transfer_to_req (AROUND) ------------------------------------------
def around_commit_transfer(original, queue, decode_req, *args, **kwargs):
    """The transfer landed on every rank: seal it, or abort the request (SGLang then streams the
    abort and releases it). A request SGLang aborted itself (a metadata mismatch) is left to it."""
    out = original(queue, decode_req, *args, **kwargs)
    guard, req = state.guard, decode_req.req
    if not state.on() or req.finished_reason is not None:
        return out
    if _is_fake_transfer(req):  # nothing was transferred: nothing to vouch for
        guard.transfers.forget(torch.tensor([int(req.kv.req_pool_idx)]))
        return out
    try:
        violation = guard.on_transfer_landed(int(req.kv.req_pool_idx), req, req.rid)
    except Exception as exc:
        guard.internal_error("transfer", exc)
        guard.fail_closed([req])
        return out
    if violation is None and os.environ.get(FLIP_ROOM) == str(req.bootstrap_room):
        _flip_one_byte(req)
    return out


def _is_fake_transfer(req) -> bool:
    from sglang.srt.disaggregation.utils import _is_fake_transfer as fake

    return bool(fake(req))


def _flip_one_byte(req) -> None:
    """Test switch: one bit of the request's KV at its middle position, first guarded buffer."""
    n = int(req.kv.kv_committed_len)
    table = state.scheduler.req_to_token_pool.req_to_token
    slot = int(table[int(req.kv.req_pool_idx), n // 2])
    buf = state.guard.checker.kv_buffers[0]
    row = buf[slot].view(torch.uint8).reshape(-1)
    row[0] ^= 0x10
    state.log.warning("kvguard_test_flip", request=req.rid, slot=slot, room=req.bootstrap_room)

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

On the prefill server the forwards are checked as a single server's; SGLang sends a request's KV
after its forward (``process_batch_result_disagg_prefill`` -> ``send_kv_chunk``) and releases
its pages only once the sender reports the transfer done (``process_disagg_prefill_inflight_queue``
-> ``release_kv_cache``), so the guard never sees a send from freed pages. With the last chunk
SGLang fills the request's first-token metadata row (``MetadataBuffers.set_buf``), which travels
after its KV; ``after_set_buf`` adds the sender's seal of the transferred positions
(``Guard.on_transfer_sent``) to that row's spare words, and ``around_commit_transfer`` on the
decode server hands it to the guard with the landed transfer: bytes changed in flight, sent from
other pages or for another request, or a transfer shorter than promised, abort the request
(``transfer_mismatch``).

The seal's wire format, in ``cached_tokens[idx]`` (16 int32, of which SGLang uses 0-6 and says
"slots 7-15 remain spare"): 7 a marker (``SEAL_MAGIC``, or ``SEAL_UNVOUCHED`` when the sender's
ledger could not vouch for the range), 8 the sender's ``layout_signature``, 9-10 the seal
(int64, little-endian words), 11 the number of positions it covers. A row without a marker
(a prefill server without kvguard, or with its guard off) is landed unsealed, said once in the
log; a row of another layout (other KV dtype, page size or TP shard) likewise.

Test switch: ``KVGUARD_TEST_PD_FLIP_ROOM=<bootstrap room>`` flips one byte of that request's KV
right after its transfer landed and was sealed (before its first read), as SGLang's
``SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB`` fakes a mismatch for its own checksum.
"""

from __future__ import annotations

import os

import torch

from kvguard.patches import pool_hooks, state
from kvguard.patches.tenancy import namespace_of, namespace_seed
from kvguard.transfers import layout_signature

FLIP_ROOM = "KVGUARD_TEST_PD_FLIP_ROOM"
# Test switch: flips one landed byte of that room's request before the decode server seals it,
# as a transfer corrupted in flight would land
FLIP_IN_FLIGHT_ROOM = "KVGUARD_TEST_PD_FLIP_IN_FLIGHT_ROOM"

SEAL_WORDS = slice(7, 12)
SEAL_MAGIC = 0x4B564731  # "KVG1"
SEAL_UNVOUCHED = 0x4B564730  # "KVG0"
_said: set[str] = set()


def _signature() -> int:
    sched = state.scheduler
    ps = int(sched.token_to_kv_pool_allocator.page_size)
    tp = (int(getattr(sched, "tp_rank", 0)), int(getattr(sched, "tp_size", 1)))
    return layout_signature(state.guard.checker.kv_buffers, ps, *tp)


def _say_once(event: str, **fields) -> None:
    if event not in _said:
        _said.add(event)
        state.log.warning(event, **fields)


# -- MetadataBuffers.set_buf (AFTER), prefill server ------------------------------------------------
def after_set_buf(result, buffers, req, *args, **kwargs):
    """The request's KV is all sent or on its way: its seal joins the metadata row that follows
    it. The positions are those ``_send_kv_chunk`` sends: [0, min(extend_end, prompt length))."""
    words = buffers.cached_tokens[req.metadata_buffer_index]
    if not state.on():  # SGLang reuses the row: no earlier request's seal may travel with this one
        words[SEAL_WORDS] = 0
        return result
    guard = state.guard
    try:
        n = len(req.origin_input_ids)
        n = min(int(getattr(req, "extend_end", n)), n)
        if int(getattr(req, "disagg_decode_prefix_len", 0) or 0):
            raise RuntimeError("a decode-side prefix is not modelled")
        table = state.scheduler.req_to_token_pool.req_to_token
        slots = table[int(req.kv.req_pool_idx), :n].to(torch.int64)
        seal = guard.on_transfer_sent(slots)
        vals = torch.zeros(5, dtype=torch.int32)
        vals[0] = SEAL_MAGIC if seal is not None else SEAL_UNVOUCHED
        vals[1] = _signature()
        vals[2:4] = torch.tensor([seal or 0], dtype=torch.int64).view(torch.int32)
        vals[4] = n
        words[SEAL_WORDS] = vals.to(words.device)
    except Exception as exc:
        guard.internal_error("transfer", exc)
        words[SEAL_WORDS] = torch.tensor(  # what it sends is not vouched for
            [SEAL_UNVOUCHED, _signature_or_zero(), 0, 0, -1], dtype=torch.int32
        ).to(words.device)
    return result


def _signature_or_zero() -> int:
    try:
        return _signature()
    except Exception:
        return 0


def _sent_seal(queue, decode_req) -> tuple[int | None, int | None]:
    """(seal, positions) from the landed metadata row; (None, None): no seal to compare with
    (the sender sent none, or one of another layout); (None, n): the sender could not vouch."""
    vals = queue.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index, SEAL_WORDS]
    vals = vals.to("cpu", torch.int32).clone()
    marker, signature, n = int(vals[0]), int(vals[1]), int(vals[4])
    if marker not in (SEAL_MAGIC, SEAL_UNVOUCHED):
        _say_once("kvguard_transfer_unsealed", why="the prefill server sent no kvguard seal")
        return None, None
    if signature != _signature():
        _say_once(
            "kvguard_transfer_unsealed",
            why="the prefill server's KV layout (buffers, dtype, page size, TP shard) or digest "
            "version differs",
        )
        return None, None
    if marker == SEAL_UNVOUCHED:
        return None, n
    return int(vals[2:4].contiguous().view(torch.int64)[0]), n


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
    """The transfer landed on every rank: seal it and compare it with the sender's seal, or abort
    the request (SGLang then streams the abort and releases it). A request SGLang aborted itself
    (a metadata mismatch) is left to it. The seal is read before SGLang frees the metadata row."""
    sent: tuple[int | None, int | None] = (None, None)
    if state.on() and not _is_fake_transfer(decode_req.req):  # a warm-up sends no metadata
        try:
            sent = _sent_seal(queue, decode_req)
        except Exception as exc:
            state.guard.internal_error("transfer", exc)
            sent = (None, -1)  # unreadable: not vouched for
    out = original(queue, decode_req, *args, **kwargs)
    guard, req = state.guard, decode_req.req
    if not state.on() or req.finished_reason is not None:
        return out
    if _is_fake_transfer(req):  # nothing was transferred: nothing to vouch for
        guard.transfers.forget(torch.tensor([int(req.kv.req_pool_idx)]))
        return out
    if os.environ.get(FLIP_IN_FLIGHT_ROOM) == str(req.bootstrap_room):
        _flip_one_byte(req)
    try:
        violation = guard.on_transfer_landed(int(req.kv.req_pool_idx), req, req.rid, *sent)
    except Exception as exc:
        guard.internal_error("transfer", exc)
        guard.fail_closed([req])
        return out
    if violation is None and os.environ.get(FLIP_ROOM) == str(req.bootstrap_room):
        _flip_one_byte(req)
    return out


# -- Req.offload_kv_cache (AFTER), decode server -------------------------------------------------------
def after_offload_kv_cache(result, req, req_to_token_pool, *args, **kwargs):
    """A retracted decode request's KV was copied to the host (the ``cpu_tensor`` retraction
    backup), before its pages are released: the guard's seal of those positions, [0, seqlen - 1),
    from its ledger (as for a send), stays with the request until the restore."""
    if not state.on():
        return result
    n = int(req.seqlen) - 1
    try:
        slots = req_to_token_pool.req_to_token[int(req.kv.req_pool_idx), :n].to(torch.int64)
        req.kvguard_backup_seal = (state.guard.on_transfer_sent(slots), n)
    except Exception as exc:
        state.guard.internal_error("transfer", exc)
        req.kvguard_backup_seal = (None, n)  # not vouched for: the restore aborts it
    return result


# -- disaggregation.decode.restore_kv_cache (AROUND) ----------------------------------------------------
def around_restore_kv_cache(original, req, *args, **kwargs):
    """The backup written back into the slots ``_pre_alloc`` claimed for the resumed request: a
    landing like a transfer's, compared with the seal taken at the backup. A backup without
    one (another backend, or taken while the guard was off) is not vouched for: the request
    is aborted (``transfer_mismatch``), never served unchecked."""
    seal, n = getattr(req, "kvguard_backup_seal", None) or (None, -1)
    req.kvguard_backup_seal = None
    out = original(req, *args, **kwargs)
    guard = state.guard
    if not state.on() or req.finished_reason is not None:
        return out
    try:
        guard.on_transfer_landed(int(req.kv.req_pool_idx), req, req.rid, seal, n)
    except Exception as exc:
        guard.internal_error("transfer", exc)
        guard.fail_closed([req])
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

"""Healing on SGLang: a request the guard sent back (``SGLangControl.recompute``) goes the way
SGLang's own retraction under memory pressure goes: KV released, request reset, re-queued with
its prompt and the tokens it produced, re-prefilled, decoded on.

What differs from SGLang's retraction, and why:
- the release is the guard's (``release_for_recompute``): by the ledger's truth, quarantined
  pages withheld, nothing inserted into the prefix cache;
- the step's output is dropped: the request is marked retracted before the result loop, which
  then neither commits nor streams its token (nor that of a step already in flight);
- it is re-queued only once no launched batch holds it any more (``before_next_batch``): under
  the overlap scheduler the next step was launched before this one's verdict was read, and a
  request re-prefilled before that step's result is processed would get its (dropped) token;
- its re-prefill never adopts a page the guard found bad: ``cache_hooks`` refuses prefix-cache
  hits through quarantined pages, which stay withheld until their last holder releases them.
"""

from __future__ import annotations

import time

from kvguard.patches import state
from kvguard.patches.control import release_aborted, release_by_ledger

AWAIT_LIMIT_S = 600.0  # a request sent back and never re-prefilled (dropped) is forgotten then


def pending_in(reqs) -> list:
    """The requests of this batch sent back to be recomputed (and not released yet)."""
    control = state.control
    if control is None or not control.recompute_pending:
        return []
    return [r for r in reqs if r in control.recompute_pending and r.kv.holds_kv]


def release_for_recompute(scheduler, req) -> None:
    """Release a request sent back by the ledger's truth, as ``control.release_aborted`` does an
    aborted one, then reset it as SGLang's retraction does. A chunked prefill in progress is
    released by ``before_next_batch`` instead (SGLang's scheduler still holds it)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    if req is getattr(scheduler, "chunked_req", None):
        return
    req.kvguard_recompute_t0 = time.monotonic()
    req.kvguard_recompute_out = len(req.output_ids)
    if req not in state.control.awaiting_token:
        state.control.awaiting_token.append(req)
    if req.kv.holds_kv:  # nothing checkpointed into the prefix cache
        release_by_ledger(
            scheduler, req, lambda r: release_kv_cache(r, scheduler.tree_cache, checkpoint=False)
        )
    req.reset_for_retract()


# -- Scheduler.get_next_batch_to_run (AROUND) ----------------------------------------------------------
def around_get_next_batch_to_run(original, scheduler, *args, **kwargs):
    if state.control is not None and state.control.recompute_pending:
        try:
            batches = dict(zip(("running_batch", "last_batch"), args))
            batches.update(kwargs)
            before_next_batch(scheduler, batches)
        except Exception as exc:  # not healed after all: aborted as they would have been
            state.guard.internal_error("recompute", exc)
            for req in list(state.control.recompute_pending):
                give_up(scheduler, req)
    return original(scheduler, *args, **kwargs)


def before_next_batch(scheduler, batches: dict) -> None:
    """Before SGLang builds the next batch: a chunked prefill sent back is released now (SGLang
    would otherwise checkpoint its chunk into the prefix cache and schedule the next one);
    requests sent back leave the running batch; those no launched batch holds any more go back
    to the waiting queue."""
    pending = state.control.recompute_pending
    if getattr(scheduler, "chunked_req", None) in pending:
        req = scheduler.chunked_req
        scheduler.chunked_req = None
        release_for_recompute(scheduler, req)
    for name in ("running_batch", "last_batch"):
        batch = batches.get(name, getattr(scheduler, name, None))
        if batch is not None and any(r in pending for r in batch.reqs):
            batch.filter_batch(reqs_to_exclude=[r for r in batch.reqs if r in pending])
    for req in [r for r in pending if r.finished()]:  # aborted meanwhile (client, fail-closed)
        pending.remove(req)
    in_flight = {id(r) for b, _ in getattr(scheduler, "result_queue", ()) for r in b.reqs}
    queued = {id(r) for r in scheduler.waiting_queue}
    ready = [r for r in pending if id(r) not in in_flight and not r.kv.holds_kv]
    for req in ready:
        pending.remove(req)
        if id(req) in queued:  # SGLang re-queued it itself (its own retraction)
            continue
        req.kvguard_recompute_tokens = len(req.origin_input_ids) + len(req.output_ids)
        scheduler._add_request_to_queue(req, is_retracted=True)
        state.guard.log(
            "info",
            "kvguard_request_requeued",
            request=req.rid,
            tokens=req.kvguard_recompute_tokens,
            recomputes=req.kvguard_recomputes,
        )


def account_recomputed() -> None:
    """After a batch's results: requests sent back whose re-prefill has produced their next
    token (or that finished otherwise) are counted, with the time it took."""
    guard, waiting = state.guard, state.control.awaiting_token
    now = time.monotonic()
    for req in list(waiting):
        if len(req.output_ids) <= req.kvguard_recompute_out and not req.finished():
            if now - req.kvguard_recompute_t0 > AWAIT_LIMIT_S:  # dropped while queued
                waiting.remove(req)
            continue
        waiting.remove(req)
        guard.metrics.recompute_seconds.inc(time.monotonic() - req.kvguard_recompute_t0)
        guard.metrics.tokens_recomputed.inc(getattr(req, "kvguard_recompute_tokens", 0))


def give_up(scheduler, req) -> None:
    """Healing a request failed half-way: abort it as the guard would have, and tell its client
    (it has left the result loop, so SGLang's own path for requests it ends outside the output
    stream is used)."""
    from http import HTTPStatus

    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import _make_abort_req

    control = state.control
    for waiting in (control.recompute_pending, control.awaiting_token):
        if req in waiting:
            waiting.remove(req)
    violation = req.kvguard_recompute
    violation.action = "abort"
    reason = FINISH_ABORT(
        violation.message, HTTPStatus.INTERNAL_SERVER_ERROR, "KVCacheIntegrityError"
    )
    req.is_retracted = False
    req.finished_reason = reason
    req.kvguard_violation = violation
    state.guard.log("error", "kvguard_recompute_failed", **violation.as_event())
    state.guard.metrics.requests_aborted.inc()
    try:
        if req.kv.holds_kv:
            release_aborted(scheduler, req)
    except Exception as exc:  # its pages stay held (a leak the idle repair finds), no more
        state.guard.internal_error("release", exc)
    req.kvguard_released = True
    scheduler.send_abort_output(_make_abort_req(req, finished_reason=reason.to_json()), req)

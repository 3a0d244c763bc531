"""Hooks around the forward: check before it, seal after it, read the verdict at the sync that
follows it and abort bad requests before their token is emitted. A guard failure costs the
batch's requests (aborted, never served unchecked), never the scheduler."""

from __future__ import annotations

import structlog
import torch

from kvguard.guard import clock
from kvguard.patches import state
from kvguard.patches.adapter import step_view
from kvguard.patches.control import release_aborted

log = structlog.get_logger("kvguard")


# -- TpModelWorker.forward_batch_generation (AROUND) ---------------------------------------------------
def around_worker_forward(original, worker, batch=None, *args, **kwargs):
    if not state.on():
        return original(worker, batch, *args, **kwargs)
    state.local.batch, state.local.verdict = batch, None
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        verdict, state.local.batch, state.local.verdict = state.local.verdict, None, None
    if verdict is not None:
        result.kvguard_verdict = verdict
    return result


# -- ModelRunner.forward (AROUND) -----------------------------------------------------------------------
def around_model_forward(original, runner, forward_batch, *args, **kwargs):
    batch = getattr(state.local, "batch", None)
    if state.mode_file is not None:
        state.reload_mode()
    guard = state.guard
    if guard is None or not guard.active:
        return original(runner, forward_batch, *args, **kwargs)
    view = verdict = None
    if batch is None:
        _count_unchecked(forward_batch)  # a forward outside the scheduler's batch path
    else:
        try:
            t0 = clock()
            view = step_view(forward_batch, batch, runner.forward_pass_id + 1)
            if view is not None:
                verdict = guard.before_forward(view, t0)  # counts the view's building too
            else:
                guard.charge(t0)
                _count_unchecked(forward_batch)
        except Exception:  # a guard bug must cost the batch's requests, never the scheduler
            log.exception("kvguard_check_failed")
            verdict = GUARD_FAILED
            # Unchecked writes must not land either: the whole batch writes to the padding slot
            # (its requests are aborted at resolve), so nobody else's KV can change.
            forward_batch.out_cache_loc.fill_(0)
        state.local.verdict = verdict
    out = original(runner, forward_batch, *args, **kwargs)
    if verdict is not None and verdict is not GUARD_FAILED:
        try:
            guard.after_forward(verdict)
        except Exception:
            log.exception("kvguard_seal_failed")
            state.local.verdict = GUARD_FAILED
    return out


GUARD_FAILED = object()  # the verdict of a step the guard could not check: abort its requests


def _count_unchecked(forward_batch) -> None:
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is not None and mode.is_idle():
        return  # no model forward over KV
    state.guard.metrics.unchecked_forwards.inc()
    log.warning("kvguard_unchecked_forward", mode=str(mode))


# -- Scheduler.process_batch_result (AROUND) ------------------------------------------------------------
def around_process_batch_result(original, scheduler, batch, result, *args, **kwargs):
    verdict = getattr(result, "kvguard_verdict", None)
    guard = state.guard
    if guard is None or verdict is None:
        return original(scheduler, batch, result, *args, **kwargs)
    copy_done = getattr(result, "copy_done", None)
    if copy_done is not None:
        copy_done.synchronize()  # the sync SGLang does first thing anyway
    agree = _tp_agreement(scheduler)
    handles = list(batch.reqs)
    try:
        if verdict is GUARD_FAILED:
            guard.resolve_failed(handles, agree)
        else:
            guard.resolve(verdict, handles=handles, agree=agree)
    except Exception:  # the verdict could not be read: serve nothing unchecked from this step
        log.exception("kvguard_resolve_failed", step=guard.step)
        from kvguard.verdict import Kind, Violation, new_violation_id

        for req in batch.reqs:
            guard.actions.engine.abort(
                req, Violation(new_violation_id(), Kind.GUARD_ERROR, guard.step, req.rid, None)
            )
    aborted = [
        r
        for r in batch.reqs
        if getattr(r, "kvguard_violation", None) is not None
        and not getattr(r, "kvguard_released", False)
    ]
    if not aborted:
        return original(scheduler, batch, result, *args, **kwargs)
    # Finished requests are skipped by the result loop under overlap semantics: their token of
    # this step is never appended nor streamed. Apply those semantics for this one call.
    proc = scheduler.batch_result_processor
    saved = proc.enable_overlap
    object.__setattr__(proc, "enable_overlap", True)  # a frozen dataclass; restored below
    try:
        out = original(scheduler, batch, result, *args, **kwargs)
    finally:
        object.__setattr__(proc, "enable_overlap", saved)
    for req in aborted:
        release_aborted(scheduler, req)
    return out


def _tp_agreement(scheduler):
    """Bitwise-OR the verdict over the tensor-parallel ranks (one small CPU all-reduce per step,
    only when tp_size > 1), so every rank aborts the same requests and the ranks never diverge."""
    group = getattr(scheduler, "tp_cpu_group", None)
    if getattr(scheduler, "tp_size", 1) <= 1 or group is None:
        return None

    def agree(summary: torch.Tensor) -> torch.Tensor:
        out = summary.cpu().clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.BOR, group=group)
        return out

    return agree

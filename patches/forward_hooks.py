"""Hooks around the forward: check before it, seal after it, read the verdict at the sync that
follows it and abort or recompute bad requests before their token is emitted. A guard failure costs the
batch's requests (aborted, never served unchecked), never the scheduler."""

from __future__ import annotations

from kvguard.guard import clock
from kvguard.patches import kv_read, kv_write, recompute, state
from kvguard.patches.adapter import step_view
from kvguard.patches.control import release_aborted


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
    verdict = None
    try:
        t0 = clock()
        view = (
            None if batch is None else step_view(forward_batch, batch, runner.forward_pass_id + 1)
        )
        if view is not None:
            verdict = guard.before_forward(view, t0)  # counts the view's building too
        else:
            guard.charge(t0)
            if _reads_kv(forward_batch):
                # A forward the guard does not model (it did not come through the scheduler's
                # batch path, or its mode is unknown): it fails closed like a failed check.
                guard.metrics.unchecked_forwards.inc()
                raise UncheckedForward(f"unchecked forward ({forward_batch.forward_mode})")
    except Exception as exc:  # a guard failure costs the batch's requests, never the scheduler
        guard.internal_error("check", exc)
        verdict = GUARD_FAILED
        # Unchecked writes must not land either: the whole batch writes to the padding slot
        # (its requests are aborted at resolve), so nobody else's KV can change.
        if forward_batch.out_cache_loc is not None:
            forward_batch.out_cache_loc.fill_(0)
    if batch is not None:
        state.local.verdict = verdict
    kv_read.clear_record()
    kv_write.begin(guard if verdict is not None and verdict is not GUARD_FAILED else None,
                   forward_batch)  # fmt: skip
    out = original(runner, forward_batch, *args, **kwargs)
    if verdict is not None and verdict is not GUARD_FAILED:
        try:
            # what the stores were handed (kv_write): the digests the seal takes; then what
            # attention read, hashed as it read it (kv_read), judged against them before any
            # token of this forward leaves; a forward whose stores or read were not hashed
            # fails closed there
            written = kv_write.take_sums() if guard.digests_writes else None
            read = kv_read.take_sums() if guard.verifies_reads else None
            guard.after_forward(verdict, read, written)
        except Exception as exc:
            guard.internal_error("seal", exc)
            verdict.seal_failed = True  # resolve fails it closed (or at the tokens' next read)
    return out


GUARD_FAILED = object()  # the verdict of a step the guard could not check: abort its requests


class UncheckedForward(RuntimeError):
    """A forward over KV reached the model without a step view the guard could check."""


def _reads_kv(forward_batch) -> bool:
    mode = getattr(forward_batch, "forward_mode", None)
    return mode is None or not mode.is_idle()


# -- Scheduler.process_batch_result (AROUND) ------------------------------------------------------------
def around_process_batch_result(original, scheduler, batch, result, *args, **kwargs):
    verdict = getattr(result, "kvguard_verdict", None)
    guard = state.guard
    if guard is None or verdict is None:
        return original(scheduler, batch, result, *args, **kwargs)
    copy_done = getattr(result, "copy_done", None)
    if copy_done is not None:
        copy_done.synchronize()  # the sync SGLang does first thing anyway
    handles = list(batch.reqs)
    # resolve contains its own failures (and still joins the ranks' agreement): what it cannot
    # judge it aborts; the scheduler goes on.
    try:
        guard.resolve(None if verdict is GUARD_FAILED else verdict, handles)
    except Exception as exc:  # beyond what resolve contains itself: fail the batch closed
        guard.internal_error("resolve", exc)
        guard.fail_closed(handles)
    aborted = [
        r
        for r in batch.reqs
        if getattr(r, "kvguard_violation", None) is not None
        and not getattr(r, "kvguard_released", False)
    ]
    sent_back = recompute.pending_in(batch.reqs)  # healed: recomputed, not aborted
    if not (aborted or sent_back):
        out = original(scheduler, batch, result, *args, **kwargs)
        if state.control is not None and state.control.awaiting_token:
            recompute.account_recomputed()
        return out
    # Finished and retracted requests are skipped by the result loop under overlap semantics:
    # their token of this step is never appended nor streamed. Apply those semantics for this
    # one call.
    proc = scheduler.batch_result_processor
    saved = proc.enable_overlap
    object.__setattr__(proc, "enable_overlap", True)  # a frozen dataclass; restored below
    try:
        out = original(scheduler, batch, result, *args, **kwargs)
    finally:
        object.__setattr__(proc, "enable_overlap", saved)
    for req in aborted:
        try:
            release_aborted(scheduler, req)
        except Exception as exc:  # its pages stay held (a leak the idle repair finds), no more
            guard.internal_error("release", exc)
    for req in sent_back:
        try:
            recompute.release_for_recompute(scheduler, req)
        except Exception as exc:  # not healed after all: aborted as it would have been
            guard.internal_error("recompute", exc)
            recompute.give_up(scheduler, req)
    if state.control.awaiting_token:
        recompute.account_recomputed()
    return out

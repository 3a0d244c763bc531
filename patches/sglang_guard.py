"""kvguard inside SGLang's scheduler: builds the engine-agnostic StepView from SGLang's batches,
and carries out the guard's actions (abort one request, withhold quarantined pages).

The hook functions here are named in ``targets.py``. They run in every scheduler process (the
plugin loads there). A guard failure must never take the scheduler down: hooks that only observe
catch their own errors, log them, and let SGLang proceed; a request whose verdict cannot be
computed is aborted rather than served unchecked.
"""

from __future__ import annotations

import os
import threading
from array import array
from http import HTTPStatus

import structlog
import torch

from kvguard.config import GuardConfig
from kvguard.guard import Guard
from kvguard.step import StepView

log = structlog.get_logger("kvguard")

_local = threading.local()  # the ScheduleBatch of the forward in flight on this thread
_guard: Guard | None = None  # one per scheduler process
_scheduler = None
# Benchmarks only: a file whose content ("off", "tags", ...) switches the mode between steps.
_mode_file = os.environ.get("KVGUARD_MODE_FILE")
_mode_mtime = None


def _reload_mode():
    global _mode_mtime
    try:
        mtime = os.stat(_mode_file).st_mtime_ns
        if mtime != _mode_mtime and _guard is not None:
            _mode_mtime = mtime
            with open(_mode_file) as f:
                _guard.set_mode(f.read().strip())
            log.info("kvguard_mode_switched", mode=_guard.config.mode.value)
    except (OSError, ValueError):
        pass


def active_guard() -> Guard | None:
    return _guard


def _single_rank() -> bool:
    """Host-side decisions from a rank's own unread verdict are only safe without tensor
    parallelism: ranks' checksum verdicts differ until they are OR-reduced at resolve."""
    return _scheduler is not None and getattr(_scheduler, "tp_size", 1) == 1


def _on() -> bool:
    """A guard is attached and checking (a benchmark may switch it to ``off`` at run time: then
    every hook is inert, and the ledger is reset by the pool flush that precedes the next mode)."""
    return _guard is not None and _guard.active


class SGLangControl:
    """EngineControl for SGLang: what the guard's action layer may do to the engine."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def abort(self, req, violation):
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if req.finished():
            return  # already finished and released: nothing of it is served again
        reason = FINISH_ABORT(violation.message, HTTPStatus.INTERNAL_SERVER_ERROR, "KVCacheIntegrityError")
        req.skip_radix_cache_insert = True  # suspect KV never enters the prefix cache
        req.kvguard_violation = violation
        sched = self.scheduler
        if req is getattr(sched, "chunked_req", None):
            # Mid chunked prefill: SGLang's own deferred path tears it down at the top of the
            # next step (release without checkpoint, abort sent to the client).
            req.discard_output_reason = reason
            req.kvguard_released = True
            sched._pending_chunked_abort_req = req
            return
        req.finished_reason = reason

    def withhold_pages(self, pages: torch.Tensor) -> int:
        alloc = self.scheduler.token_to_kv_pool_allocator
        removed = 0
        for name in ("free_pages", "release_pages"):
            free = getattr(alloc, name, None)
            if isinstance(free, torch.Tensor) and free.numel():
                hit = torch.isin(free, pages.to(free.device))
                removed += int(hit.sum())
                setattr(alloc, name, free[~hit])
        staged = getattr(alloc, "staged_pages", None)
        if staged:
            hits = [torch.isin(p, pages.to(p.device)) for p in staged]
            removed += sum(int(h.sum()) for h in hits)
            alloc.staged_pages = [p[~h] for p, h in zip(staged, hits)]
            alloc.num_staged_pages = sum(p.numel() for p in alloc.staged_pages)
        return removed

    def rebuild_free_list(self) -> int:
        """Fully idle, after contained violations: the engine bug may have left a page both free
        and cached, or twice in the free list, or leaked. With no request running, a page is free
        iff the prefix tree does not hold it and the guard has not quarantined it. Returns the
        change in free pages."""
        from kvguard.ledger import PageState

        sched, L = self.scheduler, _guard.ledger
        alloc = sched.token_to_kv_pool_allocator
        ps = alloc.page_size
        n = alloc.num_pages if ps > 1 else alloc.size
        held = torch.zeros(n + 1, dtype=torch.bool, device=L.device)
        held[0] = True  # SGLang's padding page
        tree = sched.tree_cache
        if tree.evictable_size() or tree.protected_size():
            held[torch.div(tree.all_values_flatten().to(L.device, torch.int64), ps, rounding_mode="floor")] = True
        quarantined = L.state[: n + 1] == PageState.QUARANTINED
        free = torch.nonzero(~held & ~quarantined).reshape(-1)
        before = alloc.available_size() // ps
        newly = free[L.state[free] != PageState.FREE]
        L.release(newly, _guard.step)
        alloc.free_pages = free.to(alloc.device)
        if hasattr(alloc, "release_pages"):
            alloc.release_pages = free[:0].to(alloc.device)
        if getattr(alloc, "staged_pages", None):
            alloc.staged_pages, alloc.num_staged_pages = [], 0
        L.num_quarantined = int((quarantined & ~held).sum())
        return int(free.numel()) - before


# -- Scheduler.__init__ (AFTER) -------------------------------------------------------------------------
def attach(result, scheduler, *args, **kwargs):
    global _guard, _scheduler
    config = GuardConfig.from_env()
    if not config.enabled:
        return result
    runner = scheduler.tp_worker.model_runner
    kv = runner.token_to_kv_pool
    k_buf, v_buf = getattr(kv, "k_buffer", None), getattr(kv, "v_buffer", None)
    if not isinstance(k_buf, list) or not isinstance(v_buf, list):
        raise RuntimeError(
            f"kvguard supports MHA KV pools with per-layer K/V buffers; got {type(kv).__name__}"
        )
    buffers = [b for pair in zip(k_buf, v_buf) for b in pair]
    table = scheduler.req_to_token_pool.req_to_token
    _guard = Guard(
        config,
        num_slots=buffers[0].shape[0],
        page_size=scheduler.token_to_kv_pool_allocator.page_size,
        num_rows=table.shape[0],
        max_len=table.shape[1],
        kv_buffers=buffers,
        device=table.device,
        engine=SGLangControl(scheduler),
    )
    _scheduler = scheduler
    log.info("kvguard_attached", mode=config.mode.value, pid=__import__("os").getpid(),
             slots=buffers[0].shape[0], page_size=_guard.ledger.page_size, layers=len(k_buf))
    return result


# -- TpModelWorker.forward_batch_generation (AROUND) ---------------------------------------------------
def around_worker_forward(original, worker, batch=None, *args, **kwargs):
    if not _on():
        return original(worker, batch, *args, **kwargs)
    _local.batch, _local.verdict = batch, None
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        verdict, _local.batch, _local.verdict = _local.verdict, None, None
    if verdict is not None:
        result.kvguard_verdict = verdict
    return result


# -- ModelRunner.forward (AROUND) -----------------------------------------------------------------------
def around_model_forward(original, runner, forward_batch, *args, **kwargs):
    batch = getattr(_local, "batch", None)
    if _mode_file is not None:
        _reload_mode()
    if _guard is None or batch is None or not _guard.active:
        return original(runner, forward_batch, *args, **kwargs)
    try:
        view = step_view(forward_batch, batch, runner.forward_pass_id + 1)
        if view is not None:
            _local.verdict = _guard.before_forward(view)
    except Exception:  # a guard bug must cost the batch's requests, never the scheduler
        log.exception("kvguard_check_failed")
        view, _local.verdict = None, failed_verdict(batch)
    out = original(runner, forward_batch, *args, **kwargs)
    if view is not None:
        try:
            _guard.after_forward(view)
        except Exception:
            log.exception("kvguard_seal_failed")
            _local.verdict = failed_verdict(batch)
    return out


def failed_verdict(batch):
    """A verdict that aborts every request of the batch: what cannot be checked is not served."""
    from kvguard.checker import StepVerdict
    from kvguard.verdict import Kind

    n = len(batch.reqs)
    dev = _guard.ledger.device
    rows = torch.zeros(n, dtype=torch.int64, device=dev)
    view = StepView(step=_guard.step, rows=rows, prefix_lens=rows, max_prefix_len=0,
                    write_slots=rows[:0], write_batch=rows[:0], write_pos=rows[:0],
                    write_tokens=rows[:0], page_table=_scheduler.req_to_token_pool.req_to_token,
                    request_ids=[r.rid for r in batch.reqs])
    kinds = torch.full((n,), int(Kind.GUARD_ERROR), dtype=torch.int64, device=dev)
    return StepVerdict(view=view, kinds=kinds, taint=torch.zeros(_guard.ledger.num_pages, dtype=torch.bool, device=dev))


def step_view(fb, batch, step: int) -> StepView | None:
    """SGLang ForwardBatch -> StepView. None for batches the guard does not model (idle, spec)."""
    mode = fb.forward_mode
    rows = fb.req_pool_indices.to(torch.int64)
    if mode.is_decode():
        prefix = fb.seq_lens.to(torch.int64) - 1
        max_prefix = int(fb.seq_lens_cpu.max()) - 1 if fb.seq_lens_cpu is not None else int(prefix.max())
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
        prefix_tokens = torch.frombuffer(tokens, dtype=torch.int64) if tokens else torch.empty(0, dtype=torch.int64)
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
        page_table=_scheduler.req_to_token_pool.req_to_token,
        prefix_tokens=prefix_tokens,
        request_ids=[req.rid for req in batch.reqs],
    )


# -- Scheduler.process_batch_result (AROUND) ------------------------------------------------------------
def around_process_batch_result(original, scheduler, batch, result, *args, **kwargs):
    verdict = getattr(result, "kvguard_verdict", None)
    if _guard is None or verdict is None:
        return original(scheduler, batch, result, *args, **kwargs)
    copy_done = getattr(result, "copy_done", None)
    if copy_done is not None:
        copy_done.synchronize()  # the sync SGLang does first thing anyway
    try:
        _guard.resolve(verdict, handles=list(batch.reqs), agree=_tp_agreement(scheduler))
    except Exception:  # the verdict could not be read: serve nothing unchecked from this step
        log.exception("kvguard_resolve_failed", step=verdict.view.step)
        control = _guard.actions.engine
        from kvguard.verdict import Kind, Violation, new_violation_id

        for req in batch.reqs:
            control.abort(req, Violation(new_violation_id(), Kind.GUARD_ERROR, verdict.view.step, req.rid, None))
    aborted = [r for r in batch.reqs if getattr(r, "kvguard_violation", None) is not None
               and not getattr(r, "kvguard_released", False)]
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


def release_aborted(scheduler, req):
    """Release an aborted request by the ledger's truth, not only its (possibly corrupt) row:
    SGLang's release frees only pages the request privately owns; pages displaced from its row
    are freed too; pages found bad stay quarantined."""
    req.kvguard_released = True
    if not req.kv.holds_kv:
        return
    row = int(req.kv.req_pool_idx)
    _guard.releasing_row = row
    try:
        own = _guard.private_pages(row)
        scheduler.batch_result_processor._handle_sampling_mask_abort(req)  # "release, do not commit"
        left = own[_guard.ledger.state[own] == 1]  # still OWNED: displaced from the row
        left = left[_guard.ledger.owner_row[left] == row]
        if left.numel():
            scheduler.token_to_kv_pool_allocator.free_page_ids(left.to(torch.int64))
    finally:
        _guard.releasing_row = None


# -- allocator frees (AROUND) -----------------------------------------------------------------------------
def around_release_pages(original, allocator, *page_ids):
    if not _on() or not page_ids:
        return original(allocator, *page_ids)
    return original(allocator, *[_guard.on_release(p) for p in page_ids])


def around_token_free(original, allocator, free_index):
    if not _on() or free_index.numel() == 0 or allocator.free_group is not None:
        return original(allocator, free_index)  # grouped frees come back here ungrouped
    return original(allocator, _guard.on_release(free_index))


# -- allocator allocations and clears (AFTER) --------------------------------------------------------------------
def on_slots_allocated(result, allocator, *args, **kwargs):
    if _on() and isinstance(result, torch.Tensor) and result.numel():
        _guard.on_alloc(result)
    return result


def on_pool_cleared(result, allocator, *args, **kwargs):
    if _mode_file is not None:
        _reload_mode()  # benchmarks switch modes between a flush and the next round
    if _guard is not None:
        _guard.reset()
    return result


# -- UnifiedRadixCache.checkpoint_into_tree (AROUND) ---------------------------------------------------------
def around_checkpoint_into_tree(original, cache, req, *args, **kwargs):
    if not _on() or not req.kv.holds_kv:
        return original(cache, req, *args, **kwargs)
    row = int(req.kv.req_pool_idx)
    if _single_rank() and "up_to" in kwargs and _guard.suspect_before_resolve(req.rid):
        # Flagged by a step whose verdict is not read yet (it aborts this request next): what it
        # computed stays out of the prefix cache. Inserting only the part the tree already
        # holds keeps SGLang's own bookkeeping (locks, release of the rest) on its usual path.
        log.warning("kvguard_tree_insert_skipped", request=req.rid, reason="flagged")
        kwargs["up_to"] = min(kwargs["up_to"], req.kv.cache_protected_len)
        return original(cache, req, *args, **kwargs)
    if _guard.actions.num_quarantined_total and _insert_meets_quarantine(cache, req, kwargs.get("up_to")):
        # The tree would swap this request's pages for its own copies, quarantined ones among
        # them: keep the request on its own pages (as if barred from the tree this once).
        log.warning("kvguard_tree_insert_skipped", request=req.rid)
        return None
    out = original(cache, req, *args, **kwargs)
    shared = req.kv.cache_protected_len if req.kv.holds_kv else kwargs.get("up_to", 0)
    if shared:
        _guard.on_share(_scheduler.req_to_token_pool.req_to_token[row, :shared])
    return out


def _insert_meets_quarantine(cache, req, up_to) -> bool:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key

    tokens = req.full_untruncated_fill_ids[: up_to if up_to is not None else len(req.full_untruncated_fill_ids)]
    result = cache._match_tree(MatchPrefixParams(key=_req_radix_key(cache, req, tokens)))
    if not result.device_prefix_len:
        return False
    slots = cache.path_device_indices(result.last_device_node)[: result.device_prefix_len]
    return _guard.holds_quarantined(slots)


# -- Scheduler.on_idle (AFTER) ------------------------------------------------------------------------------
def flush_when_idle(result, scheduler, *args, **kwargs):
    """Once idle after a quarantine, flush the prefix cache so suspect nodes leave it."""
    if _guard is not None and _guard.flush_wanted and scheduler.flush_cache():
        log.info("kvguard_prefix_cache_flushed")
        _guard.flush_wanted = False
    return result


# -- UnifiedRadixCache.match_prefix (AROUND) ---------------------------------------------------------------
def around_match_prefix(original, cache, params, *args, **kwargs):
    """Refuse a prefix-cache hit that runs through a quarantined page: the request prefills from
    scratch instead of being aborted, and the bad node ages out of the tree unused (its pages are
    withheld when the tree finally frees them)."""
    result = original(cache, params, *args, **kwargs)
    if not _on() or not result.device_prefix_len:
        return result
    quarantine = bool(_guard.actions.num_quarantined_total)
    pending = _single_rank() and _guard.unread_taint()  # pages found bad by a verdict not read yet
    if not (quarantine or pending):
        return result
    slots = cache.path_device_indices(result.last_device_node)[: result.device_prefix_len]
    if not ((quarantine and _guard.holds_quarantined(slots))
            or (pending and _guard.suspect_before_resolve(slots=slots))):
        return result
    from sglang.srt.mem_cache.base_prefix_cache import zero_match_result

    req = getattr(params, "req", None)
    log.warning("kvguard_prefix_hit_refused", request=getattr(req, "rid", None),
                prefix_len=result.device_prefix_len)
    miss = zero_match_result(cache, result, extra_key=getattr(req, "extra_key", None))
    # zero_match_result keeps the walk's cache_protected_len; a miss protects nothing, else the
    # request would later treat its own freshly computed prefix as the tree's.
    return miss._replace(cache_protected_len=0) if miss.cache_protected_len is not None else miss


# -- ReqToTokenPool.alloc_rows (AFTER) ---------------------------------------------------------------------
def on_rows_allocated(result, pool, *args, **kwargs):
    if _guard is not None and result:
        _guard.on_rows_allocated(torch.tensor(result, dtype=torch.int64, device=_guard.ledger.device))
    return result


# -- SchedulerInvariantChecker._report_leak / _check_kv_page_invariants (AROUND) ---------------------------------
def around_memory_check(original, checker, *args, **kwargs):
    """After kvguard contained engine bugs (aborted their victims, withheld their pages), SGLang's
    idle memory check can still see their footprint (a page both freed and cached). Stopping the
    scheduler then would drop every in-flight request: report it instead, with the guard's count."""
    try:
        return original(checker, *args, **kwargs)
    except ValueError as exc:
        if _guard is None or not _guard.actions.num_violations:
            raise
        repaired = None
        if _scheduler is not None and _scheduler.is_fully_idle():
            repaired = SGLangControl(_scheduler).rebuild_free_list()
        log.warning("kvguard_engine_memory_check_after_violations", error=str(exc),
                    violations=_guard.actions.num_violations, free_pages_rebuilt=repaired)


# -- SchedulerPoolStatsObserver._get_token_info (AROUND) ----------------------------------------------
def around_token_info(original, observer, *args, **kwargs):
    """An engine bug the guard contained (a page both free and cached) can make SGLang's used-token
    count negative until the next idle repair; its usage assertion would then stop the scheduler
    mid-serving. Report zero usage instead, only after violations."""
    stats = original(observer, *args, **kwargs)
    if stats.full_num_used < 0 and _guard is not None and _guard.actions.num_violations:
        import dataclasses

        log.warning("kvguard_pool_overcounted", used=stats.full_num_used)
        return dataclasses.replace(stats, full_num_used=0, full_token_usage=0.0)
    return stats


# -- SchedulerInvariantChecker._check_pool_invariant (AROUND) -------------------------------------------------
def around_pool_invariant(original, pool_name, available, *args, **kwargs):
    if _guard is not None and pool_name == "full":
        available += _guard.num_quarantined_slots  # withheld by the guard, not leaked
    return original(pool_name, available, *args, **kwargs)

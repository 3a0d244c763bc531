"""The guard's life in a scheduler process: built once the scheduler's pools exist, reset when the
pool is flushed, and the prefix cache flushed at the next idle moment after a quarantine."""

from __future__ import annotations

import structlog

from kvguard.config import GuardConfig
from kvguard.guard import Guard
from kvguard.patches import state
from kvguard.patches.adapter import UnsupportedPoolError, guarded_kv_buffers
from kvguard.patches.control import SGLangControl

log = structlog.get_logger("kvguard")


# -- Scheduler.__init__ (AFTER) -------------------------------------------------------------------------
def attach(result, scheduler, *args, **kwargs):
    config = GuardConfig.from_env()
    if not config.enabled:
        return result
    kv = scheduler.tp_worker.model_runner.token_to_kv_pool
    try:
        kind, buffers = guarded_kv_buffers(kv)
    except UnsupportedPoolError as exc:
        # One line, and the scheduler stops: SystemExit is not caught (and printed as a
        # traceback) by SGLang's scheduler loop, and nothing is ever served unchecked.
        log.error("kvguard_unsupported_pool", pool=type(kv).__name__, error=str(exc))
        raise SystemExit(f"kvguard-serve: error: {exc}") from None
    spec = getattr(scheduler, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        # Draft and verify forwards write and free KV outside the paths the guard models: refuse
        # rather than serve them unchecked.
        log.error("kvguard_unsupported_speculative_decoding", algorithm=str(spec))
        raise SystemExit(
            f"kvguard-serve: error: kvguard does not guard speculative decoding ({spec}); "
            "serve without --speculative-algorithm, or with --kvguard-mode off"
        )
    table = scheduler.req_to_token_pool.req_to_token
    state.guard = Guard(
        config,
        num_slots=buffers[0].shape[0],
        page_size=scheduler.token_to_kv_pool_allocator.page_size,
        num_rows=table.shape[0],
        kv_buffers=buffers,
        device=table.device,
        engine=SGLangControl(scheduler),
        agreed=getattr(scheduler, "tp_size", 1) > 1,
    )
    state.scheduler = scheduler
    log.info(
        "kvguard_attached",
        mode=config.mode.value,
        pid=__import__("os").getpid(),
        slots=buffers[0].shape[0],
        page_size=state.guard.ledger.page_size,
        pool=kind,
        buffers=len(buffers),
        kernels=state.guard.kernels.name,
        state_bytes=state.guard.state_bytes,
    )
    return result


def on_pool_cleared(result, allocator, *args, **kwargs):
    if state.mode_file is not None:
        state.reload_mode()  # benchmarks switch modes between a flush and the next round
    if state.guard is not None:
        state.guard.reset()
    return result


# -- Scheduler.on_idle (AFTER) ------------------------------------------------------------------------------
def flush_when_idle(result, scheduler, *args, **kwargs):
    """Once idle: the guard's counters reach /metrics, and after a quarantine the prefix cache is
    flushed so suspect nodes leave it."""
    if state.guard is not None:
        state.guard.flush_metrics()
    if state.guard is not None and state.guard.flush_wanted and scheduler.flush_cache():
        log.info("kvguard_prefix_cache_flushed")
        state.guard.flush_wanted = False
    return result

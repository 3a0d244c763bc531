"""The guard's life in a scheduler process: built once the scheduler's pools exist, reset when the
pool is flushed, and the prefix cache flushed at the next idle moment after a quarantine."""

from __future__ import annotations

import os

import structlog

from kvguard.config import GuardConfig, ReadPath
from kvguard.guard import Guard
from kvguard.patches import state
from kvguard.patches.adapter import UnsupportedPoolError, guarded_kv_buffers
from kvguard.patches.control import SGLangControl
from kvguard.patches.health_endpoint import publish
from kvguard.patches.kv_read import read_path_unavailable
from kvguard.patches.peers import scheduler_peers

log = structlog.get_logger("kvguard")
# Test switch: the attention read is not hashed, as on a GPU pool or another attention backend,
# so that a CPU engine serves the fallback read path (every read checked before the forward)
PRE_FORWARD_READS = "KVGUARD_TEST_PRE_FORWARD_READS"


def _read_path_unavailable(model_runner) -> str | None:
    if os.environ.get(PRE_FORWARD_READS) == "1":
        return f"test switch {PRE_FORWARD_READS}"
    return read_path_unavailable(model_runner)


# -- Scheduler.__init__ (AFTER) -------------------------------------------------------------------------
def attach(result, scheduler, *args, **kwargs):
    config = GuardConfig.from_env()
    if not config.enabled:
        return result
    if not getattr(scheduler, "is_generation", True):
        # An embedding model's forwards come through another worker path the guard does not
        # check: refused, never served unchecked.
        log.error("kvguard_unsupported_model", reason="embedding model")
        raise SystemExit(
            "kvguard-serve: error: kvguard guards generation models only (this one is an "
            "embedding model); serve it with --kvguard-mode off"
        )
    kv = scheduler.tp_worker.model_runner.token_to_kv_pool
    try:
        kind, buffers = guarded_kv_buffers(kv)
    except UnsupportedPoolError as exc:
        # One line, and the scheduler stops: SystemExit is not caught (and printed as a
        # traceback) by SGLang's scheduler loop, and nothing is ever served unchecked.
        log.error("kvguard_unsupported_pool", pool=type(kv).__name__, error=str(exc))
        raise SystemExit(f"kvguard-serve: error: {exc}") from None
    table = scheduler.req_to_token_pool.req_to_token
    state.control = SGLangControl(scheduler)
    state.guard = Guard(
        config,
        num_slots=buffers[0].shape[0],
        page_size=scheduler.token_to_kv_pool_allocator.page_size,
        num_rows=table.shape[0],
        kv_buffers=buffers,
        device=table.device,
        engine=state.control,
        peers=scheduler_peers(scheduler),
    )
    state.scheduler = scheduler
    runner = scheduler.tp_worker.model_runner
    # Writers' digests where kvguard's store hooks see every store: torch_native (and the CPU DSA
    # path) store through the pool's set_kv_buffer. Another backend may write KV itself (SGLang's
    # intel_amx decode writes BF16 KV inside its kernel): there the seal hashes the pool instead,
    # or every step would fail closed on undigested stores.
    if state.guard.device.type == "cpu" and read_path_unavailable(runner) is None:
        state.guard.enable_write_path()
    why_not = _read_path_unavailable(runner)
    if why_not is None:  # hashed as attention reads, whenever the mode (even switched) asks
        state.guard.enable_read_path()
    elif state.guard.read_path is ReadPath.PRE_FORWARD_CHECK:
        # still verified, at the cost of a full pre-forward check; and a flagged request that
        # already emitted tokens is aborted, not healed (kvguard.healing)
        log.warning("kvguard_reads_verified_before_forward", reason=why_not)
    state.guard.health.listeners.append(publish)
    publish(None)
    log.info(
        "kvguard_attached",
        mode=config.mode.value,
        on_violation=config.on_violation.value,
        pid=__import__("os").getpid(),
        slots=buffers[0].shape[0],
        page_size=state.guard.ledger.page_size,
        pool=kind,
        buffers=len(buffers),
        kernels=state.guard.kernels.name,
        read_path=state.guard.read_path.value,
        writer_digests=state.guard.write_path,
        state_bytes=state.guard.state_bytes,
    )
    return result


def on_pool_cleared(result, allocator, *args, **kwargs):
    if state.mode_file is not None:
        state.reload_mode()  # benchmarks switch modes between a flush and the next round
    if state.guard is not None:
        try:
            state.guard.reset()
        except Exception as exc:  # the ledger no longer matches the pool: stop vouching
            state.guard.internal_error("reset", exc)
            state.guard.health.latch(f"kvguard could not follow a pool flush ({exc})")
    return result


# -- Scheduler.on_idle (AFTER) ------------------------------------------------------------------------------
def flush_when_idle(result, scheduler, *args, **kwargs):
    """Once idle: the guard's counters reach /metrics, and after a quarantine the prefix cache
    is flushed: nodes over pages an engine bug touched leave it, quarantined pages it held are
    scrubbed and return to service. (Under load they return as their holders release them.)"""
    guard = state.guard
    if guard is None:
        return result
    try:
        guard.flush_metrics()
        if guard.flush_wanted and scheduler.flush_cache():
            log.info("kvguard_prefix_cache_flushed")  # the flush scrubbed what it held
            guard.flush_wanted = False
    except Exception as exc:
        guard.internal_error("idle", exc)
    return result

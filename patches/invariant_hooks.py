"""Hooks on SGLang's own self-checks: quarantined pages are counted, and after contained violations
the engine bug's footprint is reported instead of stopping the scheduler."""

from __future__ import annotations

import structlog

from kvguard.patches import state
from kvguard.patches.control import SGLangControl

log = structlog.get_logger("kvguard")


# -- SchedulerInvariantChecker._report_leak / _check_kv_page_invariants (AROUND) ---------------------------------
def around_memory_check(original, checker, *args, **kwargs):
    """After kvguard contained engine bugs (aborted their victims, withheld their pages), SGLang's
    idle memory check can still see their footprint (a page both freed and cached). Stopping the
    scheduler then would drop every in-flight request: report it instead, with the guard's count."""
    try:
        return original(checker, *args, **kwargs)
    except ValueError as exc:
        if state.guard is None or not state.guard.contained_faults:
            raise
        repaired = None
        if state.scheduler is not None and state.scheduler.is_fully_idle():
            try:
                repaired = SGLangControl(state.scheduler).rebuild_free_list()
            except Exception as err:  # the repair failed: report, never stop the scheduler
                state.guard.internal_error("repair", err)
        log.warning(
            "kvguard_engine_memory_check_after_violations",
            error=str(exc),
            violations=state.guard.actions.num_violations,
            internal_errors=state.guard.num_internal_errors,
            free_pages_rebuilt=repaired,
        )


# -- SchedulerPoolStatsObserver._get_token_info (AROUND) ----------------------------------------------
def around_token_info(original, observer, *args, **kwargs):
    """An engine bug the guard contained (a page both free and cached) can make SGLang's used-token
    count negative until the next idle repair; its usage assertion would then stop the scheduler
    mid-serving. Report zero usage instead, only after violations."""
    stats = original(observer, *args, **kwargs)
    if stats.full_num_used < 0 and state.guard is not None and state.guard.contained_faults:
        import dataclasses

        log.warning("kvguard_pool_overcounted", used=stats.full_num_used)
        return dataclasses.replace(stats, full_num_used=0, full_token_usage=0.0)
    return stats

"""Every SGLang 0.5.23 target kvguard touches, in one table. A version bump is a change here
(and in the hook functions the table names), nowhere else.

Each row: (dotted target, hook type, hook function in ``kvguard.patches``, why).
"""

from __future__ import annotations

GUARD_TARGETS = [
    ("sglang.srt.managers.scheduler.Scheduler.__init__", "AFTER", "sglang_guard.attach",
     "build one Guard per scheduler once the KV pool, page table and allocator exist"),
    ("sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", "AROUND",
     "sglang_guard.around_worker_forward",
     "see the ScheduleBatch (host request ids and prompt tokens) and hand the verdict on in the result"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.forward", "AROUND",
     "sglang_guard.around_model_forward",
     "check reads and writes just before the forward, seal written tokens just after it"),
    ("sglang.srt.managers.scheduler.Scheduler.process_batch_result", "AROUND",
     "sglang_guard.around_process_batch_result",
     "read the verdict after the forward's own sync; abort bad requests before their token is emitted"),
    ("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids", "AROUND",
     "sglang_guard.around_release_pages", "every page re-entering the free list (page_size > 1)"),
    ("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free", "AROUND",
     "sglang_guard.around_token_free", "every slot re-entering the free list (page_size 1)"),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc_rows", "AFTER",
     "sglang_guard.on_rows_allocated", "a page-table row handed to a new request: reset its records"),
    ("sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_pool_invariant",
     "AROUND", "sglang_guard.around_pool_invariant",
     "count quarantined pages in SGLang's idle memory self-check"),
]

"""What the guard's action layer may do to SGLang: abort one request, send one back to be
recomputed, withhold quarantined pages, repair the free list when idle, release an aborted
request by the ledger's truth."""

from __future__ import annotations

from http import HTTPStatus

import torch

from kvguard.ledger import PageState
from kvguard.patches import state


class SGLangControl:
    """EngineControl for SGLang: what the guard's action layer may do to the engine."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        # Requests sent back to be recomputed, not re-queued yet (kvguard.patches.recompute)
        self.recompute_pending: list = []
        self.awaiting_token: list = []  # released for recompute, first new token not out yet

    def abort(self, req, violation):
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        if req.finished():
            return False  # already finished and released: nothing of it is served again
        if req in self.recompute_pending:  # sent back, then failed closed: aborted after all
            self.recompute_pending.remove(req)
            req.is_retracted = False
        if req in self.awaiting_token:
            self.awaiting_token.remove(req)
        reason = FINISH_ABORT(
            violation.message, HTTPStatus.INTERNAL_SERVER_ERROR, "KVCacheIntegrityError"
        )
        req.skip_radix_cache_insert = True  # suspect KV never enters the prefix cache
        req.kvguard_violation = violation
        sched = self.scheduler
        if req is getattr(sched, "chunked_req", None):
            # Mid chunked prefill: SGLang's own deferred path tears it down at the top of the
            # next step (release without checkpoint, abort sent to the client).
            req.discard_output_reason = reason
            req.kvguard_released = True
            sched._pending_chunked_abort_req = req
            return True
        req.finished_reason = reason
        return True

    def recomputes(self, req) -> int:
        return getattr(req, "kvguard_recomputes", 0)

    def emitted(self, req) -> int:
        return len(req.output_ids)

    def recomputing(self, req) -> bool:
        if req.finished():
            return False
        # SGLang's own retraction (memory pressure, priority preemption) released it and
        # re-queued it already: it re-prefills as a healed request would
        return req in self.recompute_pending or (req.is_retracted and not req.kv.holds_kv)

    def recompute(self, req, violation) -> bool:
        """Mark the request retracted: the result loop commits and streams nothing of this step
        (nor of a step already in flight); ``recompute.release_for_recompute`` releases its KV
        after the loop and ``recompute.before_next_batch`` re-queues it."""
        if req.finished():
            violation.why_not_healed = "the request had finished"
            return False
        why_not = _cannot_recompute(req) or _pd_server(self.scheduler)
        if why_not is not None:
            violation.why_not_healed = why_not
            return False
        req.kvguard_recomputes = self.recomputes(req) + 1
        req.kvguard_recompute = violation
        req.is_retracted = True
        self.recompute_pending.append(req)
        return True

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
        guard = state.guard
        sched, L = self.scheduler, guard.ledger
        alloc = sched.token_to_kv_pool_allocator
        ps = alloc.page_size
        n = alloc.num_pages if ps > 1 else alloc.size
        held = torch.zeros(L.num_pages, dtype=torch.bool, device=L.device)
        held[0] = True  # SGLang's padding page
        held[n + 1 :] = True  # beyond the allocator's pages (the pool's padding tail)
        tree = sched.tree_cache
        if tree.evictable_size() or tree.protected_size():
            held[L.pages_of(tree.all_values_flatten().to(L.device))] = True
        before = alloc.available_size() // ps
        # quarantined pages nobody holds go back too, scrubbed
        guard.scrub(torch.nonzero(~held & (L.state == PageState.QUARANTINED)).reshape(-1))
        free = L.rebuild_free(held, guard.step)
        alloc.free_pages = free.to(alloc.device)
        if hasattr(alloc, "release_pages"):
            alloc.release_pages = free[:0].to(alloc.device)
        if getattr(alloc, "staged_pages", None):
            alloc.staged_pages, alloc.num_staged_pages = [], 0
        return int(free.numel()) - before


def release_aborted(scheduler, req):
    """Release an aborted request by the ledger's truth (``release_by_ledger``), through SGLang's
    "release, do not commit" path."""
    req.kvguard_released = True
    if req.kv.holds_kv:
        release_by_ledger(
            scheduler, req, scheduler.batch_result_processor._handle_sampling_mask_abort
        )


def release_by_ledger(scheduler, req, release) -> None:
    """Release a request by the ledger's truth, not only its (possibly corrupt) row: SGLang's
    ``release(req)`` frees what the row names (the guard keeps pages someone else now holds);
    pages the request still owns but its row no longer names (displaced) are freed too; pages
    found bad stay quarantined."""
    guard = state.guard
    row = int(req.kv.req_pool_idx)
    own = guard.private_pages(row)
    release(req)
    left = guard.private_pages(row)  # still owned (by the old generation): displaced from the row
    left = left[torch.isin(left, own)]
    if left.numel():
        with guard.releasing(row):
            scheduler.token_to_kv_pool_allocator.free_page_ids(left.to(torch.int64))


def _pd_server(scheduler) -> str | None:
    """A prefill or decode server of a pair cannot re-prefill a request: the decode server runs
    no prefill forward (a request it re-queued would be taken for a transferred one), and the
    prefill server's KV of the request was promised to a decode server."""
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", "null")
    if mode == "null":
        return None
    return f"a {mode} server of a prefill/decode pair cannot re-prefill a request"


def _cannot_recompute(req) -> str | None:
    """Why SGLang's re-prefill of a retracted request (its own path under memory pressure) would
    not continue this one exactly."""
    if getattr(req, "beam_group", None) is not None:
        return "beam search groups cannot be retracted"
    if getattr(req, "input_embeds", None) is not None:
        return "a request given input embeddings restarts from scratch when retracted"
    if getattr(req, "multimodal_inputs", None) is not None:
        return "multimodal inputs"
    return None

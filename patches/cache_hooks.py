"""Hooks on SGLang's prefix cache (radix tree): pages entering it become shared; hits through pages
the guard found bad are refused, so the request prefills from scratch instead of being aborted."""

from __future__ import annotations

import structlog

from kvguard.patches import state

log = structlog.get_logger("kvguard")


# -- UnifiedRadixCache.checkpoint_into_tree (AROUND) ---------------------------------------------------------
def around_checkpoint_into_tree(original, cache, req, *args, **kwargs):
    if not state.on() or not req.kv.holds_kv:
        return original(cache, req, *args, **kwargs)
    row = int(req.kv.req_pool_idx)
    if state.single_rank() and "up_to" in kwargs and state.guard.suspect_before_resolve(req.rid):
        # Flagged by a step whose verdict is not read yet (it aborts this request next): what it
        # computed stays out of the prefix cache. Inserting only the part the tree already
        # holds keeps SGLang's own bookkeeping (locks, release of the rest) on its usual path.
        log.warning("kvguard_tree_insert_skipped", request=req.rid, reason="flagged")
        kwargs["up_to"] = min(kwargs["up_to"], req.kv.cache_protected_len)
        return original(cache, req, *args, **kwargs)
    if state.guard.actions.num_quarantined_total and _insert_meets_quarantine(
        cache, req, kwargs.get("up_to")
    ):
        # The tree would swap this request's pages for its own copies, quarantined ones among
        # them: keep the request on its own pages (as if barred from the tree this once).
        log.warning("kvguard_tree_insert_skipped", request=req.rid)
        return None
    out = original(cache, req, *args, **kwargs)
    shared = req.kv.cache_protected_len if req.kv.holds_kv else kwargs.get("up_to", 0)
    if shared:
        state.guard.on_share(state.scheduler.req_to_token_pool.req_to_token[row, :shared])
    return out


def _insert_meets_quarantine(cache, req, up_to) -> bool:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key

    tokens = req.full_untruncated_fill_ids[
        : up_to if up_to is not None else len(req.full_untruncated_fill_ids)
    ]
    result = cache._match_tree(MatchPrefixParams(key=_req_radix_key(cache, req, tokens)))
    if not result.device_prefix_len:
        return False
    slots = cache.path_device_indices(result.last_device_node)[: result.device_prefix_len]
    return state.guard.holds_quarantined(slots)


# -- UnifiedRadixCache.match_prefix (AROUND) ---------------------------------------------------------------
def around_match_prefix(original, cache, params, *args, **kwargs):
    """Refuse a prefix-cache hit that runs through a quarantined page: the request prefills from
    scratch instead of being aborted, and the bad node ages out of the tree unused (its pages are
    withheld when the tree finally frees them)."""
    result = original(cache, params, *args, **kwargs)
    if not state.on() or not result.device_prefix_len:
        return result
    quarantine = bool(state.guard.actions.num_quarantined_total)
    pending = (
        state.single_rank() and state.guard.unread_taint()
    )  # pages found bad by a verdict not read yet
    if not (quarantine or pending):
        return result
    slots = cache.path_device_indices(result.last_device_node)[: result.device_prefix_len]
    if not (
        (quarantine and state.guard.holds_quarantined(slots))
        or (pending and state.guard.suspect_before_resolve(slots=slots))
    ):
        return result
    from sglang.srt.mem_cache.base_prefix_cache import zero_match_result

    req = getattr(params, "req", None)
    log.warning(
        "kvguard_prefix_hit_refused",
        request=getattr(req, "rid", None),
        prefix_len=result.device_prefix_len,
    )
    miss = zero_match_result(cache, result, extra_key=getattr(req, "extra_key", None))
    # zero_match_result keeps the walk's cache_protected_len; a miss protects nothing, else the
    # request would later treat its own freshly computed prefix as the tree's.
    return miss._replace(cache_protected_len=0) if miss.cache_protected_len is not None else miss

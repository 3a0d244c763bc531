"""Hooks on SGLang's prefix cache (radix tree): pages entering it become shared; hits through pages
the guard found bad are refused, so the request prefills from scratch instead of being aborted."""

from __future__ import annotations

from kvguard.guard import clock
from kvguard.patches import state
from kvguard.patches.tenancy import namespace_of, namespace_seed


# -- UnifiedRadixCache.checkpoint_into_tree (AROUND) ---------------------------------------------------------
def around_checkpoint_into_tree(original, cache, req, *args, **kwargs):
    """The tree's own insert always runs once. If the guard fails before it, the request's KV
    stays out of the tree (only what the tree already holds is inserted); if it fails after,
    the pages the tree took are not known as shared, so the next reader of them is refused."""
    if not state.on() or not req.kv.holds_kv:
        return original(cache, req, *args, **kwargs)
    guard = state.guard
    try:
        plan = _before_insert(cache, req, kwargs)
    except Exception as exc:
        guard.internal_error("insert", exc)
        plan = "bar"
    if plan == "skip":
        return None
    if plan == "bar" and "up_to" in kwargs:
        kwargs["up_to"] = min(kwargs["up_to"], req.kv.cache_protected_len)
    out = original(cache, req, *args, **kwargs)
    if isinstance(plan, tuple):
        try:
            _after_insert(req, *plan)
        except Exception as exc:
            guard.internal_error("insert", exc)
    return out


def _before_insert(cache, req, kwargs):  # type: ignore[no-untyped-def]
    """What to do with this insert: "skip" it, "bar" the request's own KV from the tree, or
    (row, start, slots before) to follow it."""
    guard = state.guard
    if "up_to" in kwargs and (
        guard.suspect_before_resolve(req.rid)
        if state.single_rank()
        else guard.in_unresolved_step(req.rid)
    ):
        # A chunk checkpointed before its step's verdict is read (the overlap scheduler stashes
        # a chunked prefill's chunk while that step's result waits): on a single rank, a chunk
        # the verdict flags stays out of the prefix cache; with tensor parallelism the ranks'
        # unread verdicts differ until agreed, so every such chunk waits (it enters at a
        # checkpoint after its verdict was read). Inserting only the part the tree already holds
        # keeps SGLang's own bookkeeping (locks, release of the rest) on its usual path.
        if state.single_rank():  # (with TP every chunk waits: not news)
            guard.log("warning", "kvguard_tree_insert_skipped", request=req.rid, reason="flagged")
        return "bar"
    if (guard.ledger.num_quarantined or guard.tree_suspect) and _insert_meets_bad_node(
        cache, req, kwargs.get("up_to")
    ):
        # The tree would swap this request's pages for its own copies, and some of those are
        # quarantined or not the request's own tokens any more (an engine bug handed a node's
        # page to someone else): keep the request on its own pages (as if barred from the tree
        # this once). A recomputed request would otherwise be bound again to the very page
        # that failed it. Asked only between a violation and the next prefix-cache flush: until
        # then the tree holds no bad node the step check has not flagged.
        guard.log("warning", "kvguard_tree_insert_skipped", request=req.rid)
        return "skip"
    t0 = clock()
    row = int(req.kv.req_pool_idx)
    table = state.scheduler.req_to_token_pool.req_to_token
    start = req.kv.cache_protected_len
    before = table[row, start : kwargs.get("up_to", start)].clone()
    guard.charge(t0)
    return (row, start, before)


def _after_insert(req, row: int, start: int, before) -> None:  # type: ignore[no-untyped-def]
    if not req.kv.holds_kv:
        return
    guard = state.guard
    table = state.scheduler.req_to_token_pool.req_to_token
    shared = req.kv.cache_protected_len
    # The tree replaced the row's own copies of pages it already held by its own ones.
    after = table[row, start : min(shared, start + before.numel())]
    if after.numel():
        guard.on_rebind(row, start, before[: after.numel()], after)
    if shared:
        guard.on_share(table[row, :shared], row)


def _insert_meets_bad_node(cache, req, up_to) -> bool:
    guard = state.guard
    if not (guard.ledger.num_quarantined or guard.host_reads_free):
        return False  # nothing this rank can answer without a device sync
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key

    tokens = req.full_untruncated_fill_ids[
        : up_to if up_to is not None else len(req.full_untruncated_fill_ids)
    ]
    result = cache._match_tree(MatchPrefixParams(key=_req_radix_key(cache, req, tokens)))
    n = result.device_prefix_len
    if not n:
        return False
    slots = cache.path_device_indices(result.last_device_node)[:n]
    if guard.ledger.num_quarantined and guard.holds_quarantined(slots):
        return True
    if not guard.host_reads_free:
        return False
    seed = namespace_seed(*namespace_of(req)) if guard.config.tenant_isolation else 0
    return not guard.adoptable(slots, list(tokens[:n]), seed)


# -- UnifiedRadixCache.match_prefix (AROUND) ---------------------------------------------------------------
def around_match_prefix(original, cache, params, *args, **kwargs):
    """Refuse a prefix-cache hit the guard would not let the request adopt (a page quarantined or
    found bad, or not holding the request's own tokens: another tenant's, a stale node's): the
    request prefills from scratch instead of being aborted, and the bad node ages out unused."""
    result = original(cache, params, *args, **kwargs)
    if not state.on() or not result.device_prefix_len:
        return result
    try:
        return _judged_hit(cache, params, result)
    except Exception as exc:  # the step check still judges the hit's adoption
        state.guard.internal_error("match", exc)
        return result


def _judged_hit(cache, params, result):  # type: ignore[no-untyped-def]
    guard = state.guard
    quarantine = bool(guard.ledger.num_quarantined)
    pending = state.single_rank() and guard.unread_taint()  # bad pages, verdict not read yet
    slots = cache.path_device_indices(result.last_device_node)[: result.device_prefix_len]
    refuse = (quarantine and guard.holds_quarantined(slots)) or (
        pending and guard.suspect_before_resolve(slots=slots)
    )
    if not refuse and guard.host_reads_free:
        # The hand-off rule, asked now: pages that do not hold this request's own tokens (another
        # tenant's, or a stale node's) are refused here rather than read and aborted.
        req = getattr(params, "req", None)
        ns = namespace_of(req) if req is not None else (params.key.extra_key, params.key.cache_salt)
        seed = namespace_seed(*ns) if guard.config.tenant_isolation else 0
        tokens = list(params.key.token_ids[: result.device_prefix_len])
        refuse = not guard.adoptable(slots, tokens, seed)
    if not refuse:
        return result
    from sglang.srt.mem_cache.base_prefix_cache import zero_match_result

    req = getattr(params, "req", None)
    guard.log(
        "warning",
        "kvguard_prefix_hit_refused",
        request=getattr(req, "rid", None),
        prefix_len=result.device_prefix_len,
    )
    miss = zero_match_result(cache, result, extra_key=getattr(req, "extra_key", None))
    # zero_match_result keeps the walk's cache_protected_len; a miss protects nothing, else the
    # request would later treat its own freshly computed prefix as the tree's.
    return miss._replace(cache_protected_len=0) if miss.cache_protected_len is not None else miss

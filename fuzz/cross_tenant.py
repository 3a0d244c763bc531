"""The ``cross_tenant`` class: a prefix-cache bug that hands one tenant's KV to another.

SGLang keys its radix tree by the request's namespace (``extra_key``, ``cache_salt``) besides the
tokens, so tenants never share a node. The injected bug is a namespace collision in the lookup
(the mechanism of vLLM CVE-2025-25183, a constant ``hash(None)`` in the block key; the leak class
of the NDSS 2025 prompt-leakage work): for one request B, ``match_prefix`` looks B's tokens up
under another tenant's namespace where the tree holds a longer match, and returns that tenant's
nodes. Everything after the lookup is SGLang's real path: B locks A's node, its row maps A's
slots, its prefill reads them.

The bytes B reads are the KV of B's own tokens (a prefix match means the same tokens), so no
output changes: the harm is the hit itself (B learns that A sent that prefix, from the time to
first token, and A's KV served B). Victims: the B request that adopts A's pages (and any later
holder of them under another namespace); a completed victim is a leak. With tenant isolation the
guard either refuses the hit (the match returns less than the bug found: ``refused``) or aborts B.

Arming is lazy: the plan entry arms the bug, and the first match of a request whose tokens another
tenant's namespace holds fires it; the injection is reported once B holds KV.
"""

from __future__ import annotations

import dataclasses

from kvguard.fuzz.accounting import Injection, Watch, Written, namespace

_bug: dict | None = None  # the armed bug: {"fired": None | {...}}
_namespaces: set[tuple] = set()  # namespaces the scheduler has seen (requests in its batches)


def note_namespaces(batch) -> None:
    """Remember the namespaces of a batch's requests: the tenants whose KV the tree may hold."""
    if batch is not None:
        for req in batch.reqs:
            _namespaces.add(namespace(req))


def cross_tenant(sched, batch, rng, step):
    """Arm the bug on first call; report the injection once it fired and its reader holds KV."""
    global _bug
    if _bug is None:
        _install(sched.tree_cache)
        _bug = {"fired": None}
        return None
    fired = _bug["fired"]
    if fired is None or not (fired["refused"] or fired["req"].kv.holds_kv):
        return None
    _bug = None
    ps = sched.token_to_kv_pool_allocator.page_size
    detail = {k: fired[k] for k in ("rid", "tenant", "foreign", "prefix_len", "found", "refused")}
    if fired["refused"]:
        return _injection(step, Watch(ps, step, {}), detail)
    reader, ns = fired["req"], tuple(fired["foreign"])
    # A's slots hold the KV of B's prefix tokens, written under A's namespace.
    contents = {s: Written(ns, pos, reader) for pos, s in enumerate(fired["slots"])}
    return _injection(step, Watch(ps, step, contents), detail)


def disarm(sched) -> None:
    """The plan entry ran out of tries: the bug never fires."""
    global _bug
    _bug = None


cross_tenant.disarm = disarm  # the plugin calls it when it drops the entry


def _injection(step, watch, detail):
    return Injection("cross_tenant", step, watch, detail)


def _install(tree) -> None:
    """Wrap this tree's ``match_prefix`` (an instance attribute over the class's, so any hook on
    the class, e.g. the guard's, still runs inside it)."""
    if getattr(tree, "_kvguard_fuzz_buggy_match", False):
        return
    real = tree.match_prefix

    def match_prefix(params, *args, **kwargs):
        bug, req = _bug, getattr(params, "req", None)
        if bug is None or req is None or req.kv.holds_kv:
            return real(params, *args, **kwargs)
        fired = bug["fired"]
        if fired is not None and fired["req"] is not req:
            return real(params, *args, **kwargs)  # fired for another request already
        found = _foreign_match(tree, params, req) if fired is None else fired["found_key"]
        if found is None:
            return real(params, *args, **kwargs)
        key, length = found
        result = real(dataclasses.replace(params, key=key), *args, **kwargs)
        got = result.device_prefix_len
        slots = tree.path_device_indices(result.last_device_node)[:got] if got else None
        bug["fired"] = {
            "req": req,
            "rid": req.rid,
            "tenant": list(namespace(req)),
            "foreign": [key.extra_key, key.cache_salt],
            "found_key": found,
            "found": length,
            "prefix_len": got,
            "refused": got < length,  # a hook on the match refused (part of) the hit
            "slots": slots.tolist() if slots is not None else [],
        }
        return result

    tree.match_prefix = match_prefix
    tree._kvguard_fuzz_buggy_match = True


def _foreign_match(tree, params, req):
    """(key, length): B's tokens keyed under the other namespace where the tree holds the longest
    match, longer than B's own and at least a page; None if there is none. Probed with the bare
    tree walk (no hooks, no session shortcut)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    own = namespace(req)
    k = params.key
    best, best_len = None, tree._match_tree(MatchPrefixParams(key=k)).device_prefix_len
    best_len = max(best_len, tree.page_size - 1)
    for ns in sorted(_namespaces - {own}, key=repr):
        key = type(k)(k.token_ids, ns[0], is_bigram=k.is_bigram, limit=k.limit, cache_salt=ns[1])
        n = tree._match_tree(MatchPrefixParams(key=key)).device_prefix_len
        if n > best_len:
            best, best_len = key, n
    return None if best is None else (best, best_len)

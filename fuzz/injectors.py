"""Fault injectors: each reproduces the engine-side *mechanism* of a real KV aliasing bug inside a
live SGLang scheduler, through SGLang's own allocator, page table, prefix cache and KV pool, never
through kvguard's ledger. See docs/bug-classes.md for the bug classes.

An injector runs just before a batch's forward (``Scheduler.run_batch``), sees the scheduler and the
batch, and returns an ``Injection`` (or None when the moment does not fit; then it is retried at a
later step). The injection names the pages it touched and what their slots really hold now
(``accounting.Watch``); the tracker works out, step by step, which requests that makes victims and
which only exposed. The KV bytes are touched through ``kvbytes`` (MHA and MLA pools alike).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvguard.fuzz import kvbytes
from kvguard.fuzz.accounting import (
    OK,
    Content,
    Garbage,
    Injection,
    Scan,
    Watch,
    Written,
    judge,
    live_requests,
    written_by,
)
from kvguard.fuzz.cross_tenant import cross_tenant


def _pool(sched):
    return sched.tp_worker.model_runner.token_to_kv_pool


def _table(sched):
    return sched.req_to_token_pool.req_to_token


def _ps(sched) -> int:
    return sched.token_to_kv_pool_allocator.page_size


def holders(sched, batch, slots: torch.Tensor) -> set[str]:
    """Requests whose page-table rows reference any of these slots."""
    table = _table(sched)
    out = set()
    for req in live_requests(sched, batch):
        row = table[req.kv.req_pool_idx, : req.kv.kv_allocated_len].to(torch.int64)
        if bool(torch.isin(row, slots.to(torch.int64)).any()):
            out.add(req.rid)
    return out


def free_if_orphaned(sched, slots: torch.Tensor):
    """Give slots back only if nothing holds them: not a live request, not the free list, not the
    prefix cache (someone, e.g. a guard releasing an aborted request by its own records, may have
    freed them already, and under memory pressure they are soon reused and cached)."""
    alloc = sched.token_to_kv_pool_allocator
    free = alloc.get_all_free_pages() if hasattr(alloc, "get_all_free_pages") else alloc.free_pages
    pages = torch.unique(slots // alloc.page_size)
    if bool(torch.isin(pages, free).any()) or holders(sched, None, slots):
        return
    tree = getattr(sched, "tree_cache", None)  # freed, reused, and now cached by the prefix tree
    if tree is not None and hasattr(tree, "all_values_flatten"):
        cached = tree.all_values_flatten().to(slots.device, torch.int64)
        if bool(torch.isin(slots, cached).any()):
            return
    alloc.free(slots)


def _written_page(rng, req, ps, private=False, lo=0):
    """A full page the request wrote at least two steps ago (sealed, at rest), or None.
    ``private``: only pages past the prefix cache's share of the row; ``lo``: at or past it."""
    lo = max(lo, req.kv.cache_protected_len if private else 0)
    first, last = -(-lo // ps), (req.kv.kv_committed_len - 2) // ps - 1
    if last < first:
        return None
    return rng.randint(first, last)


def _decode_reqs(batch):
    return [r for r in batch.reqs if not r.finished()] if batch.forward_mode.is_decode() else []


def _page_slots(sched, req, lp):
    ps = _ps(sched)
    return _table(sched)[req.kv.req_pool_idx, lp * ps : (lp + 1) * ps].to(torch.int64).clone()


# What the watches of earlier injections know their slots hold (set by the fuzz plugin before
# each injector runs, ``known_from``). Their record follows every write into a watched page;
# ``written_by`` assumes a request's row holds its own KV, which is wrong after an earlier
# injection pointed that row at another request's page (then this injection's record of the slot
# would judge an intact read of it wrong).
_known: dict[int, Content] = {}


def known_from(watches) -> None:
    """What ``watches`` (oldest first: a later record of a slot wins) say their slots hold."""
    _known.clear()
    for watch in watches:  # what a slot rightly holds; not another injection's harm (garbage,
        # KV written from wrong reads), which would charge that injection's victims to this one
        _known.update(
            {s: c for s, c in watch.contents.items() if isinstance(c, Written) and not c.poisoned}
        )


def _page_contents(sched, req, lp, batch=None) -> dict:
    """What the slots of ``req``'s logical page ``lp`` hold: what an earlier injection's watch
    knows of a slot; else its own KV where it wrote it; where it did not (yet: a prefix-cache
    page it holds before its own length covers it), the KV of another live holder that wrote that
    slot, if one did."""
    ps = _ps(sched)
    slots = _page_slots(sched, req, lp).tolist()
    committed = req.kv.kv_committed_len
    out = {s: _known.get(s) or written_by(req, lp * ps + i, committed) for i, s in enumerate(slots)}
    unknown = [s for s, c in out.items() if isinstance(c, Garbage)]
    if unknown:
        out.update(_written_by_others(sched, batch, unknown, req))
    return out


def _written_by_others(sched, batch, slots: list[int], skip) -> dict:
    """slot -> the KV another live request wrote there (at a position it has committed)."""
    table, want, out = _table(sched), torch.tensor(slots, dtype=torch.int64), {}
    for other in live_requests(sched, batch):
        if other is skip:
            continue
        n = other.kv.kv_committed_len
        row = table[other.kv.req_pool_idx, :n].to(torch.int64)
        for pos in torch.nonzero(torch.isin(row, want)).reshape(-1).tolist():
            out.setdefault(int(row[pos]), written_by(other, pos, n))
    return out


# -- injectors -----------------------------------------------------------------------------------------
def premature_free(sched, batch, rng, step):
    """sglang #24226 / #18744: a page returned to the free list while its request still reads it.
    Victims: its holders (stale from now on); exposed: whoever the allocator hands it to next."""
    ps = _ps(sched)
    for req in rng.sample(_decode_reqs(batch), len(_decode_reqs(batch))):
        lp = _written_page(rng, req, ps, private=rng.random() < 0.5)
        if lp is None:
            continue
        slots = _page_slots(sched, req, lp)
        watch = Watch(ps, step, _page_contents(sched, req, lp, batch))
        sched.token_to_kv_pool_allocator.free(slots)
        return Injection(
            "premature_free", step, watch, {"rid": req.rid, "page": int(slots[0]) // ps}
        )
    return None


def double_allocation(sched, batch, rng, step):
    """vllm #42571: the same page twice in the free queue; the allocator hands it out again."""
    alloc, ps = sched.token_to_kv_pool_allocator, _ps(sched)
    for req in rng.sample(_decode_reqs(batch), len(_decode_reqs(batch))):
        lp = _written_page(rng, req, ps, private=rng.random() < 0.5)
        if lp is None:
            continue
        slots = _page_slots(sched, req, lp)
        page = slots[:1] // ps
        watch = Watch(ps, step, _page_contents(sched, req, lp, batch))
        alloc.free_pages = torch.cat(
            (page.to(alloc.free_pages.device), alloc.free_pages)
        )  # bypasses free()
        return Injection("double_allocation", step, watch, {"rid": req.rid, "page": int(page)})
    return None


def table_redirect(sched, batch, rng, step):
    """sglang #18803 / vllm #7018: a page-table entry points at another request's slot."""
    reqs = _decode_reqs(batch)
    if len(reqs) < 2:
        return None
    a, b = rng.sample(reqs, 2)
    pa, pb = a.kv.kv_committed_len - 3, b.kv.kv_committed_len - 3
    if pa < 1 or pb < 1:
        return None
    table, ps = _table(sched), _ps(sched)
    pos = rng.randint(0, pa)
    j = rng.randint(0, pb)
    other = int(table[b.kv.req_pool_idx, j])
    target = other - other % ps + pos % ps  # same in-page offset: only the owner tag can tell
    if target == int(table[a.kv.req_pool_idx, pos]):
        return None
    watch = Watch(
        ps, step, _page_contents(sched, b, j // ps, batch)
    )  # the target's page, as b holds it
    displaced = int(table[a.kv.req_pool_idx, pos])
    table[a.kv.req_pool_idx, pos] = target

    def tidy(sched, req=a, slot=displaced):  # page size 1: the displaced slot would leak
        if not (req.finished() or not req.kv.holds_kv):
            return False
        free_if_orphaned(sched, torch.tensor([slot], dtype=torch.int64))
        return True

    # With pages, the displaced slot's page stays in the row through its other slots and is
    # released with it; freeing it here again was a double free of the tool's own making (seen
    # in the full campaign: the page's next owner was aborted for a genuine double allocation).

    return Injection(
        "table_redirect",
        step,
        watch,
        {"rid": a.rid, "pos": pos, "slot": target, "displaced": displaced},
        cleanup=tidy if ps == 1 else None,
    )


def table_swap(sched, batch, rng, step):
    """Two page-table entries of one request swapped (write-after-read race on the table)."""
    for req in _decode_reqs(batch):
        n = req.kv.kv_committed_len - 2
        if n < 3:
            continue
        p1, p2 = rng.sample(range(n), 2)
        table, row = _table(sched), req.kv.req_pool_idx
        s1, s2 = int(table[row, p1]), int(table[row, p2])
        watch = Watch(_ps(sched), step, {s1: written_by(req, p1), s2: written_by(req, p2)})
        table[row, p1], table[row, p2] = s2, s1
        return Injection("table_swap", step, watch, {"rid": req.rid, "pos": [p1, p2]})
    return None


def bit_flip(sched, batch, rng, step):
    """arXiv 2604.17249: one bit flipped in a resting KV slot (memory or DMA corruption); whoever
    reads the slot until it is rewritten (a prefix-cache hit on it too) reads the flip."""
    reqs = _decode_reqs(batch)
    if not reqs:
        return None
    req = rng.choice(reqs)
    n = req.kv.kv_committed_len - 2
    if n < 1:
        return None
    pos = rng.randint(0, n - 1)
    slot = int(_table(sched)[req.kv.req_pool_idx, pos])
    where = kvbytes.flip_bit(_pool(sched), slot, rng)
    watch = Watch(_ps(sched), step, {slot: Garbage("bit_flip")})
    return Injection("bit_flip", step, watch, {"rid": req.rid, "slot": slot, **where})


def index_key_flip(sched, batch, rng, step):
    """A DSA (GLM-5) pool's second KV structure: one bit of a resting slot's index key, or of its
    scale, flipped in one indexer layer (``kvbytes.flip_index_bit``). The indexer scores that
    token by its key: the flip can change which tokens its readers attend to, with their latent
    rows intact. Victims: the slot's readers, as for a latent ``bit_flip``."""
    found = _resting_slot(sched, batch, rng)
    if found is None:
        return None
    req, pos, slot = found
    where = kvbytes.flip_index_bit(_pool(sched), slot, rng)
    watch = Watch(_ps(sched), step, {slot: Garbage("index_key_flip")})
    return Injection(
        "index_key_flip", step, watch, {"rid": req.rid, "slot": slot, "pos": pos, **where}
    )


def index_key_misplaced(sched, batch, rng, step):
    """A misdirected index-key write (the page-major index store given the wrong slot): another
    request's index key and scale land over a resting slot's, in one indexer layer; the indexer
    then selects for that position by a stranger's key. Victims: the overwritten slot's readers
    (the source slot keeps its own key)."""
    found = _resting_slot(sched, batch, rng)
    if found is None:
        return None
    req, pos, slot = found
    pool = _pool(sched)
    layer = rng.randrange(len(kvbytes.index_rows(pool)))
    table = _table(sched)
    others = [r for r in live_requests(sched, batch) if r is not req and r.kv.kv_committed_len > 0]
    for src_req in rng.sample(others, len(others)) + [req]:  # a stranger's key, else its own
        n = src_req.kv.kv_committed_len
        src_pos = rng.randrange(n)
        src = int(table[src_req.kv.req_pool_idx, src_pos])
        if src != slot and kvbytes.copy_index_key(pool, src, slot, layer):
            watch = Watch(_ps(sched), step, {slot: Garbage("index_key_misplaced")})
            detail = {"rid": req.rid, "slot": slot, "pos": pos, "index_layer": layer,
                      "from_rid": src_req.rid, "from_slot": src, "from_pos": src_pos}  # fmt: skip
            return Injection("index_key_misplaced", step, watch, detail)
    return None


# Classes that need a pool kind beyond the KV every pool has: the plugin refuses them elsewhere.
POOL_CLASSES = {"index_key_flip": "dsa", "index_key_misplaced": "dsa"}


def refusal(cls: str, pool) -> str | None:
    """Why class ``cls`` cannot be injected into this pool, or None."""
    if POOL_CLASSES.get(cls) == "dsa" and not kvbytes.is_dsa(pool):
        return (
            f"{cls} corrupts DSA index keys (index_k_with_scale_buffer): the KV pool "
            f"{type(pool).__name__} has none; run it against a DSA model (GLM-5, DeepSeek V3.2)"
        )
    return None


def _resting_slot(sched, batch, rng):
    """(request, position, slot) of a token a running decode request wrote at least two steps
    ago (sealed, at rest), or None."""
    reqs = _decode_reqs(batch)
    if not reqs:
        return None
    req = rng.choice(reqs)
    n = req.kv.kv_committed_len - 2
    if n < 1:
        return None
    pos = rng.randint(0, n - 1)
    return req, pos, int(_table(sched)[req.kv.req_pool_idx, pos])


def exponent_flip(sched, batch, rng, step):
    """A bit flip that matters: the highest exponent bit of one K/V element of a resting slot,
    in one layer (``kvbytes.flip_exponent``: x256 in FP8), before the forward (and its check)."""
    found = _resting_slot(sched, batch, rng)
    if found is None:
        return None
    req, pos, slot = found
    pool = _pool(sched)
    layer = rng.randrange(kvbytes.num_layers(pool))
    name, buf = rng.choice(sorted(kvbytes.layer_buffers(pool, layer).items()))
    where = kvbytes.flip_exponent(buf, slot)
    watch = Watch(_ps(sched), step, {slot: Garbage("exponent_flip")})
    detail = {"rid": req.rid, "slot": slot, "pos": pos, "layer": layer, "buffer": name, **where}
    return Injection("exponent_flip", step, watch, detail)


ATTENTION_METHODS = ("forward_decode", "forward_extend")


def _query_gain(q, layer, forward_batch, req) -> torch.Tensor | None:
    """[kv heads, head dim]: how much a change of each element of a K row moves ``req``'s
    attention logits at this layer (its queries of that K head, summed: grouped-query heads
    share one), so a flip can be aimed where the victim notices it; None where not known."""
    try:
        rows = forward_batch.req_pool_indices.to(torch.int64).reshape(-1).tolist()
        if not forward_batch.forward_mode.is_decode() or req.kv.req_pool_idx not in rows:
            return None
        i = rows.index(req.kv.req_pool_idx)  # decode: one query token per request, in order
        heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim
        query = q.reshape(q.shape[0], heads, dim)[i].to(torch.float32)
        return query.reshape(kv_heads, heads // kv_heads, dim).sum(dim=1)
    except Exception:  # another layout: the flip falls back to the largest element
        return None


def in_forward_flip(sched, batch, rng, step):
    """A bit flip inside the forward, after every check made before it: the highest exponent
    bit of one K/V element of a running decode request's resting slot (written two or more
    steps ago, sealed), flipped when attention layer L (L >= 1, drawn) is about to run, in layer
    L's buffer (so L reads it in this very forward) or, one time in four, an earlier layer's
    (which read it already: the next step reads it). A flip in layer L's K is aimed with the
    victim's query (``_query_gain``: the element that raises its attention to the slot most);
    elsewhere the largest element is flipped (``kvbytes.flip_exponent``). The attention backend's
    ``forward_decode``/``forward_extend`` are wrapped as they are found now (kvguard's own
    wrappers included) for this step only, and restored after the forward. An injection whose
    layer never ran (``detail["fired"]`` false after the forward) is reported ``unfired``: so is
    one in a forward replayed from a CUDA graph, which calls no Python attention method."""
    found = _resting_slot(sched, batch, rng)
    if found is None:
        return None
    req, pos, slot = found
    pool = _pool(sched)
    backend = getattr(sched.tp_worker.model_runner, "attn_backend", None)
    if backend is None:
        return None
    layers = kvbytes.num_layers(pool)
    at = rng.randint(1, layers - 1) if layers > 1 else 0
    layer = at if at == 0 or rng.random() < 0.75 else rng.randrange(at)
    buffers = kvbytes.layer_buffers(pool, layer)
    # K three times in four: a K flip moves attention itself (V only what it averages)
    name = "k" if "k" in buffers and rng.random() < 0.75 else rng.choice(sorted(buffers))
    buf = buffers[name]
    first = getattr(pool, "start_layer", 0) or 0
    detail = {
        "rid": req.rid,
        "slot": slot,
        "pos": pos,
        "layer": layer,
        "at_layer": at,
        "buffer": name,
        "backend": type(backend).__name__,
        "fired": False,
    }

    cls = type(backend)
    saved = {m: cls.__dict__.get(m) for m in ATTENTION_METHODS}

    def wrap(inner):
        def attention(self, *args, **kwargs):  # (q, k, v, layer, forward_batch, ...)
            layer_obj = args[3] if len(args) > 3 else kwargs.get("layer")
            if not detail["fired"] and getattr(layer_obj, "layer_id", None) == first + at:
                detail["fired"] = True
                gain = None
                if name == "k" and layer == at:  # the victim's own query, about to read it
                    fb = args[4] if len(args) > 4 else kwargs.get("forward_batch")
                    gain = _query_gain(args[0] if args else kwargs.get("q"), layer_obj, fb, req)
                detail["aimed"] = gain is not None
                detail.update(kvbytes.flip_exponent(buf, slot, gain))
            return inner(self, *args, **kwargs)

        return attention

    for m in ATTENTION_METHODS:
        setattr(cls, m, wrap(getattr(cls, m)))

    def disarm():
        for m, attr in saved.items():
            if attr is None:
                delattr(cls, m)  # it was inherited: the class's own attribute goes again
            else:
                setattr(cls, m, attr)

    watch = Watch(_ps(sched), step, {slot: Garbage("in_forward_flip")})
    if layer < at:  # this forward's layer read the slot before the flip: intact for it
        watch.transient = {slot: written_by(req, pos)}
    return Injection("in_forward_flip", step, watch, detail, disarm=disarm)


def _store_gone_astray(cls: str, sched, batch, rng, step, elsewhere: bool, flip: bool = False):
    """A running decode request's new token: its store, in every layer, never lands (its slot
    keeps the bytes it held), lands in another slot (a resting token of another running request,
    else of its own), or (``flip``) lands and has one exponent bit of its row flipped before
    attention reads it: what attention of this very forward reads there is not what the layer
    stored. Made inside SGLang's real store, after the write firewall judged the slot: the pool's
    ``set_kv_buffer`` is wrapped on the pool object (outside every class-level hook, kvguard's
    included) for this step only; on a CPU DSA pool, whose latent store is ``dsa_cpu``'s own,
    that store is."""
    reqs = _decode_reqs(batch)
    loc = getattr(batch, "out_cache_loc", None)
    if not reqs or loc is None or loc.numel() != len(batch.reqs):
        return None
    req = rng.choice(reqs)
    slot = int(loc[batch.reqs.index(req)])
    other = None
    if elsewhere:
        others = [r for r in reqs if r is not req] or [req]
        found = _resting_slot(sched, SimpleNamespace(reqs=others, forward_mode=batch.forward_mode),
                              rng)  # fmt: skip
        if found is None:
            return None
        other = found
    pool = _pool(sched)
    first = getattr(pool, "start_layer", 0) or 0
    layers = kvbytes.num_layers(pool)
    detail = {"rid": req.rid, "slot": slot, "fired": False, "layers": 0}
    if other is not None:
        detail.update(holder=other[0].rid, holder_slot=other[2], holder_pos=other[1])

    def damage(lid, saved) -> None:  # right after layer lid's store of the new token
        bufs = list(kvbytes.layer_buffers(pool, lid - first).values())
        if flip:  # the first layer's K (or latent) row, between store and read
            if not detail["fired"]:
                detail["fired"] = True
                detail["layers"] = 1
                detail.update(kvbytes.flip_exponent(bufs[0], slot))
            return
        detail["fired"] = True
        detail["layers"] += 1
        for b, old in zip(bufs, saved):
            if other is not None:
                b[other[2]] = b[slot]  # the row lands on the other token
            b[slot] = old  # and never where it was meant

    def rows_before(lid) -> list:
        return [b[slot].clone() for b in kvbytes.layer_buffers(pool, lid - first).values()]

    if kvbytes.is_dsa(pool):  # the CPU DSA path stores its latent itself (dsa_cpu.write_latent)
        from kvguard.patches import dsa_cpu

        inner_latent = dsa_cpu.write_latent

        def write_latent(pool_, layer, loc, k):
            saved = rows_before(layer.layer_id)
            inner_latent(pool_, layer, loc, k)
            damage(layer.layer_id, saved)

        dsa_cpu.write_latent = write_latent

        def disarm():
            if dsa_cpu.write_latent is write_latent:
                dsa_cpu.write_latent = inner_latent

    else:
        inner = pool.set_kv_buffer  # bound: SGLang's store with every class-level hook around it

        def store(layer, loc_info, *args, **kwargs):
            lid = getattr(layer, "layer_id", None)
            saved = rows_before(lid) if lid is not None else None
            out = inner(layer, loc_info, *args, **kwargs)
            if saved is not None:
                damage(lid, saved)
            return out

        pool.set_kv_buffer = store

        def disarm():
            if pool.__dict__.get("set_kv_buffer") is store:
                del pool.set_kv_buffer

    garbage = {slot: Garbage(cls)}
    if other is not None:
        garbage[other[2]] = Garbage(cls)
    detail["num_layers"] = layers
    watch = Watch(_ps(sched), step, garbage)
    watch.garbled[slot] = step  # this forward's own write there is what goes wrong
    return Injection(cls, step, watch, detail, disarm=disarm)


def lost_store(sched, batch, rng, step):
    """A store that never lands: the new token's slot keeps its old bytes in every layer."""
    return _store_gone_astray("lost_store", sched, batch, rng, step, elsewhere=False)


def flipped_store(sched, batch, rng, step):
    """A byte changed between a layer's store and its read: the new token's row, just stored, has
    an exponent bit flipped before attention of the same layer reads it."""
    return _store_gone_astray("flipped_store", sched, batch, rng, step, False, flip=True)


def misdirected_store(sched, batch, rng, step):
    """A store that lands elsewhere: the new token's rows overwrite another running request's
    resting token (its own, when it runs alone), its own slot keeping its old bytes."""
    return _store_gone_astray("misdirected_store", sched, batch, rng, step, elsewhere=True)


def stale_writer(sched, batch, rng, step):
    """GLM-5 PD race / sglang #24527: a transfer issued for one request lands after its pages
    were reused: snapshot a page now, write the old bytes back once another request holds it and
    has written its own KV there (so it reads the stale bytes: see ``land_stale_write``)."""
    ps = _ps(sched)
    reqs = _decode_reqs(batch)
    for req in rng.sample(reqs, len(reqs)):
        # An output page if there is one: the prefix cache evicts a finished request's output
        # before its prompt, so the page is reused (and the late write lands) sooner.
        lp = _written_page(rng, req, ps, private=True, lo=len(req.origin_input_ids))
        if lp is None:
            lp = _written_page(rng, req, ps, private=True)
        if lp is None:
            continue
        slots = _page_slots(sched, req, lp)
        contents = _page_contents(sched, req, lp, batch)
        stale = kvbytes.snapshot(_pool(sched), slots)
        return Injection(
            "stale_writer",
            step,
            Watch(ps, step, contents),
            {"rid": req.rid, "page": int(slots[0]) // ps},
            pending={"slots": slots, "bytes": stale, "contents": contents, "from": req},
        )
    return None


def land_stale_write(sched, scan: Scan, inj: Injection, step: int) -> bool:
    """Land a stale_writer's bytes once the page is held by another request that has written it
    all (not in this forward) and reads different KV there: the late write then lands in KV a
    live request reads. Landing as soon as another request merely held the page let its owner
    overwrite the stale bytes (18 of 24 "masked" in a 10k-request campaign)."""
    pending = inj.pending
    slots = pending["slots"].tolist()
    if set(slots) & {slot for _, _, slot in scan.writes}:
        return False  # this forward writes there: it would overwrite the stale bytes
    for h in scan.holders:
        if h.req is pending["from"]:
            continue
        held = {s: p for s, p in h.slots if s in pending["contents"]}
        if len(held) < len(slots) or any(p >= h.committed for p in held.values()):
            continue
        if all(judge(pending["contents"][s], h.req, held[s], scan.tokens) == OK for s in held):
            continue  # the same KV (a prefix-cache hit on it): a harmless late write
        kvbytes.write(_pool(sched), pending["slots"], pending["bytes"])
        inj.watch.contents.update(pending["contents"])  # the slots now hold the old KV
        inj.watch.reopen(step)
        inj.detail["landed_on"] = h.rid
        inj.pending = None
        return True
    return False


def _extend_hits(batch):
    if not batch.forward_mode.is_extend():
        return []
    return [r for r in batch.reqs if r.kv.holds_kv and r.prefix_len >= 1]


def read_before_ready(sched, batch, rng, step):
    """sglang #22811: prefix pages handed to a reader while their load is still in flight: the
    reader's prefill sees the pages' old bytes; the load lands right after the forward. Victims:
    this forward's readers of the page; its other holders read it later, intact: exposed."""
    ps = _ps(sched)
    pool = _pool(sched)
    for req in _extend_hits(batch):
        n = req.prefix_len // ps
        if n < 1:
            continue
        lp = rng.randrange(n)
        slots = _page_slots(sched, req, lp)
        saved = kvbytes.snapshot(pool, slots)
        kvbytes.zero(pool, slots)  # "not loaded yet"
        watch = Watch(ps, step, _page_contents(sched, req, lp, batch))
        watch.transient = dict.fromkeys(slots.tolist(), Garbage("not_ready"))
        return Injection(
            "read_before_ready",
            step,
            watch,
            {"rid": req.rid, "page": int(slots[0]) // ps},
            after_forward=lambda s=slots, b=saved: kvbytes.write(pool, s, b),
        )
    return None


def stale_prefix(sched, batch, rng, step):
    """vllm #18957 / TensorRT-LLM #15018: a prefix-cache hit maps to pages holding another prefix."""
    ps = _ps(sched)
    table = _table(sched)
    for req in _extend_hits(batch):
        n = req.prefix_len // ps
        donors = [
            r for r in live_requests(sched, batch) if r is not req and len(r.origin_input_ids) > ps
        ]
        if n < 1 or not donors:
            continue
        lp = rng.randrange(n)
        donor = rng.choice(donors)
        dlp = rng.randrange(len(donor.origin_input_ids) // ps)
        new = _page_slots(sched, donor, dlp)
        old = _page_slots(sched, req, lp)
        if torch.equal(new, old):
            continue
        watch = Watch(ps, step, _page_contents(sched, donor, dlp, batch))
        table[req.kv.req_pool_idx, lp * ps : (lp + 1) * ps] = new.to(table.dtype)
        return Injection(
            "stale_prefix", step, watch, {"rid": req.rid, "logical_page": lp, "donor": donor.rid}
        )
    return None


def shared_write(sched, batch, rng, step):
    """sglang #36743: a request writes its new KV into a page the prefix cache shares. The writer
    is a victim (its own mapping is wrong); the sharers are victims only if the write lands (the
    tracker compares the page's bytes after the forward), else exposed."""
    ps = _ps(sched)
    table = _table(sched)
    positions = batch.seq_lens.to(torch.int64) - 1 if batch.forward_mode.is_decode() else None
    if positions is None:
        return None
    sharers = [r for r in live_requests(sched, batch) if r.kv.cache_protected_len >= ps]
    for i, req in enumerate(batch.reqs):
        pos = int(positions[i])
        if req.finished() or pos % ps or not sharers:
            continue  # a fresh page for this token, so the displaced one can be freed whole
        src = rng.choice(sharers)
        lp = rng.randrange(src.kv.cache_protected_len // ps)
        shared_page = _page_slots(sched, src, lp)
        target = int(shared_page[0])
        watch = Watch(ps, step, _page_contents(sched, src, lp, batch), victims=[req.rid])
        watch.foreign[req.rid] = req
        mine = int(batch.out_cache_loc[i])
        batch.out_cache_loc[i] = target
        table[req.kv.req_pool_idx, pos] = target
        sched.token_to_kv_pool_allocator.free(torch.arange(mine, mine + ps, dtype=torch.int64))
        return Injection("shared_write", step, watch, {"rid": req.rid, "shared_page": target // ps})
    return None


def never_written(sched, batch, rng, step):
    """vllm #54193: a page no forward wrote is published as a prefix-cache hit."""
    ps = _ps(sched)
    table = _table(sched)
    for req in _extend_hits(batch):
        n = req.prefix_len // ps
        if n < 1:
            continue
        fresh = sched.token_to_kv_pool_allocator.alloc(ps)
        if fresh is None:
            return None
        lp = rng.randrange(n)
        table[req.kv.req_pool_idx, lp * ps : (lp + 1) * ps] = fresh.to(table.dtype)
        watch = Watch(ps, step, dict.fromkeys(fresh.tolist(), Garbage("never_written")))

        def tidy(sched, req=req, fresh=fresh):  # the bug leaks the page once its reader is gone
            if not (req.finished() or not req.kv.holds_kv):
                return False
            free_if_orphaned(sched, fresh)
            return True

        return Injection(
            "never_written",
            step,
            watch,
            {"rid": req.rid, "logical_page": lp, "page": int(fresh[0]) // ps},
            cleanup=tidy,
        )
    return None


INJECTORS = {
    "premature_free": premature_free,
    "double_allocation": double_allocation,
    "stale_writer": stale_writer,
    "read_before_ready": read_before_ready,
    "table_redirect": table_redirect,
    "table_swap": table_swap,
    "stale_prefix": stale_prefix,
    "shared_write": shared_write,
    "never_written": never_written,
    "bit_flip": bit_flip,
    "cross_tenant": cross_tenant,  # needs tenant isolation on and a workload with tenants
    "exponent_flip": exponent_flip,
    "in_forward_flip": in_forward_flip,
    "index_key_flip": index_key_flip,  # DSA pools only (POOL_CLASSES)
    "index_key_misplaced": index_key_misplaced,
    "lost_store": lost_store,
    "misdirected_store": misdirected_store,
    "flipped_store": flipped_store,
}

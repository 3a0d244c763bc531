"""Fault injectors: each reproduces the engine-side *mechanism* of a real KV aliasing bug inside a
live SGLang scheduler, through SGLang's own allocator, page table, prefix cache and KV pool, never
through kvguard's ledger. See ../shared/notes/bug-taxonomy.md for the bug classes.

An injector runs just before a batch's forward (``Scheduler.run_batch``), sees the scheduler and the
batch, and returns an ``Injection`` naming the requests whose KV it touched (the oracle's
"affected" set), or None when the moment does not fit (then it is retried at a later step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Injection:
    cls: str
    step: int
    victims: set[str]  # request ids whose KV was touched
    detail: dict = field(default_factory=dict)
    watch_slots: torch.Tensor | None = None  # later holders of these slots are victims too
    after_forward: object = None  # callable run once after this step's forward
    cleanup: object = None  # callable(sched) -> True once the injected mess is tidied (no leak)


def _kv_buffers(sched):
    kv = sched.tp_worker.model_runner.token_to_kv_pool
    return [b for pair in zip(kv.k_buffer, kv.v_buffer) for b in pair]


def _table(sched):
    return sched.req_to_token_pool.req_to_token


def _ps(sched) -> int:
    return sched.token_to_kv_pool_allocator.page_size


def live_requests(sched, batch):
    seen, out = set(), []
    batch_reqs = list(batch.reqs) if batch is not None else []
    for req in (
        batch_reqs
        + list(getattr(sched.running_batch, "reqs", []) or [])
        + list(sched.waiting_queue)
    ):
        if id(req) in seen or not req.kv.holds_kv or req.finished():
            continue
        seen.add(id(req))
        out.append(req)
    return out


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
        if bool(torch.isin(slots, tree.all_values_flatten().to(slots.device, torch.int64)).any()):
            return
    alloc.free(slots)


def _written_page(rng, req, ps, private=False):
    """A full page the request wrote at least two steps ago (sealed, at rest), or None.
    ``private``: only pages past the prefix cache's share of the row."""
    lo = req.kv.cache_protected_len if private else 0
    first, last = -(-lo // ps), (req.kv.kv_committed_len - 2) // ps - 1
    if last < first:
        return None
    return rng.randint(first, last)


def _decode_reqs(batch):
    return [r for r in batch.reqs if not r.finished()] if batch.forward_mode.is_decode() else []


def _page_slots(sched, req, lp):
    ps = _ps(sched)
    return _table(sched)[req.kv.req_pool_idx, lp * ps : (lp + 1) * ps].to(torch.int64).clone()


# -- injectors -----------------------------------------------------------------------------------------
def premature_free(sched, batch, rng, step):
    """sglang #24226 / #18744: a page returned to the free list while its request still reads it."""
    for req in rng.sample(_decode_reqs(batch), len(_decode_reqs(batch))):
        lp = _written_page(rng, req, _ps(sched), private=rng.random() < 0.5)
        if lp is None:
            continue
        slots = _page_slots(sched, req, lp)
        victims = holders(sched, batch, slots)
        sched.token_to_kv_pool_allocator.free(slots)
        return Injection(
            "premature_free",
            step,
            victims,
            {"rid": req.rid, "page": int(slots[0]) // _ps(sched)},
            watch_slots=slots,
        )
    return None


def double_allocation(sched, batch, rng, step):
    """vllm #42571: the same page twice in the free queue; the allocator hands it out again."""
    alloc = sched.token_to_kv_pool_allocator
    for req in rng.sample(_decode_reqs(batch), len(_decode_reqs(batch))):
        lp = _written_page(rng, req, _ps(sched), private=rng.random() < 0.5)
        if lp is None:
            continue
        slots = _page_slots(sched, req, lp)
        page = slots[:1] // _ps(sched)
        alloc.free_pages = torch.cat(
            (page.to(alloc.free_pages.device), alloc.free_pages)
        )  # bypasses free()
        return Injection(
            "double_allocation",
            step,
            holders(sched, batch, slots),
            {"rid": req.rid, "page": int(page)},
            watch_slots=slots,
        )
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
    other = int(table[b.kv.req_pool_idx, rng.randint(0, pb)])
    target = other - other % ps + pos % ps  # same in-page offset: only the owner tag can tell
    if target == int(table[a.kv.req_pool_idx, pos]):
        return None
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
        {a.rid},
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
        table[row, p1], table[row, p2] = s2, s1
        return Injection("table_swap", step, {req.rid}, {"rid": req.rid, "pos": [p1, p2]})
    return None


def bit_flip(sched, batch, rng, step):
    """arXiv 2604.17249: one bit flipped in a resting KV page (memory or DMA corruption)."""
    reqs = _decode_reqs(batch)
    if not reqs:
        return None
    req = rng.choice(reqs)
    n = req.kv.kv_committed_len - 2
    if n < 1:
        return None
    pos = rng.randint(0, n - 1)
    slot = int(_table(sched)[req.kv.req_pool_idx, pos])
    bufs = _kv_buffers(sched)
    buf = bufs[rng.randrange(len(bufs))]
    row = buf[slot].view(torch.uint8).reshape(-1)
    byte, bit = rng.randrange(row.numel()), rng.randrange(8)
    row[byte] ^= 1 << bit
    flipped = torch.tensor([slot])
    # Later holders (a prefix-cache hit on the flipped page) read the flip too: victims as well.
    return Injection(
        "bit_flip",
        step,
        holders(sched, batch, flipped),
        {"rid": req.rid, "slot": slot, "byte": byte, "bit": bit},
        watch_slots=flipped,
    )


def stale_writer(sched, batch, rng, step):
    """GLM-5 PD race / sglang #24527: a transfer issued for one request lands after its pages
    were reused: snapshot a page now, write the old bytes back once another request holds it."""
    reqs = _decode_reqs(batch)
    for req in rng.sample(reqs, len(reqs)):
        lp = _written_page(rng, req, _ps(sched), private=True)
        if lp is None:
            continue
        slots = _page_slots(sched, req, lp)
        stale = [b[slots].clone() for b in _kv_buffers(sched)]
        return Injection(
            "stale_writer",
            step,
            set(),
            {
                "rid": req.rid,
                "page": int(slots[0]) // _ps(sched),
                "pending": {"slots": slots, "bytes": stale, "from": req.rid},
            },
        )
    return None


def land_stale_write(sched, batch, inj: Injection) -> bool:
    """Complete a stale_writer injection once its page is held by a different request."""
    pending = inj.detail["pending"]
    now = holders(sched, batch, pending["slots"]) - {pending["from"]}
    if not now:
        return False
    for buf, old in zip(_kv_buffers(sched), pending["bytes"]):
        buf[pending["slots"]] = old
    inj.victims |= now
    inj.detail["landed_on"] = sorted(now)
    return True


def _extend_hits(batch):
    if not batch.forward_mode.is_extend():
        return []
    return [r for r in batch.reqs if r.kv.holds_kv and r.prefix_len >= 1]


def read_before_ready(sched, batch, rng, step):
    """sglang #22811: prefix pages handed to a reader while their load is still in flight: the
    reader's prefill sees the pages' old bytes; the load lands right after the forward."""
    ps = _ps(sched)
    for req in _extend_hits(batch):
        n = req.prefix_len // ps
        if n < 1:
            continue
        lp = rng.randrange(n)
        slots = _page_slots(sched, req, lp)
        bufs = _kv_buffers(sched)
        saved = [b[slots].clone() for b in bufs]
        for b in bufs:
            b[slots] = torch.zeros_like(b[slots])  # "not loaded yet"

        def land(bufs=bufs, saved=saved, slots=slots):
            for b, s in zip(bufs, saved):
                b[slots] = s

        return Injection(
            "read_before_ready",
            step,
            holders(sched, batch, slots) & {r.rid for r in batch.reqs},
            {"rid": req.rid, "page": int(slots[0]) // ps},
            after_forward=land,
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
        table[req.kv.req_pool_idx, lp * ps : (lp + 1) * ps] = new.to(table.dtype)
        return Injection(
            "stale_prefix",
            step,
            {req.rid},
            {"rid": req.rid, "logical_page": lp, "donor": donor.rid},
        )
    return None


def shared_write(sched, batch, rng, step):
    """sglang #36743: a request writes its new KV into a page the prefix cache shares."""
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
        mine = int(batch.out_cache_loc[i])
        batch.out_cache_loc[i] = target
        table[req.kv.req_pool_idx, pos] = target
        sched.token_to_kv_pool_allocator.free(torch.arange(mine, mine + ps, dtype=torch.int64))
        return Injection(
            "shared_write",
            step,
            holders(sched, batch, shared_page) | {req.rid},
            {"rid": req.rid, "shared_page": target // ps},
            watch_slots=shared_page,
        )
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

        def tidy(sched, req=req, fresh=fresh):  # the bug leaks the page once its reader is gone
            if not (req.finished() or not req.kv.holds_kv):
                return False
            free_if_orphaned(sched, fresh)
            return True

        return Injection(
            "never_written",
            step,
            {req.rid},
            {"rid": req.rid, "logical_page": lp, "page": int(fresh[0]) // ps},
            watch_slots=fresh,
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
}

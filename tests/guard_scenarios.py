"""Engine bugs made on the synthetic pool, one function per scenario, shared by the guard's
semantics tests and the kernel-equivalence tests.

Each scenario runs requests through ``bench.synthetic_pool.SyntheticPool`` and corrupts it the
way an engine bug would (page table, allocator, prefix cache, KV bytes), never through the
guard. It returns the ids of its victims: the requests whose KV went wrong, which a mode that
can see the corruption must abort (and no other). A scenario that changes stored bytes behind
every tag, which only checksums can see, notes when in ``BYTES_CHANGED``: what each mode promises
for it is when its victims are aborted (``tests/test_guard_semantics.py``).
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from synthetic_pool import Request, SyntheticPool

Scenario = Callable[[SyntheticPool], set[str]]


@dataclass(frozen=True, slots=True)
class BytesChanged:
    """Stored bytes changed behind the guard: the pool's step count then (the next forward is
    the first to read them), and the read lengths of the batch that reads them next."""

    step: int
    read_lens: tuple[int, ...]


BYTES_CHANGED: weakref.WeakKeyDictionary[SyntheticPool, BytesChanged] = weakref.WeakKeyDictionary()


def _bytes_changed(pool: SyntheticPool, readers: list[Request]) -> None:
    BYTES_CHANGED[pool] = BytesChanged(pool.step, tuple(r.length for r in readers))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def _two(pool: SyntheticPool, decode: int = 6) -> tuple[Request, Request]:
    """Two requests prefilled over at least two full pages each, then decoding."""
    rng = random.Random(0)
    n = max(40, 2 * pool.ps + 8)
    a = pool.admit(_tokens(rng, 400))
    b = pool.admit(_tokens(rng, 400))
    pool.forward([a, b], [n, n - 3])
    for _ in range(decode):
        pool.forward([a, b], 1)
    return a, b


def _sharer(pool: SyntheticPool, a: Request, extra: int = 10, tokens: list[int] | None = None,
            tenant_seed: int = 0) -> Request:  # fmt: skip
    """A request that hits ``a``'s full pages in the prefix cache."""
    ps = pool.ps
    full = a.length // ps
    pool.share(a, full)
    toks = (tokens if tokens is not None else a.tokens[: full * ps]) + [7] * (60 + ps)
    c = pool.admit(toks, prefix=a, prefix_pages=full, tenant_seed=tenant_seed)
    pool.forward([c], extra, prefix_hit=True)
    return c


def _decode(pool: SyntheticPool, reqs: list[Request], steps: int = 3) -> None:
    for _ in range(steps):
        pool.forward(reqs, 1)


def clean(pool: SyntheticPool) -> set[str]:
    a, b = _two(pool)
    c = _sharer(pool, a)
    _decode(pool, [a, b, c])
    pool.release(b)
    d = pool.admit(_tokens(random.Random(3), 80))
    pool.forward([a, c, d], [1, 1, 20])
    _decode(pool, [a, c, d])
    return set()


def table_redirect(pool: SyntheticPool) -> set[str]:
    """a's page table points one position at b's KV."""
    a, b = _two(pool)
    pool.table[a.row, pool.ps] = b.pages[1] * pool.ps
    _decode(pool, [a, b])
    return {a.rid}


def table_swap(pool: SyntheticPool) -> set[str]:
    """Two entries of a's row swapped (slots out of place)."""
    a, b = _two(pool)
    ps = pool.ps
    i, j = 1, 2 * ps + (1 if ps > 1 else 0)
    ti, tj = int(pool.table[a.row, i]), int(pool.table[a.row, j])
    pool.table[a.row, i], pool.table[a.row, j] = tj, ti
    _decode(pool, [a, b])
    return {a.rid}


def premature_free_reused(pool: SyntheticPool) -> set[str]:
    """a's private page freed while a runs, then handed to d (sglang #24226's mechanism): a is
    the stale holder; d, the new owner, is fine; a's own free later leaves d's page alone."""
    a, b = _two(pool)
    victim = a.pages[1]
    pool.evict([victim])
    pool.free_pages.remove(victim)
    pool.free_pages.insert(0, victim)
    d = pool.admit(_tokens(random.Random(5), 100))
    pool.forward([d], 20)
    _decode(pool, [a, b, d])
    back = pool.release(a)
    assert victim not in back, "the stale holder's free returned the new owner's page"
    _decode(pool, [b, d])
    return {a.rid}


def premature_free_not_reused(pool: SyntheticPool) -> set[str]:
    """a's page freed while a runs but not handed out again: the guard takes it back, a goes on."""
    a, b = _two(pool)
    victim = a.pages[1]
    pool.evict([victim])
    _decode(pool, [a, b])
    assert victim not in pool.free_pages, "a page still read stayed in the free list"
    return set()


def double_allocation(pool: SyntheticPool) -> set[str]:
    """The allocator hands a's page to d while a holds it: d, its last recipient, holds it."""
    a, b = _two(pool)
    pool.next_alloc = [a.pages[1]]
    d = pool.admit(_tokens(random.Random(5), 100))
    pool.forward([d], 20)
    _decode(pool, [a, b, d])
    return {a.rid}


def double_claim_same_step(pool: SyntheticPool) -> set[str]:
    """Two requests handed the same fresh page in one step: the first claim keeps it, the second
    writer's tokens are refused (they never land)."""
    a, b = _two(pool)
    per = -(-10 // pool.ps)  # pages of one 10-token prefill
    page, rest = pool.free_pages[0], pool.free_pages[1:per]
    del pool.free_pages[:per]
    pool.next_alloc = [page, *rest, page]  # d's first page is e's first page too
    rng = random.Random(6)
    d, e = pool.admit(_tokens(rng, 60)), pool.admit(_tokens(rng, 60))
    pool.forward([d, e], [10, 10])
    _decode(pool, [a, b, d])
    return {e.rid}


def shared_write(pool: SyntheticPool) -> set[str]:
    """d's next token is written into a slot of a's shared prefix page: the firewall stops it,
    d is aborted, a and its sharer c keep intact bytes."""
    a, b = _two(pool)
    c = _sharer(pool, a)
    d = pool.admit(_tokens(random.Random(5), 100))
    pool.forward([d], 5 if pool.ps > 1 else 1)
    target = a.pages[0] * pool.ps + d.length % pool.ps
    before = [buf[target].clone() for buf in pool.bufs]
    pool.forward([a, b, c, d], 1, redirect={(d.rid, d.length): target})
    assert all(torch.equal(buf[target], x) for buf, x in zip(pool.bufs, before)), "bad write landed"
    _decode(pool, [a, b, c])
    return {d.rid}


def overwrite(pool: SyntheticPool) -> set[str]:
    """a's next token is written over one of its own sealed slots."""
    a, b = _two(pool)
    target = a.pages[0] * pool.ps  # position 0, sealed long ago
    pool.forward(
        [a, b],
        1,
        redirect={(a.rid, a.length): target if pool.ps == 1 else target + a.length % pool.ps},
    )
    _decode(pool, [b])
    return {a.rid}


def write_unallocated(pool: SyntheticPool) -> set[str]:
    """a claims a page the allocator never handed out (a free page)."""
    a, b = _two(pool, decode=0)
    ps = pool.ps
    # move a to the next page boundary, then send its first token there to a free page
    while a.length % ps:
        pool.forward([a, b], 1)
    page = pool.free_pages.pop()
    pool.forward([a, b], 1, redirect={(a.rid, a.length): page * ps})
    _decode(pool, [b])
    return {a.rid}


def table_mismatch(pool: SyntheticPool) -> set[str]:
    """a's next token goes to the slot it was allocated, but its page table names another slot at
    that position when the guard checks (attention would read other KV there): refused."""
    a, b = _two(pool)
    honest = pool.guard.before_forward

    def lying(view):  # type: ignore[no-untyped-def]
        kept = pool.table[a.row, a.length].clone()
        pool.table[a.row, a.length] = pool.table[b.row, 0]
        try:
            return honest(view)
        finally:
            pool.table[a.row, a.length] = kept

    pool.guard.before_forward = lying  # type: ignore[method-assign]
    _decode(pool, [a, b], steps=1)
    pool.guard.before_forward = honest  # type: ignore[method-assign]
    _decode(pool, [b])
    return {a.rid}


def overwrite_sealed(pool: SyntheticPool) -> set[str]:
    """a's forward runs again over its last position (a replayed step): its token would land on
    its own sealed slot."""
    a, b = _two(pool)
    while pool.ps > 1 and (a.length - 1) % pool.ps == 0:  # not a page's first slot (page size > 1)
        _decode(pool, [a, b], steps=1)
    if pool.ps == 1:  # every slot is a page: the replayed token claims its own sealed page
        a.pages.pop()
    a.length -= 1
    pool.forward([a, b], 1)
    _decode(pool, [b])
    return {a.rid}


def stale_prefix(pool: SyntheticPool) -> set[str]:
    """The prefix cache hands c pages that hold other tokens than c's prompt."""
    a, b = _two(pool)
    other = [t + 1 for t in a.tokens[: (a.length // pool.ps) * pool.ps]]
    c = _sharer(pool, a, tokens=other)
    _decode(pool, [a, b])
    return {c.rid}


def cross_tenant(pool: SyntheticPool) -> set[str]:
    """Tenant B's request is handed tenant A's prefix pages (same tokens, other namespace)."""
    rng = random.Random(0)
    n = max(40, 2 * pool.ps + 8)
    a = pool.admit(_tokens(rng, 400), tenant_seed=11)
    b = pool.admit(_tokens(rng, 400), tenant_seed=11)
    pool.forward([a, b], [n, n - 3])
    _decode(pool, [a, b])
    c = _sharer(pool, a, tenant_seed=22)
    same = _sharer(pool, a, tenant_seed=11)  # the same tenant still hits
    _decode(pool, [a, b, same])
    return {c.rid}


def never_written(pool: SyntheticPool) -> set[str]:
    """The prefix cache publishes a page whose last slots were never written."""
    a, _ = _two(pool, decode=0)
    ps = pool.ps
    if ps == 1:  # a slot allocated for the next token, published before its forward
        a.pages.append(pool.free_pages.pop(0))
        pool.guard.on_alloc(torch.tensor([a.pages[-1]]))
        pool.table[a.row, a.length] = a.pages[-1]
        a.length += 1
    else:
        a.length = (a.length // ps + 1) * ps  # claims the partial page is full
    c = _sharer(pool, a)
    return {c.rid}


def bit_flip_private(pool: SyntheticPool) -> set[str]:
    """A bit of a's private page flips at rest."""
    a, b = _two(pool)
    pool.bufs[0][a.pages[1] * pool.ps, 0, 0] ^= 1
    _bytes_changed(pool, [a, b])
    _decode(pool, [a, b], steps=10)
    return {a.rid}


def bit_flip_shared(pool: SyntheticPool) -> set[str]:
    """A bit of a shared prefix page flips: every reader of it is a victim."""
    a, b = _two(pool)
    c = _sharer(pool, a)
    pool.bufs[2][a.pages[0] * pool.ps, 1, 3] ^= 16
    _bytes_changed(pool, [a, b, c])
    _decode(pool, [a, b, c], steps=10)
    return {a.rid, c.rid}


def read_before_ready(pool: SyntheticPool) -> set[str]:
    """A prefix page's bytes are not what was sealed when c adopts it (a late load)."""
    a, b = _two(pool)
    ps = pool.ps
    full = a.length // ps
    pool.share(a, full)
    saved = pool.bufs[1][a.pages[0] * ps].clone()
    pool.bufs[1][a.pages[0] * ps] ^= 0x5A
    c = pool.admit(a.tokens[: full * ps] + [7] * (60 + ps), prefix=a, prefix_pages=full)
    _bytes_changed(pool, [c])
    pool.forward([c], 10, prefix_hit=True)
    pool.bufs[1][a.pages[0] * ps] = saved  # the load lands
    _decode(pool, [a, b])
    return {c.rid}


def store_never_lands(pool: SyntheticPool) -> set[str]:
    """a's next token's store never lands: its slot keeps the bytes it held (the writer's digest
    is what was meant; a seal hashed from the pool would certify the old bytes)."""
    a, b = _two(pool)
    pool.forward([a, b], 1, astray={(a.rid, a.length): -1})
    _bytes_changed(pool, [a, b])
    _decode(pool, [a, b], steps=10)
    return {a.rid}


def store_lands_elsewhere(pool: SyntheticPool) -> set[str]:
    """a's next token's store lands in b's sealed slot, past the write firewall (which judged the
    slot a was handed): a's slot keeps old bytes, b's holds a's token."""
    a, b = _two(pool)
    pool.forward([a, b], 1, astray={(a.rid, a.length): b.pages[0] * pool.ps + 1})
    _bytes_changed(pool, [a, b])
    _decode(pool, [a, b], steps=10)
    return {a.rid, b.rid}


def store_lands_on_own_token(pool: SyntheticPool) -> set[str]:
    """a's next token's store lands on one of a's own earlier slots."""
    a, b = _two(pool)
    pool.forward([a, b], 1, astray={(a.rid, a.length): a.pages[0] * pool.ps})
    _bytes_changed(pool, [a, b])
    _decode(pool, [a, b], steps=10)
    return {a.rid}


def position_gap(pool: SyntheticPool) -> set[str]:
    """a's forward skips a position (its KV would not line up with its tokens)."""
    a, b = _two(pool)
    a.length += 1
    a.pages += [pool._take_page()] if a.length % pool.ps == 0 else []
    _decode(pool, [a, b], steps=2)
    return {a.rid}


def rebind(pool: SyntheticPool) -> set[str]:
    """The prefix cache replaces c's own copy of a prefix by its identical pages (valid), and
    d's by pages holding other tokens (invalid: d is flagged at its next read)."""
    rng = random.Random(0)
    ps = pool.ps
    m = max(48, 2 * ps + 8)
    a = pool.admit(_tokens(rng, 400))
    pool.forward([a], m)
    pool.share(a)
    c = pool.admit(list(a.tokens))
    pool.forward([c], m)
    d = pool.admit([t + 1 for t in a.tokens])
    pool.forward([d], m)
    n = (m // ps) * ps
    for req in (c, d):
        old = pool.table[req.row, :n].to(torch.int64).clone()
        pool.table[req.row, :n] = pool.table[a.row, :n]
        pool.guard.on_rebind(req.row, 0, old, pool.table[req.row, :n].to(torch.int64))
    _decode(pool, [a, c, d])
    return {d.rid}


SCENARIOS: dict[str, Scenario] = {
    f.__name__: f
    for f in (
        clean, table_redirect, table_swap, premature_free_reused, premature_free_not_reused,
        double_allocation, double_claim_same_step, shared_write, overwrite, write_unallocated,
        table_mismatch, overwrite_sealed,
        stale_prefix, cross_tenant, never_written, bit_flip_private, bit_flip_shared,
        read_before_ready, position_gap, rebind, store_never_lands, store_lands_elsewhere,
        store_lands_on_own_token,
    )
}  # fmt: skip

"""The ledger transitions as Triton kernels: a hand-out (``_alloc_kernel``), a release
(``_release_scatter_kernel`` then ``_release_kernel``) and the step's claims, chains and row
records after the check (``_apply_kernel``).

Reproduces ``guard_ref.alloc_pages``, ``guard_ref.release_pages`` and ``guard_ref.apply_step``.
The per-request transitions (``share_pages``, ``attribute_free``, ``rebind_row``,
``reset_rows``) and ``quarantine_pages``/``reclaim_pages`` have no Triton kernel: off the
per-step path, a CUDA pool runs the reference for them (``backend.per_request``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    _ALLOC,
    _BIG,
    _EV_ALLOC,
    _EV_CLAIM,
    _EV_FREE,
    _FREE,
    _NO_ROW,
    _OREC,
    _OWNED,
    _REFUSED,
    _SHARED,
    _dyn,
    _page_tag,
    _rewrite_helpers,
    _s64,
    _sum,
    _u64,
    _zeros_like,
)

# Triton kernel arguments are pointers and ints that Triton specializes on; annotations other
# than tl.constexpr would change that, so the jitted functions below stay unannotated.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"


# -- on_alloc --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=_dyn("n", "stamp", "num_pages", "step"))
def _alloc_kernel(slots, n, stamps, stamp, p_state, p_prior, p_hist, num_pages, step,
                  PS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n
    s = tl.load(slots + t, mask=m, other=-1).to(tl.int64)
    page = s // PS
    head = m & (s >= 0) & (s % PS == 0) & (page < num_pages)
    prev = tl.atomic_xchg(stamps + page, _zeros_like(page).to(tl.int32) + stamp, mask=head)
    first = head & (prev != stamp)
    packed = (step.to(tl.int64) << 24) | (_EV_ALLOC << 20) | _NO_ROW
    st = tl.load(p_state + page, mask=first, other=0)
    h0 = tl.load(p_hist + page * 4, mask=first, other=0)
    do = first & ~((st == _ALLOC) & (h0 == packed))
    tl.store(p_prior + page, st, mask=do)
    tl.store(p_state + page, _zeros_like(st) + _ALLOC, mask=do)
    push = do & (h0 != packed)
    h1 = tl.load(p_hist + page * 4 + 1, mask=push, other=0)
    h2 = tl.load(p_hist + page * 4 + 2, mask=push, other=0)
    tl.store(p_hist + page * 4, _zeros_like(h0) + packed, mask=push)
    tl.store(p_hist + page * 4 + 1, h0, mask=push)
    tl.store(p_hist + page * 4 + 2, h1, mask=push)
    tl.store(p_hist + page * 4 + 3, h2, mask=push)


# -- release_pages (two launches: first occurrence is the lowest index) ---------------------------
@triton.jit(do_not_specialize=_dyn("n", "num_pages"))
def _release_scatter_kernel(pages, n, winner, num_pages, BLOCK: tl.constexpr):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n
    p = tl.load(pages + t, mask=m, other=-1).to(tl.int64)
    ok = m & (p >= 0) & (p < num_pages)
    tl.atomic_min(winner + p, t.to(tl.int32), mask=ok)


@triton.jit(do_not_specialize=_dyn("n", "num_pages", "step"))
def _release_kernel(pages, n, winner, keep, double, p_state, p_prior, p_hist, num_pages, step,
                    BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = t < n
    p = tl.load(pages + t, mask=m, other=-1).to(tl.int64)
    ok = m & (p >= 0) & (p < num_pages)
    w = tl.load(winner + p, mask=ok, other=-1)
    first = ok & (w == t)
    # only the first occurrence can match, so it alone puts the scratch back at rest
    tl.store(winner + p, _zeros_like(w) + _BIG, mask=first)
    st = tl.load(p_state + p, mask=ok, other=255).to(tl.int32)
    kp = first & ((st == _OWNED) | (st == _SHARED) | (st == _ALLOC))
    tl.store(keep + t, kp.to(tl.int8), mask=m)
    tl.store(double + t, ((st == _FREE) | ~first).to(tl.int8), mask=m)
    tl.store(p_prior + p, st.to(tl.uint8), mask=kp)
    tl.store(p_state + p, _zeros_like(st).to(tl.uint8) + _FREE, mask=kp)
    packed = (step.to(tl.int64) << 24) | (_EV_FREE << 20) | _NO_ROW
    h0 = tl.load(p_hist + p * 4, mask=kp, other=0)
    push = kp & (h0 != packed)
    h1 = tl.load(p_hist + p * 4 + 1, mask=push, other=0)
    h2 = tl.load(p_hist + p * 4 + 2, mask=push, other=0)
    tl.store(p_hist + p * 4, _zeros_like(h0) + packed, mask=push)
    tl.store(p_hist + p * 4 + 1, h0, mask=push)
    tl.store(p_hist + p * 4 + 2, h1, mask=push)
    tl.store(p_hist + p * 4 + 3, h2, mask=push)


# -- apply_step -------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=_dyn("B", "N", "step", "n_wprog", "REV"))
def _apply_kernel(
    p_state, p_prior, p_fill, p_owner, p_ogen, p_lpage, p_epoch, p_chain, p_digest, p_hist,
    r_gen, r_npages, r_agg, r_clen, r_ctail,
    rows, wbatch, wpos, meta, mout, winner, last, targets, wchain, wflags, flags,
    B, N, step, n_wprog, REV,
    PS: tl.constexpr, BW: tl.constexpr, HAS_WB: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if REV:
        pid = tl.num_programs(0) - 1 - pid
    pid = pid.to(tl.int64)
    step64 = step.to(tl.int64) << 24  # scalar int arguments may arrive as int32
    if pid == 0:  # every count of tokens hashed this step is final (check's and seal's)
        tl.store(flags + 3, tl.load(meta) + tl.load(meta + 1))
    if pid < n_wprog:
        j = pid * BW + tl.arange(0, BW)
        mj = j < N
        f = tl.load(wflags + j, mask=mj, other=0)
        ok = (f & 1) != 0
        claim = (f & 2) != 0
        page = tl.load(targets + j, mask=ok, other=0) // PS
        wp = tl.load(wpos + j, mask=claim, other=0).to(tl.int64)
        if HAS_WB:
            b = tl.load(wbatch + j, mask=claim, other=0)
        else:
            b = j
        r = tl.load(rows + b, mask=claim, other=0).to(tl.int64)
        gen = tl.load(r_gen + r, mask=claim, other=0)
        st = tl.load(p_state + page, mask=claim, other=0)
        tl.store(p_prior + page, st, mask=claim)
        tl.store(p_state + page, _zeros_like(st) + _OWNED, mask=claim)
        tl.store(p_epoch + page, step64 | (j + 1), mask=claim)
        tl.store(p_owner + page, r.to(tl.int32), mask=claim)
        tl.store(p_ogen + page, gen, mask=claim)
        tl.store(p_lpage + page, (wp // PS).to(tl.int32), mask=claim)
        tl.store(p_fill + page, _zeros_like(wp).to(tl.int16), mask=claim)
        tl.store(p_digest + page, _zeros_like(wp), mask=claim)
        packed = step64 | (_EV_CLAIM << 20) | (r & _NO_ROW)
        h0 = tl.load(p_hist + page * 4, mask=claim, other=0)
        push = claim & (h0 != packed)
        h1 = tl.load(p_hist + page * 4 + 1, mask=push, other=0)
        h2 = tl.load(p_hist + page * 4 + 2, mask=push, other=0)
        tl.store(p_hist + page * 4, packed, mask=push)
        tl.store(p_hist + page * 4 + 1, h0, mask=push)
        tl.store(p_hist + page * 4 + 2, h1, mask=push)
        tl.store(p_hist + page * 4 + 3, h2, mask=push)
        # the last landing write sets the page's chain (a claimed page's claim landed, so its
        # chain is always set by some landing write); only it can match, so it resets the scratch
        v = tl.load(last + page, mask=ok, other=-1).to(tl.int64)
        is_last = ok & (v == j)
        tl.store(last + page, _zeros_like(v).to(tl.int32) - 1, mask=is_last)
        tl.store(p_chain + page, tl.load(wchain + j, mask=is_last, other=0), mask=is_last)
        tl.store(winner + page, _zeros_like(page).to(tl.int32) + _BIG, mask=(f & 4) != 0)
        tl.store(wflags + j, f | (is_last.to(tl.int8) << 3), mask=mj)
    elif (pid - n_wprog < B) & (tl.load(meta + _REFUSED) == 0):
        b = pid - n_wprog
        mo = mout + b * _OREC
        r = tl.load(rows + b).to(tl.int64)
        n1 = tl.load(mo)
        cl1 = tl.load(mo + 1)
        ct1 = tl.load(mo + 2)
        ws = tl.load(mo + 3)
        we = tl.load(mo + 4)
        agg1 = tl.load(mo + 5)
        claimed = tl.full([], 0, tl.int64)
        tags = _u64(agg1)
        for j0 in range(ws, we, BW):
            j = j0 + tl.arange(0, BW)
            mj = j < we
            claim = mj & ((tl.load(wflags + j, mask=mj, other=0) & 2) != 0)
            wp = tl.load(wpos + j, mask=claim, other=0).to(tl.int64)
            tag = _page_tag(step64 | (j + 1), wp // PS)
            claimed += _sum(claim.to(tl.int64), axis=0)
            tags += _sum(tl.where(claim, tag, 0), axis=0)
        tl.store(r_npages + r, (n1 + claimed).to(tl.int32))
        tl.store(r_agg + r, _s64(tags))
        tl.store(r_clen + r, (cl1 + (we - ws)).to(tl.int32))
        tail = ct1
        if we > ws:
            tail = tl.load(wchain + we - 1)
        tl.store(r_ctail + r, tail)


_rewrite_helpers(globals())  # under the interpreter: the helpers' rewritten bodies

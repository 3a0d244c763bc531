"""The step check as Triton kernels: the verdict of one forward before it runs, and the firewall
of its writes.

Reproduces ``guard_ref.check_step``: ``_prefix_kernel`` (extend steps: each request's own token
chain over its prefix, for rule 1, adoption), ``_read_kernel`` (every page read, the row
checks, the claim scatter, the sweep's verdicts, the clearing of a workspace two steps old) and
``_write_kernel`` (each request's writes in order: claims, chains, the firewall in place on the
write slots; the page-tag comparison; taint and reclaim). The token hashing the check needs is
``triton_seal._hash_kernel``, launched between the prefix and read kernels.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    _ALLOC,
    _BIG,
    _FREE,
    _HDR,
    _OREC,
    _OWNED,
    _QUAR,
    _REC,
    _REFUSED,
    _SHARED,
    _chain_term,
    _cumsum,
    _dyn,
    _lower_bound,
    _max,
    _page_tag,
    _rewrite_helpers,
    _s64,
    _sum,
    _u64,
    _upper_bound,
    _zeros_like,
)
from .triton_seal import _hash_pred, _page_digest

# verdict bits (guard_ref's values)
_TABLE = tl.constexpr(1 << 0)
_MISPLACED = tl.constexpr(1 << 1)
_DOUBLE = tl.constexpr(1 << 2)
_WRONG = tl.constexpr(1 << 3)
_SHAREDW = tl.constexpr(1 << 4)
_OVERWRITE = tl.constexpr(1 << 5)
_UNWRITTEN = tl.constexpr(1 << 6)
_PREFIX = tl.constexpr(1 << 7)
_CHECKSUM = tl.constexpr(1 << 8)
_QPAGE = tl.constexpr(1 << 9)
_ROW = tl.constexpr(1 << 12)
_CB = tl.constexpr(1024)  # pages cleared per iteration

# Triton kernel arguments are pointers and ints that Triton specializes on; annotations other
# than tl.constexpr would change that, so the jitted functions below stay unannotated.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"


@triton.jit
def _or_reduce(bits):
    """OR of an int64 vector of verdict bits (each bit's max: it is either the bit or 0)."""
    out = _max(bits & _TABLE, axis=0) | _max(bits & _MISPLACED, axis=0)
    out = out | _max(bits & _DOUBLE, axis=0) | _max(bits & _WRONG, axis=0)
    out = out | _max(bits & _SHAREDW, axis=0) | _max(bits & _OVERWRITE, axis=0)
    out = out | _max(bits & _UNWRITTEN, axis=0) | _max(bits & _PREFIX, axis=0)
    out = out | _max(bits & _CHECKSUM, axis=0) | _max(bits & _QPAGE, axis=0)
    return out | _max(bits & _ROW, axis=0)


@triton.jit
def _mark(marks, page, mask, MCAP: tl.constexpr):
    """Remember a flagged page so the workspace can be cleared cheaply before its next use."""
    idx = tl.atomic_add(marks + _zeros_like(page), 1, mask=mask)
    tl.store(marks + 1 + idx, page, mask=mask & (idx < MCAP))


# -- check: own chains of prefix-cache hand-offs (extend steps) -----------------------------------
@triton.jit
def _row_results(b, mb, meta, mout, rows, wbatch, r_npages, r_clen, r_ctail, seeds, ptok, expc,
                 B, N, num_rows, nsteps_n, PS: tl.constexpr, HAS_WB: tl.constexpr,
                 HAS_PREFIX: tl.constexpr, HAS_SEEDS: tl.constexpr, BQ: tl.constexpr):  # fmt: skip
    """Per-request results of the row checks (adoption included): n_pages, chain_len, chain_tail,
    the request's write segment; ROW_MISMATCH bits into its kinds. With a prefix, one request
    (b scalar) and its own chain; otherwise a vector of requests."""
    rec = meta + _HDR + b * _REC
    L = tl.load(rec, mask=mb, other=0)
    r = tl.load(rows + b, mask=mb, other=0).to(tl.int64)
    bad_row = mb & ((r < 0) | (r >= num_rows))
    tl.store(meta + _REFUSED + b * 0, b * 0 + 1, mask=bad_row)  # nothing outside the table is read
    mb = mb & ~bad_row
    n0 = tl.load(r_npages + r, mask=mb, other=0).to(tl.int64)
    cl0 = tl.load(r_clen + r, mask=mb, other=0).to(tl.int64)
    ct0 = tl.load(r_ctail + r, mask=mb, other=0)
    np_b = (L + PS - 1) // PS
    bits = _zeros_like(L)
    n1 = n0
    cl1 = cl0
    ct1 = ct0
    if HAS_PREFIX:
        adopting = mb & (np_b > n0)
        if adopting:
            own = tl.full([], 0, tl.uint64)
            if HAS_SEEDS:
                own = _u64(tl.load(seeds + b))
            q0 = tl.load(rec + 2)
            e0 = tl.load(rec + 1)
            for c0 in range(0, L, BQ):
                q = c0 + tl.arange(0, BQ)
                mq = q < L
                tok = tl.load(ptok + q0 + q, mask=mq, other=0)
                term = tl.where(mq, _chain_term(tok, q), 0)
                cs = _cumsum(term, axis=0) + own
                end = mq & (((q + 1) % PS == 0) | (q == L - 1))
                tl.store(expc + e0 + q // PS, _s64(cs), mask=end)
                own = own + _sum(term, axis=0)
            n1 = n0 + (np_b - n0)
            cl1 = L
            ct1 = _s64(own)
            bits = tl.where(cl0 != n0 * PS, bits | _ROW, bits)
            bits = tl.where(L % PS != 0, bits | _ROW, bits)
    bits = tl.where((np_b != n1) | (cl1 != L), bits | _ROW, bits)
    if HAS_WB:
        ws = _lower_bound(wbatch, N, b, nsteps_n)
        we = _lower_bound(wbatch, N, b + 1, nsteps_n)
    else:
        ws = tl.minimum(b, N)
        we = tl.minimum(b + 1, N)
    mo = mout + b * _OREC
    tl.store(mo, n1, mask=mb)
    tl.store(mo + 1, cl1, mask=mb)
    tl.store(mo + 2, ct1, mask=mb)
    tl.store(mo + 3, ws, mask=mb)
    tl.store(mo + 4, we, mask=mb)
    tl.atomic_or(rec + 3, bits, mask=mb & (bits != 0))


@triton.jit(do_not_specialize=_dyn("B", "N", "num_rows", "nsteps_n", "REV"))
def _prefix_kernel(meta, mout, rows, wbatch, r_npages, r_clen, r_ctail, seeds, ptok, expc, B, N,
                   num_rows, nsteps_n, REV, PS: tl.constexpr, HAS_WB: tl.constexpr,
                   HAS_SEEDS: tl.constexpr, BQ: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    if REV:
        pid = tl.num_programs(0) - 1 - pid
    _row_results(pid.to(tl.int64), pid < B, meta, mout, rows, wbatch, r_npages, r_clen, r_ctail,
                 seeds, ptok, expc, B, N, num_rows, nsteps_n, PS, HAS_WB, True, HAS_SEEDS,
                 BQ)  # fmt: skip


# -- check: reads, row checks, claims, sweep, clearing ---------------------------------------------
@triton.jit(
    do_not_specialize=_dyn(
        "pt_stride",
        "B",
        "N",
        "T",
        "num_pages",
        "num_rows",
        "window_start",
        "window_n",
        "sweep_start",
        "sweep_n",
        "n_jobs_e",
        "nsteps_b",
        "nsteps_n",
        "n_entry",
        "n_req",
        "n_claim",
        "n_sweep",
        "REV",
    )
)
def _read_kernel(
    p_state, p_prior, p_fill, p_owner, p_ogen, p_lpage, p_epoch, p_chain, p_digest,
    r_gen, r_npages, r_clen, r_ctail,
    rows, wslots, wbatch, wpos, pt, pt_stride, seeds,
    meta, mout, expc, inner, winner, taint, rtaint, marks, flags,
    c_taint, c_reclaim, c_rtaint, c_marks,
    B, N, T, num_pages, num_rows, window_start, window_n, sweep_start, sweep_n, n_jobs_e,
    nsteps_b, nsteps_n, n_entry, n_req, n_claim, n_sweep, REV,
    PS: tl.constexpr, PSB: tl.constexpr, BE: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
    BS: tl.constexpr, MCAP: tl.constexpr, HAS_WB: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_SEEDS: tl.constexpr, HASH: tl.constexpr, HASH_ALL: tl.constexpr,
    CHECKSUMS: tl.constexpr, VERIFY_ALL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if REV:
        pid = tl.num_programs(0) - 1 - pid
    pid = pid.to(tl.int64)
    if pid < n_entry:
        # ---- read entries: every page read, in batch order ----
        e = pid * BE + tl.arange(0, BE)
        m = e < T
        b = _upper_bound(meta + _HDR + 1, _REC, B, e, nsteps_b) - 1
        b = tl.where(m, b, 0)
        rec = meta + _HDR + b * _REC
        L = tl.load(rec, mask=m, other=0)
        est = tl.load(rec + 1, mask=m, other=0)
        est_next = tl.load(rec + _REC + 1, mask=m, other=0)
        i = e - est
        r = tl.load(rows + b, mask=m, other=0).to(tl.int64)
        m = m & (r >= 0) & (r < num_rows)  # the row checks refuse the step otherwise
        gen = tl.load(r_gen + r, mask=m, other=0)
        n0 = tl.load(r_npages + r, mask=m, other=0).to(tl.int64)
        head = tl.load(pt + r * pt_stride + i * PS, mask=m, other=0).to(tl.int64)
        page = head // PS
        ok = m & (head >= 0) & (page < num_pages)
        tl.store(meta + _REFUSED + e * 0, e * 0 + 1, mask=m & ~ok)  # a slot outside the pool
        st = tl.load(p_state + page, mask=ok, other=255).to(tl.int32)
        pr = tl.load(p_prior + page, mask=ok, other=255).to(tl.int32)
        fill = tl.load(p_fill + page, mask=ok, other=0).to(tl.int64)
        owner = tl.load(p_owner + page, mask=ok, other=-2).to(tl.int64)
        ogen = tl.load(p_ogen + page, mask=ok, other=-2)
        lp = tl.load(p_lpage + page, mask=ok, other=-2).to(tl.int64)
        ep = tl.load(p_epoch + page, mask=ok, other=0)
        mine = (owner == r) & (ogen == gen)
        lpage_ok = lp == i
        head_ok = (head % PS) == 0
        bits = tl.full([BE], 0, tl.int64)
        if PS > 1:  # every position of a page read is that page's slot at its offset
            for o0 in range(0, PS, PSB):
                o = o0 + tl.arange(0, PSB)
                q = i[:, None] * PS + o[None, :]
                qm = m[:, None] & (o[None, :] < PS) & (q < L[:, None])
                v = tl.load(pt + r[:, None] * pt_stride + q, mask=qm, other=0).to(tl.int64)
                bad = qm & (v != page[:, None] * PS + o[None, :])
                out = _max((qm & ((v < 0) | (v >= num_pages * PS))).to(tl.int32), 1) > 0
                tl.store(meta + _REFUSED + e * 0, e * 0 + 1, mask=out)
                bits = tl.where(_max(bad.to(tl.int32), axis=1) > 0, bits | _MISPLACED, bits)
        if HAS_PREFIX:
            cand = m & (i >= n0)
            exp_chain = tl.load(expc + e, mask=cand, other=0)
            pchain = tl.load(p_chain + page, mask=cand & ok, other=0)
            bits = tl.where(cand & (pchain != exp_chain), bits | _PREFIX, bits)
            bits = tl.where(cand & (fill != PS), bits | _UNWRITTEN, bits)
        else:
            cand = m & (i < 0)
        free_ok = (st == _FREE) & (((pr == _OWNED) & mine) | (pr == _SHARED))
        quar = st == _QUAR
        held_ok = ((st == _OWNED) & mine) | (st == _SHARED) | quar | free_ok
        adopt_ok = (st == _SHARED) | ((st == _FREE) & (pr == _SHARED))
        state_ok = tl.where(cand, adopt_ok, held_ok)
        bits = tl.where(~state_ok & ~quar, bits | _WRONG, bits)
        bits = tl.where(cand & quar, bits | _QPAGE, bits)
        bits = tl.where(~lpage_ok | ~head_ok, bits | _MISPLACED, bits)
        need = tl.minimum(L - i * PS, PS)
        bits = tl.where(fill < need, bits | _UNWRITTEN, bits)
        # page-tag sums per request: segments of this block added at their ends
        tag = _page_tag(ep, i)
        first = m & ((e == est) | (e == pid * BE))
        last = m & ((e == est_next - 1) | (e == pid * BE + BE - 1) | (e == T - 1))
        held_t = tl.where(m & ~cand, tag, 0)
        cs = _cumsum(held_t, axis=0)
        tl.atomic_add(rec + 4, _s64(cs), mask=last)
        tl.atomic_add(rec + 4, _s64(_zeros_like(cs) - (cs - held_t)), mask=first)
        if HAS_PREFIX:
            cand_t = tl.where(cand, tag, 0)
            cs = _cumsum(cand_t, axis=0)
            tl.atomic_add(rec + 5, _s64(cs), mask=last)
            tl.atomic_add(rec + 5, _s64(_zeros_like(cs) - (cs - cand_t)), mask=first)
        verified = m & (i < 0)
        if HASH:
            hashed, d = _hash_pred(e, ok, i, n0, fill, T, window_start, window_n, HAS_PREFIX,
                                   CHECKSUMS, VERIFY_ALL)  # fmt: skip
            if HASH_ALL:
                job = e
            else:
                job = d
            dig = _page_digest(inner, job, lp, fill, hashed, PS, PSB)
            pd = tl.load(p_digest + page, mask=hashed, other=0)
            bad = hashed & (_s64(dig) != pd)
            bits = tl.where(bad, bits | _CHECKSUM, bits)
            tl.store(taint + page, _zeros_like(page).to(tl.uint8) + 1, mask=bad)
            tl.store(rtaint + page, _zeros_like(page).to(tl.uint8) + 1, mask=bad)
            _mark(marks, page, bad, MCAP)
            tl.store(flags + 1 + _zeros_like(page), _zeros_like(page) + 1, mask=bad)
            tl.store(meta + 2 + _zeros_like(page), _zeros_like(page) + 1, mask=bad)
            tl.atomic_add(meta, _sum(tl.where(hashed, fill, 0), axis=0))
            if VERIFY_ALL:
                verified = hashed & ~bad
        bits = tl.where(quar & ~cand & ~verified, bits | _QPAGE, bits)
        efree = m & free_ok & lpage_ok & head_ok & (fill >= need)
        tl.store(meta + 3 + _zeros_like(page), _zeros_like(page) + 1, mask=efree)
        tl.atomic_or(rec + 3, bits, mask=m & (bits != 0))
    elif pid < n_entry + n_req:
        # ---- row checks (no prefix this step: nothing adopted) ----
        bb = (pid - n_entry) * BR + tl.arange(0, BR)
        _row_results(bb, bb < B, meta, mout, rows, wbatch, r_npages, r_clen, r_ctail, seeds, 0,
                     expc, B, N, num_rows, nsteps_n, PS, HAS_WB, False, HAS_SEEDS,
                     16)  # fmt: skip
    elif pid < n_entry + n_req + n_claim:
        # ---- claims: the first claim of a page in the step wins ----
        j = (pid - n_entry - n_req) * BW + tl.arange(0, BW)
        mj = j < N
        t = tl.load(wslots + j, mask=mj, other=-1).to(tl.int64)
        wp = tl.load(wpos + j, mask=mj, other=0).to(tl.int64)
        if HAS_WB:  # requests in range and in batch order
            wb = tl.load(wbatch + j, mask=mj, other=0)
            wb_prev = tl.load(wbatch + j - 1, mask=mj & (j > 0), other=0)
            bad_b = (wb < 0) | (wb >= B) | (wb < wb_prev)
        else:
            bad_b = j >= B
        bad = mj & ((t < 0) | (t >= num_pages * PS) | (wp < 0) | bad_b)
        tl.store(meta + _REFUSED + j * 0, j * 0 + 1, mask=bad)
        woff = t % PS
        claim = mj & ~bad & (woff == 0) & (woff == wp % PS)
        tl.atomic_min(winner + t // PS, j.to(tl.int32), mask=claim)
    elif pid < n_entry + n_req + n_claim + n_sweep:
        # ---- sweep of resting pages: verdicts of the hashes ----
        k = (pid - n_entry - n_req - n_claim) * BS + tl.arange(0, BS)
        mk = k < sweep_n
        page = (sweep_start + k) % num_pages
        st = tl.load(p_state + page, mask=mk, other=0)
        fill = tl.load(p_fill + page, mask=mk, other=0).to(tl.int64)
        lp = tl.load(p_lpage + page, mask=mk, other=0).to(tl.int64)
        live = mk & ((st == _OWNED) | (st == _SHARED)) & (fill > 0)
        dig = _page_digest(inner, n_jobs_e + k, lp, fill, live, PS, PSB)
        pd = tl.load(p_digest + page, mask=live, other=0)
        bad = live & (_s64(dig) != pd)
        tl.store(taint + page, _zeros_like(page).to(tl.uint8) + 1, mask=bad)
        tl.store(rtaint + page, _zeros_like(page).to(tl.uint8) + 1, mask=bad)
        _mark(marks, page, bad, MCAP)
        tl.store(flags + 1 + _zeros_like(page), _zeros_like(page) + 1, mask=bad)
        tl.store(meta + 2 + _zeros_like(page), _zeros_like(page) + 1, mask=bad)
        tl.atomic_add(meta, _sum(tl.where(live, fill, 0), axis=0))
    else:
        # ---- the workspace of two steps ago (its verdict is read): clear what it flagged ----
        cnt = tl.load(c_marks)
        if cnt > MCAP:
            for p0 in range(0, num_pages, _CB):
                p = p0 + tl.arange(0, _CB)
                mp = p < num_pages
                z = tl.full([_CB], 0, tl.uint8)
                tl.store(c_taint + p, z, mask=mp)
                tl.store(c_reclaim + p, z, mask=mp)
                tl.store(c_rtaint + p, z, mask=mp)
        else:
            for k0 in range(0, cnt, _CB):
                k = k0 + tl.arange(0, _CB)
                mk = k < cnt
                p = tl.load(c_marks + 1 + k, mask=mk, other=0)
                z = tl.full([_CB], 0, tl.uint8)
                tl.store(c_taint + p, z, mask=mk)
                tl.store(c_reclaim + p, z, mask=mk)
                tl.store(c_rtaint + p, z, mask=mk)
        tl.store(c_marks, cnt * 0)


# -- check: writes, row tags, taint and reclaim (one program per request) -------------------------
@triton.jit
def _entry_efree(pt, pt_stride, r, gen, L, i, mi, p_state, p_prior, p_fill, p_owner, p_ogen,
                 p_lpage, num_pages, PS: tl.constexpr):  # fmt: skip
    head = tl.load(pt + r * pt_stride + i * PS, mask=mi, other=0).to(tl.int64)
    page = head // PS
    ok = mi & (head >= 0) & (page < num_pages)
    st = tl.load(p_state + page, mask=ok, other=255).to(tl.int32)
    pr = tl.load(p_prior + page, mask=ok, other=255).to(tl.int32)
    fill = tl.load(p_fill + page, mask=ok, other=0).to(tl.int64)
    owner = tl.load(p_owner + page, mask=ok, other=-2).to(tl.int64)
    ogen = tl.load(p_ogen + page, mask=ok, other=-2)
    lp = tl.load(p_lpage + page, mask=ok, other=-2).to(tl.int64)
    mine = (owner == r) & (ogen == gen)
    free_ok = (st == _FREE) & (((pr == _OWNED) & mine) | (pr == _SHARED))
    need = tl.minimum(L - i * PS, PS)
    return page, ok, ok & free_ok & (lp == i) & (head % PS == 0) & (fill >= need)


@triton.jit(
    do_not_specialize=_dyn("pt_stride", "pt_width", "B", "N", "num_pages", "pad_slot", "REV")
)
def _write_kernel(
    p_state, p_prior, p_fill, p_owner, p_ogen, p_lpage,
    r_gen, r_agg,
    rows, wslots, wbatch, wpos, wtok, pt, pt_stride, pt_width, seeds,
    meta, mout, winner, last, top, targets, wchain, wflags, taint, reclaim, rtaint, marks, flags,
    B, N, num_pages, pad_slot, REV,
    PS: tl.constexpr, BE: tl.constexpr, BW: tl.constexpr, MCAP: tl.constexpr,
    HAS_WB: tl.constexpr, HAS_SEEDS: tl.constexpr, CHECKSUMS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if REV:
        pid = tl.num_programs(0) - 1 - pid
    b = pid.to(tl.int64)
    if tl.load(meta + _REFUSED) != 0:
        # refused (an index outside the pool or table): every write of the step goes to the
        # padding slot, no transition follows (apply and seal see no landed write), and reading
        # the verdict raises. Program b takes its share of the writes, whoever they belong to.
        nprog = tl.num_programs(0)
        per = (N + nprog - 1) // nprog
        for j0 in range(b * per, tl.minimum(b * per + per, N), BW):
            j = j0 + tl.arange(0, BW)
            mj = j < tl.minimum(b * per + per, N)
            t = tl.load(wslots + j, mask=mj, other=-1).to(tl.int64)
            wp = tl.load(wpos + j, mask=mj, other=0).to(tl.int64)
            tl.store(targets + j, t, mask=mj)
            tl.store(wflags + j, tl.full([BW], 0, tl.int8), mask=mj)
            tl.store(wslots + j, (t * 0 + pad_slot).to(wslots.dtype.element_ty), mask=mj)
            put_back = mj & (t >= 0) & (t < num_pages * PS) & (t % PS == 0) & (wp >= 0)
            tl.store(winner + t // PS, tl.full([BW], 0, tl.int32) + _BIG, mask=put_back)
        tl.store(flags + 4, b * 0 + 1)
        return
    rec = meta + _HDR + b * _REC
    mo = mout + b * _OREC
    L = tl.load(rec)
    bits = tl.load(rec + 3)
    acc = tl.load(rec + 4)
    adopted = tl.load(rec + 5)
    r = tl.load(rows + b).to(tl.int64)
    gen = tl.load(r_gen + r)
    agg0 = tl.load(r_agg + r)
    n1 = tl.load(mo)
    cl1 = tl.load(mo + 1)
    ct1 = tl.load(mo + 2)
    ws = tl.load(mo + 3)
    we = tl.load(mo + 4)
    np_b = (L + PS - 1) // PS
    if acc != agg0:
        bits = bits | _WRONG
    tl.store(mo + 5, _s64(_u64(agg0) + _u64(adopted)))
    # readers of content found bad by this step's hashes (rare: only once one failed)
    if tl.load(meta + 2) != 0:
        for i0 in range(0, np_b, BE):
            i = i0 + tl.arange(0, BE)
            mi = i < np_b
            head = tl.load(pt + r * pt_stride + i * PS, mask=mi, other=0).to(tl.int64)
            page = head // PS
            okp = mi & (head >= 0) & (page < num_pages)
            rt = tl.load(rtaint + page, mask=okp, other=0).to(tl.int32)
            if _max(rt, axis=0) > 0:
                bits = bits | _QPAGE
    # writes, in order
    base = ct1
    if cl1 <= 0:
        base = ct1 * 0
        if HAS_SEEDS:
            base = tl.load(seeds + b)
    carry = _u64(base)
    nok = tl.full([], 0, tl.int64)
    for j0 in range(ws, we, BW):
        j = j0 + tl.arange(0, BW)
        mj = j < we
        t = tl.load(wslots + j, mask=mj, other=0).to(tl.int64)
        wp = tl.load(wpos + j, mask=mj, other=0).to(tl.int64)
        tok = tl.load(wtok + j, mask=mj, other=0)
        wpage = t // PS
        woff = t % PS
        wlp = wp // PS
        pos_ok = wp == cl1 + (j - ws)
        ptv = tl.load(pt + r * pt_stride + tl.minimum(wp, pt_width - 1), mask=mj, other=-1)
        table_ok = (wp < pt_width) & (ptv.to(tl.int64) == t)
        in_place = woff == wp % PS
        claim = (woff == 0) & in_place
        okp = mj & (t >= 0) & (wpage < num_pages)
        wst = tl.load(p_state + wpage, mask=okp, other=255).to(tl.int32)
        fillp = tl.load(p_fill + wpage, mask=okp, other=0).to(tl.int64)
        owner = tl.load(p_owner + wpage, mask=okp, other=-2).to(tl.int64)
        ogen = tl.load(p_ogen + wpage, mask=okp, other=-2)
        lpp = tl.load(p_lpage + wpage, mask=okp, other=-2).to(tl.int64)
        win = tl.load(winner + wpage, mask=okp, other=_BIG).to(tl.int64)
        is_winner = claim & (win == j)
        claim_ok = is_winner & (wst == _ALLOC) & table_ok & pos_ok
        wmine = (owner == r) & (ogen == gen)
        held_before = (wst == _OWNED) & wmine & (lpp == wlp) & (wlp < n1) & (woff >= fillp)
        # held now: this step's winning claim w of the page is an earlier write of this request
        # at the same logical page and it landed (w's target is the page's first slot)
        has_w = mj & (win < j)
        w = tl.minimum(win, N - 1)
        if HAS_WB:
            bw = tl.load(wbatch + w, mask=has_w, other=-1)
        else:
            bw = w
        wpw = tl.load(wpos + w, mask=has_w, other=0).to(tl.int64)
        ptw = tl.load(pt + r * pt_stride + tl.minimum(wpw, pt_width - 1), mask=has_w, other=-1)
        claim_ok_w = ((wst == _ALLOC) & (wpw < pt_width) & (ptw.to(tl.int64) == wpage * PS)
                      & (wpw == cl1 + (w - ws)))  # fmt: skip
        held_now = has_w & (bw == b) & (wpw // PS == wlp) & claim_ok_w
        held = held_before | held_now
        cont_ok = ~claim & in_place & table_ok & pos_ok & held
        write_ok = mj & (claim_ok | cont_ok)
        k = tl.full([BW], 0, tl.int64)
        k = tl.where(~table_ok, k | _TABLE, k)
        k = tl.where(~in_place, k | _MISPLACED, k)
        k = tl.where(~pos_ok, k | _ROW, k)
        k = tl.where(claim & (wst == _OWNED), k | _DOUBLE, k)
        k = tl.where(claim & (wst == _ALLOC) & ~is_winner, k | _DOUBLE, k)
        k = tl.where(claim & (wst == _SHARED), k | _SHAREDW, k)
        k = tl.where(claim & (wst == _QUAR), k | _QPAGE, k)
        k = tl.where(claim & (wst == _FREE), k | _WRONG, k)
        not_held = ~claim & ~held
        overwrite = not_held & (wst == _OWNED) & wmine & (lpp == wlp) & (woff < fillp)
        k = tl.where(not_held & (wst == _SHARED), k | _SHAREDW, k)
        k = tl.where(overwrite, k | _OVERWRITE, k)
        k = tl.where(not_held & (wst != _SHARED) & ~overwrite, k | _WRONG, k)
        bits = bits | _or_reduce(tl.where(mj, k, 0))
        term = tl.where(mj, _chain_term(tok, wp), 0)
        chain = carry + _cumsum(term, axis=0)
        carry = carry + _sum(term, axis=0)
        f = write_ok.to(tl.int8) | (claim_ok.to(tl.int8) << 1) | (is_winner.to(tl.int8) << 2)
        tl.store(targets + j, t, mask=mj)
        tl.store(wchain + j, _s64(chain), mask=mj)
        tl.store(wflags + j, f, mask=mj)
        tl.store(wslots + j, (t * 0 + pad_slot).to(wslots.dtype.element_ty), mask=mj & ~write_ok)
        tl.atomic_max(last + wpage, j.to(tl.int32), mask=write_ok)
        tl.atomic_max(top + wpage, (woff + 1).to(tl.int32), mask=write_ok)
        nok += _sum(write_ok.to(tl.int64), axis=0)
    tl.store(rec + 3, bits)
    if CHECKSUMS:
        tl.atomic_add(meta + 1, nok)
    if bits != 0:
        # a flagged request's landed writes were computed from KV it should not have read
        tl.store(flags, bits * 0 + 1)
        tl.debug_barrier()
        for j0 in range(ws, we, BW):
            j = j0 + tl.arange(0, BW)
            mj = j < we
            ok = mj & ((tl.load(wflags + j, mask=mj, other=0) & 1) != 0)
            page = tl.load(targets + j, mask=ok, other=0) // PS
            tl.store(taint + page, _zeros_like(page).to(tl.uint8) + 1, mask=ok)
            _mark(marks, page, ok, MCAP)
            tl.store(flags + 1 + _zeros_like(page), _zeros_like(page) + 1, mask=ok)
    elif tl.load(meta + 3) != 0:
        # freed pages a clean reader still validly holds: take them back (a premature free)
        for i0 in range(0, np_b, BE):
            i = i0 + tl.arange(0, BE)
            mi = i < np_b
            page, okp, efree = _entry_efree(pt, pt_stride, r, gen, L, i, mi, p_state, p_prior,
                                            p_fill, p_owner, p_ogen, p_lpage, num_pages, PS)  # fmt: skip
            tl.store(reclaim + page, _zeros_like(page).to(tl.uint8) + 1, mask=efree)
            _mark(marks, page, efree, MCAP)
            tl.store(flags + 2 + _zeros_like(page), _zeros_like(page) + 1, mask=efree)


_rewrite_helpers(globals())  # under the interpreter: the helpers' rewritten bodies

"""The Triton backend: the guard's step check, transitions and seal as a few fused GPU kernels,
bit-identical to the torch reference (``guard_ref``, the specification; every rule here is a
line there) and written so that no device value is read on the host before the verdict.

Launches per step (each one grid; sizes come from host ints already in ``StepInputs``):

* ``on_alloc``: one (``_alloc_kernel``: the first arrival at a page in the call applies it, by
  an atomic exchange of a per-call stamp, so a page repeated in one call is handed out once).
* ``check_step``: one host-to-device copy of the step's small metadata (prefix lengths, entry and
  token offsets, zeroed accumulators), then
  - ``_prefix_kernel`` (extend steps only): each request's own token chain over its prefix, the
    expected chain of every page it would adopt;
  - ``_hash_kernel`` (checksum modes, when pages are hashed this step): partial KV sums of every
    hashed token, split over buffer groups for parallelism (wrapping sums, so the split is exact);
  - ``_read_kernel``: one program per block of read-page entries (the batch's entries laid end to
    end; a program finds its entries' requests by binary search over their offsets), plus the
    per-request row checks (decode), the claim scatter (first claim of a page: atomic min of the
    write index), the sweep's verdicts and the clearing of the workspace two steps old. Per-
    request sums (page tags) are reduced in the program and added at segment ends.
  - ``_write_kernel``: one program per request: its writes' checks, claims, chains and the
    firewall (in place on the engine's write slots), the row-tag comparison, then (rare paths)
    readers of pages found bad, taint of a flagged request's landed writes, reclaim.
* ``apply_step``: one (``_apply_kernel``: claims, the last landing write's page chain, rows).
* ``seal_step``: one in tags mode (``_seal_kernel``: fill), two with checksums (``_hash_kernel``
  over the landed writes, then ``_seal_kernel`` adds their digests).
* ``release_pages`` (not per step): two (the first occurrence of a page is its lowest index: an
  atomic min, then the transitions).

A decode step launches 4 kernels in tags mode and 6 with checksums (one more on a step that
allocates a page), plus the one copy of its metadata: with the guard's own operators around
them (its epoch snapshot: 8) that is 13-15 dispatches in tags and 15-17 in sampled and paranoid,
at any batch size and context (``tests/test_guard_triton.py``). The verdict's flags (any request
flagged, any page tainted, any to reclaim, refused, tokens hashed) are written by the kernels
straight into pinned host memory where the device can map it (checked once at bind; otherwise
one small copy when read), so ``StepCheck.flags()`` after the engine's own sync costs nothing.

State the backend keeps (``workspace_bytes``): 25 bytes per pool page, 4 int32 scratch words
(claim winner, last landing write, highest landed offset: back at rest after every step; the
stamp of the page's last hand-out call) and, in each of three step workspaces, 3 flag bytes
(taint, reclaim, read taint); plus per-step arrays (metadata, write outputs, hash scratch) grown
to the largest step seen. Three workspaces, not two: the overlap scheduler checks step N + 1
before it reads step N's verdict, and a workspace is cleared during the step before its next use,
inside the read kernel, where no launch is added.

Out-of-range input (a row outside the table, a page-table slot or write outside the pool, a
negative position, a write batch out of order): the reference refuses the step with ValueError
before reading anything. Here the read kernels find it (every load is masked, so nothing outside
the pool or table is read), the write kernel sends all the step's writes to the padding slot,
apply and seal change nothing, and the ValueError is raised when the verdict is read (on the CPU
in the check, as the reference; on a GPU at resolve, after the engine's sync).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from .guard_ref import CheckParams, StepCheck, StepInputs
from .guard_state import EPOCH_STEP_SHIFT, HISTORY, NO_ROW, PageArrays, PageState, RowArrays
from .kv_checksum_ref import (
    FMIX_M1,
    FMIX_M2,
    POS_SEED,
    SM_GAMMA,
    SM_M1,
    SM_M2,
    _row_word_views,
    word_constants,
)

_I64 = torch.int64
_I32 = torch.int32
_BIG32 = (1 << 31) - 1  # claim winner at rest (no claim)
HDR = 16  # header: hashed (check, seal), any read taint, any free read, refused; 8..12: flags
REC = 6  # metadata words per request: L, entry start, token start, kinds, held-tag sum, adopted sum
OREC = 8  # per-request results: n_pages, chain_len, chain_tail, write start, write end, agg
MCAP = 4096  # pages a workspace remembers having flagged (beyond: the whole array is cleared)
assert HISTORY == 4 and EPOCH_STEP_SHIFT == 24

# Globals used inside @triton.jit must be constexpr; values >= 2**63 become uint64 constants.
_GOLDEN = tl.constexpr(SM_GAMMA)
_SM1 = tl.constexpr(SM_M1)
_SM2 = tl.constexpr(SM_M2)
_FM1 = tl.constexpr(FMIX_M1)
_FM2 = tl.constexpr(FMIX_M2)
_POS = tl.constexpr(POS_SEED)
_HDR = tl.constexpr(HDR)
_REC = tl.constexpr(REC)
_OREC = tl.constexpr(OREC)
_BIG = tl.constexpr(_BIG32)
_NO_ROW = tl.constexpr(NO_ROW)
_FREE = tl.constexpr(int(PageState.FREE))
_OWNED = tl.constexpr(int(PageState.OWNED))
_SHARED = tl.constexpr(int(PageState.SHARED))
_QUAR = tl.constexpr(int(PageState.QUARANTINED))
_ALLOC = tl.constexpr(int(PageState.ALLOCATED))
_EV_CLAIM = tl.constexpr(1)
_EV_FREE = tl.constexpr(4)
_EV_ALLOC = tl.constexpr(6)
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
_REFUSED = tl.constexpr(4)  # header word: the step names an index outside the pool or table
_CB = tl.constexpr(1024)  # pages cleared per iteration

# Triton kernel arguments are pointers and ints that Triton specializes on; annotations other
# than tl.constexpr would change that, so the jitted functions below stay unannotated.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"


def _dyn(*names: str) -> list[str]:
    """Arguments that change from step to step: never specialized (Triton compiles a variant for
    an integer equal to 1 or divisible by 16; a serving step must not trigger a compile)."""
    return list(names)


# Reductions and zeros through the builtins they wrap (triton.language's own wrappers are jitted
# functions, which the interpreter re-patches at every call; compiled, both are the same code).
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def _zeros_like(x):
    return tl.full(x.shape, 0, x.dtype)


# -- hashes (all uint64, wrapping) ---------------------------------------------------------------
@triton.jit
def _u64(x):
    return x.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def _s64(x):
    return x.to(tl.int64, bitcast=True)


@triton.jit
def _splitmix64(x):
    z = x + _GOLDEN
    z = (z ^ (z >> 30)) * _SM1
    z = (z ^ (z >> 27)) * _SM2
    return z ^ (z >> 31)


@triton.jit
def _fmix64(x):
    x = x ^ (x >> 33)
    x = x * _FM1
    x = x ^ (x >> 33)
    x = x * _FM2
    return x ^ (x >> 33)


@triton.jit
def _page_tag(epoch, lpage):
    return _fmix64(_u64(epoch) * _GOLDEN + _u64(lpage))


@triton.jit
def _chain_term(tok, pos):
    return _splitmix64(_u64(tok) * _GOLDEN + _u64(pos))


@triton.jit
def _poskey(pos):
    return _splitmix64(_u64(pos) + _POS)


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
def _upper_bound(base, stride, n, x, nsteps):
    """First k in [0, n) with base[k * stride] > x (n if none); base ascending."""
    lo = _zeros_like(x)
    hi = _zeros_like(x) + n
    for _ in range(nsteps):
        act = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(base + mid * stride, mask=act, other=0)
        right = act & (v <= x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(act & ~right, mid, hi)
    return lo


@triton.jit
def _lower_bound(base, n, x, nsteps):
    """First k in [0, n) with base[k] >= x (n if none); base ascending."""
    lo = _zeros_like(x)
    hi = _zeros_like(x) + n
    for _ in range(nsteps):
        act = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(base + mid, mask=act, other=0)
        right = act & (v < x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(act & ~right, mid, hi)
    return lo


@triton.jit
def _mark(marks, page, mask, MCAP: tl.constexpr):
    """Remember a flagged page so the workspace can be cleared cheaply before its next use."""
    idx = tl.atomic_add(marks + _zeros_like(page), 1, mask=mask)
    tl.store(marks + 1 + idx, page, mask=mask & (idx < MCAP))


@triton.jit
def _token_inner(kv_base, kv_tab, kv_consts, wmax, nbuf, slot, mask, g, G, BT: tl.constexpr,
                 BWORD: tl.constexpr, WCONST: tl.constexpr, ALIGN: tl.constexpr):  # fmt: skip
    """Partial inner sums of tokens at ``slot`` over buffers g, g + G, ...: [BT] uint64.
    kv_tab[b] = (word offset of buffer b from buffer 0, words per row, row stride in words).
    Each word w times its odd constant C = lo + hi * 2**32 is summed as w * lo (one widening
    32-bit multiply) plus (w * hi mod 2**32) * 2**32: the same value mod 2**64. WCONST: every
    row has this many words, a multiple of BWORD (unmasked, vectorizable word loads); ALIGN:
    rows start at multiples of this many words."""
    lo_acc = tl.full([BT, BWORD], 0, tl.uint64)
    hi_acc = tl.full([BT, BWORD], 0, tl.uint32)
    cols = tl.arange(0, BWORD)
    for bi in range(g, nbuf, G):
        off = tl.load(kv_tab + bi * 3)
        stride = tl.load(kv_tab + bi * 3 + 2)
        start = off + slot * stride
        if ALIGN > 1:
            start = tl.multiple_of(start, ALIGN)
        row = kv_base + start
        if WCONST > 0:
            for w0 in range(0, WCONST, BWORD):
                cw = w0 + cols
                c = tl.load(kv_consts + bi * wmax + cw).to(tl.uint64, bitcast=True)
                x = tl.load(row[:, None] + cw[None, :], mask=mask[:, None], other=0)
                x = x.to(tl.uint32, bitcast=True)
                lo_acc += x.to(tl.uint64) * (c & 0xFFFFFFFF)[None, :]
                hi_acc += x * (c >> 32).to(tl.uint32)[None, :]
        else:
            w = tl.load(kv_tab + bi * 3 + 1)
            for w0 in range(0, w, BWORD):
                cw = w0 + cols
                mw = cw < w
                c = tl.load(kv_consts + bi * wmax + cw, mask=mw, other=0)
                c = c.to(tl.uint64, bitcast=True)
                x = tl.load(row[:, None] + cw[None, :], mask=mask[:, None] & mw[None, :], other=0)
                x = x.to(tl.uint32, bitcast=True)
                lo_acc += x.to(tl.uint64) * (c & 0xFFFFFFFF)[None, :]
                hi_acc += x * (c >> 32).to(tl.uint32)[None, :]
    return _sum(lo_acc, axis=1) + (_sum(hi_acc, axis=1).to(tl.uint64) << 32)


@triton.jit
def _page_digest(inner, job, lp, fill, hashed, PS: tl.constexpr, PSB: tl.constexpr):
    """Finish the digests of hashed pages (job rows of the inner scratch), zeroing the scratch."""
    dig = tl.full(job.shape, 0, tl.uint64)
    for o0 in range(0, PS, PSB):
        o = o0 + tl.arange(0, PSB)
        om = hashed[:, None] & (o[None, :] < fill[:, None])
        u = job[:, None] * PS + o[None, :]
        inn = tl.load(inner + u, mask=om, other=0)
        d = _fmix64(_u64(inn) ^ _poskey(tl.maximum(lp, 0)[:, None] * PS + o[None, :]))
        dig += _sum(tl.where(om, d, 0), axis=1)
        tl.store(inner + u, _zeros_like(inn), mask=om)
    return dig


@triton.jit
def _hash_pred(e, m, i, n0, fill, T, window_start, window_n, HAS_PREFIX: tl.constexpr,
               CHECKSUMS: tl.constexpr, VERIFY_ALL: tl.constexpr):  # fmt: skip
    """Is read entry e hashed this step (hand-off, verify-all, window; sealed tokens only)?"""
    d = ((e - window_start) % T + T) % T
    h = m & (d < window_n)
    if VERIFY_ALL:
        h = m
    if CHECKSUMS and HAS_PREFIX:
        h = h | (m & (i >= n0))
    return h & (fill > 0), d


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


# -- check and seal: partial KV sums of hashed tokens ---------------------------------------------
@triton.jit(
    do_not_specialize=_dyn(
        "wmax",
        "nbuf",
        "n_units",
        "G",
        "REV",
        "pt_stride",
        "B",
        "T",
        "num_pages",
        "num_rows",
        "window_start",
        "window_n",
        "n_jobs_e",
        "sweep_start",
        "nsteps_b",
    )
)
def _hash_kernel(kv_base, kv_tab, kv_consts, wmax, nbuf, inner, n_units, G, REV,
                 # read entries and sweep (check) ...
                 meta, rows, pt, pt_stride, r_npages, p_state, p_fill, B, T, num_pages, num_rows,
                 window_start, window_n, n_jobs_e, sweep_start, nsteps_b,
                 # ... or landed writes (seal)
                 wflags, targets,
                 SEAL: tl.constexpr, PS: tl.constexpr, HASH_ALL: tl.constexpr,
                 HAS_PREFIX: tl.constexpr, CHECKSUMS: tl.constexpr, VERIFY_ALL: tl.constexpr,
                 BT: tl.constexpr, BWORD: tl.constexpr, WCONST: tl.constexpr,
                 ALIGN: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    g = tl.program_id(1)
    if REV:
        pid = tl.num_programs(0) - 1 - pid
        g = G - 1 - g
    u = pid.to(tl.int64) * BT + tl.arange(0, BT)
    mu = u < n_units
    if SEAL:
        f = tl.load(wflags + u, mask=mu, other=0)
        mt = mu & ((f & 1) != 0)
        slot = tl.load(targets + u, mask=mt, other=0)
    else:
        job = u // PS
        o = u % PS
        is_e = job < n_jobs_e
        me = mu & is_e
        if HASH_ALL:
            e = job
        else:
            e = (window_start + job) % T
        b = _upper_bound(meta + _HDR + 1, _REC, B, e, nsteps_b) - 1
        b = tl.where(me, b, 0)
        rec = meta + _HDR + b * _REC
        est = tl.load(rec + 1, mask=me, other=0)
        i = e - est
        r = tl.load(rows + b, mask=me, other=0).to(tl.int64)
        me = me & (r >= 0) & (r < num_rows)
        n0 = tl.load(r_npages + r, mask=me, other=0).to(tl.int64)
        head = tl.load(pt + r * pt_stride + i * PS, mask=me, other=0).to(tl.int64)
        epage = head // PS
        me = me & (head >= 0) & (epage < num_pages)
        efill = tl.load(p_fill + epage, mask=me, other=0).to(tl.int64)
        he, _d = _hash_pred(e, me, i, n0, efill, T, window_start, window_n, HAS_PREFIX, CHECKSUMS,
                            VERIFY_ALL)  # fmt: skip
        ms = mu & ~is_e
        spage = (sweep_start + (job - n_jobs_e)) % num_pages
        sst = tl.load(p_state + spage, mask=ms, other=0)
        sfill = tl.load(p_fill + spage, mask=ms, other=0).to(tl.int64)
        hs = ms & ((sst == _OWNED) | (sst == _SHARED)) & (sfill > 0)
        page = tl.where(is_e, epage, spage)
        fill = tl.where(is_e, efill, sfill)
        mt = (he | hs) & (o < fill)
        slot = page * PS + o
    part = _token_inner(kv_base, kv_tab, kv_consts, wmax, nbuf, slot, mt, g, G, BT, BWORD, WCONST,
                        ALIGN)  # fmt: skip
    if G > 1:
        tl.atomic_add(inner + u, _s64(part), mask=mt)
    else:
        tl.store(inner + u, _s64(part), mask=mt)


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


# -- seal_step --------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=_dyn("N", "REV"))
def _seal_kernel(p_fill, p_digest, wpos, inner, top, targets, wflags, N, REV,
                 PS: tl.constexpr, BW: tl.constexpr, CHECKSUMS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    if REV:
        pid = tl.num_programs(0) - 1 - pid
    j = pid.to(tl.int64) * BW + tl.arange(0, BW)
    mj = j < N
    f = tl.load(wflags + j, mask=mj, other=0)
    ok = mj & ((f & 1) != 0)
    is_last = mj & ((f & 8) != 0)
    page = tl.load(targets + j, mask=ok, other=0) // PS
    if CHECKSUMS:
        inn = tl.load(inner + j, mask=ok, other=0)
        wp = tl.load(wpos + j, mask=ok, other=0).to(tl.int64)
        d = _fmix64(_u64(inn) ^ _poskey(wp))
        tl.store(inner + j, _zeros_like(inn), mask=ok)
        tl.atomic_add(p_digest + page, _s64(d), mask=ok)
    # one writer per page (its last landing write): fill = max(fill, highest landed offset + 1)
    tp = tl.load(top + page, mask=is_last, other=0)
    fl = tl.load(p_fill + page, mask=is_last, other=0).to(tl.int32)
    tl.store(p_fill + page, tl.maximum(fl, tp).to(tl.int16), mask=is_last)
    tl.store(top + page, _zeros_like(tp), mask=is_last)


@triton.jit
def _probe_kernel(out):
    tl.store(out, 1)


def _interpreting() -> bool:
    return type(_read_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 at import


if _interpreting():
    # The interpreter re-patches triton.language at every call of a jitted helper (most of its
    # time here); inside a kernel it is patched already, so the helpers' rewritten bodies are
    # called directly. Same code, same semantics: only the interpreter's bookkeeping is skipped.
    for _name, _fn in list(globals().items()):
        if type(_fn).__name__ == "InterpretedFunction" and not _name.endswith("_kernel"):
            globals()[_name] = _fn.rewrite()


# -- host side --------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class _KvTables:
    """The pool's KV buffers as one base address plus per-buffer word offsets (the checksum
    kernels read every layer in one launch)."""

    def __init__(self, buffers: list[torch.Tensor], device: torch.device):
        views = _row_word_views(buffers) if buffers else []
        self.nbuf = len(views)
        self.wmax = max((v.shape[1] for v in views), default=1)
        if views:
            self.base = views[0]
            p0 = views[0].data_ptr()
            tab = [[(v.data_ptr() - p0) // 4, v.shape[1], v.stride(0)] for v in views]
            for v in views:
                if v.device != device:
                    raise ValueError("KV buffers must be on the ledger's device")
                if (v.data_ptr() - p0) % 4:
                    raise ValueError("KV buffers must be 4-byte aligned")
        else:
            self.base = torch.zeros(1, dtype=_I32, device=device)
            tab = [[0, 0, 0]]
        self.tab = torch.tensor(tab, dtype=_I64).to(device)
        self.consts = word_constants(max(self.nbuf, 1), max(self.wmax, 1), device).contiguous()
        widths = {v.shape[1] for v in views}
        w = widths.pop() if len(widths) == 1 else 0
        even = w & -w  # the largest power of two dividing a common row width
        if w and even >= 16:  # every row the same width: whole tiles, no word mask
            self.bword, self.wconst = min(128, even), w
        else:
            self.bword, self.wconst = min(128, _pow2(max(self.wmax, 1))), 0
        words = [t for row in tab for t in (row[0], row[2])] if views else [0]
        aligned = views and views[0].data_ptr() % 16 == 0 and all(t % 4 == 0 for t in words)
        self.align = 4 if aligned else 1
        self.meta = dict(BWORD=self.bword, WCONST=self.wconst, ALIGN=self.align)


class _Workspace:
    """One step's outputs and inputs (reused three steps later)."""

    def __init__(self, num_pages: int, device: torch.device, zero_copy: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.taint = torch.zeros(num_pages, dtype=torch.bool, device=device)
        self.reclaim = torch.zeros(num_pages, dtype=torch.bool, device=device)
        self.taint_u8 = self.taint.view(torch.uint8)
        self.reclaim_u8 = self.reclaim.view(torch.uint8)
        self.rtaint = torch.zeros(num_pages, dtype=torch.uint8, device=device)
        self.marks = torch.zeros(1 + MCAP, dtype=_I64, device=device)
        self.zero_copy = zero_copy
        pin = self.cuda
        self.flags_host = torch.zeros(5, dtype=_I64, pin_memory=pin)
        self.flags_np = self.flags_host.numpy()
        self.event: Any = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]
        self.flags_event: Any = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]
        self.b = self.n = -1
        self._grow(64, 256)

    def _grow(self, b: int, n: int) -> None:
        if b > self.b:
            self.b = b
            words = HDR + (b + 1) * REC
            self.meta = torch.zeros(words, dtype=_I64, device=self.device)
            if self.cuda:
                self.meta_host = torch.zeros(words, dtype=_I64, pin_memory=True)
            else:
                self.meta_host = self.meta
            self.meta_np = self.meta_host.numpy()
            # copies of power-of-two prefixes, made once: the step's copy is one dispatch
            self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            size = 1
            while True:
                s = min(size, words)
                self.copies[s] = (self.meta[:s], self.meta_host[:s])
                if s == words:
                    break
                size *= 2
            self.mout = torch.zeros((b + 1) * OREC, dtype=_I64, device=self.device)
            self.hashed_view = self.meta[0:1]
            self.seal_view = self.meta[1:2]
            self.flags_dev = self.meta[8:13]
        if n > self.n:
            self.n = n
            self.targets = torch.zeros(n, dtype=_I64, device=self.device)
            self.wchain = torch.zeros(n, dtype=_I64, device=self.device)
            self.wflags = torch.zeros(n, dtype=torch.int8, device=self.device)

    def fit(self, b: int, n: int) -> None:
        if b > self.b or n > self.n:
            self._grow(max(b, 2 * self.b) if b > self.b else self.b,
                       max(n, 2 * self.n) if n > self.n else self.n)  # fmt: skip

    @property
    def flags_out(self) -> torch.Tensor:
        return self.flags_host if self.zero_copy else self.flags_dev

    def nbytes(self) -> int:
        ts = [self.taint, self.reclaim, self.rtaint, self.marks, self.meta, self.mout,
              self.targets, self.wchain, self.wflags]  # fmt: skip
        return sum(t.numel() * t.element_size() for t in ts)


class TritonStepCheck(StepCheck):
    """A ``StepCheck`` whose tensors live in a workspace (valid until it is reused three checks
    later) and whose flags the kernels wrote to host memory."""

    def __init__(self, ws: _Workspace, b: int, n: int):
        self.ws, self._b, self._n = ws, b, n
        self._host: tuple[bool, bool, bool, int] | None = None
        self.applied = False
        self.launch: Any = None  # what apply_step and seal_step need (set by check_step)

    # the reference's fields, as views (the verdict's slow path; taint and reclaim are whole)
    taint = property(lambda s: s.ws.taint)
    reclaim = property(lambda s: s.ws.reclaim)
    hashed = property(lambda s: s.ws.hashed_view)

    def _recs(self, col: int) -> torch.Tensor:
        return self.ws.meta[HDR : HDR + self._b * REC].view(self._b, REC)[:, col]

    def _outs(self, col: int) -> torch.Tensor:
        return self.ws.mout[: self._b * OREC].view(self._b, OREC)[:, col]

    kinds = property(lambda s: s._recs(3))
    targets = property(lambda s: s.ws.targets[: s._n])
    write_ok = property(lambda s: (s.ws.wflags[: s._n] & 1) != 0)
    claim = property(lambda s: (s.ws.wflags[: s._n] & 2) != 0)
    write_chain = property(lambda s: s.ws.wchain[: s._n])
    n_pages = property(lambda s: s._outs(0).to(_I32))
    chain_len = property(lambda s: s._outs(1).to(_I32))
    chain_tail = property(lambda s: s._outs(2))
    agg = property(lambda s: s._outs(5))

    def _read(self) -> tuple[bool, bool, bool, int]:
        if self._host is not None:
            return self._host
        ws = self.ws
        if ws.cuda:
            if self.applied:
                ws.flags_event.synchronize()
            else:
                torch.cuda.current_stream(ws.device).synchronize()
            if not ws.zero_copy:
                ws.flags_host.copy_(ws.flags_dev)
        f = ws.flags_np
        if f[4]:
            raise ValueError(
                "kvguard: a step index is out of range (a request's row, a slot its page table "
                "names outside the pool, or a write out of range): refused on the device, "
                "nothing outside the pool read or written, every write sent to the padding slot"
            )
        out = (bool(f[0]), bool(f[1]), bool(f[2]), int(f[3]))
        if self.applied:  # final: apply wrote the tokens hashed
            self._host = out
        return out

    def flags(self) -> tuple[bool, bool, bool]:
        """(any request flagged, any page tainted, any page to reclaim), after the engine's sync:
        host memory the kernels wrote (no dispatch), or one small copy where the device cannot
        write host memory. A step the kernels refused (an index outside the pool or the table)
        raises ValueError here, as the reference's check does before it reads anything."""
        f = self._read()
        return f[0], f[1], f[2]

    def tokens_hashed(self) -> int:
        return self._read()[3]


@dataclass(slots=True)
class _Step:
    """What check_step hands to apply_step and seal_step (kept alive until the seal)."""

    B: int
    N: int
    rows: torch.Tensor
    wbatch: torch.Tensor
    wpos: torch.Tensor
    has_wb: bool
    step: int


class TritonKernels:
    name = "triton"

    def __init__(
        self,
        buffer_groups: int | None = None,
        reverse_programs: bool = False,
        block_tokens: int = 32,
    ):
        """``buffer_groups``: split each token's KV sum over this many programs (default: enough
        programs to fill the device). ``block_tokens``: tokens per checksum program (a power of
        two; a tuning knob). ``reverse_programs``: run every grid's programs in reverse order
        (tests: the interpreter runs programs in order, so a result that depends on the order
        shows up as a difference between the two runs)."""
        if block_tokens < 1 or block_tokens & (block_tokens - 1):
            raise ValueError("block_tokens must be a power of two")
        self.buffer_groups = buffer_groups
        self.block_tokens = block_tokens
        self.rev = int(reverse_programs)
        self.launches = 0  # kernels enqueued since creation (bench.step counts dispatches)
        self._P: PageArrays | None = None
        self._R: RowArrays | None = None
        self._buffers: list[torch.Tensor] | None = None
        self._ws: list[_Workspace] = []
        self._turn = 0
        self._stamp = 0
        self._pending: TritonStepCheck | None = None
        self.zero_copy = False

    # -- pool ----------------------------------------------------------------------------------------
    def bind(self, P: PageArrays, R: RowArrays, buffers: list[torch.Tensor]) -> None:
        dev = P.state.device
        if dev.type == "cpu" and not _interpreting():
            raise ValueError("the Triton kernels need a CUDA pool (or TRITON_INTERPRET=1)")
        if P.state.numel() >= 1 << 31:
            raise ValueError("pools of 2**31 pages or more are not supported")
        for t in P.tensors() + R.tensors():
            if not t.is_contiguous() or t.device != dev:
                raise ValueError("ledger and row arrays must be contiguous on one device")
        self._P, self._R, self._buffers = P, R, buffers
        self.device = dev
        n = P.state.numel()
        self.winner = torch.full((n,), _BIG32, dtype=_I32, device=dev)
        self.last = torch.full((n,), -1, dtype=_I32, device=dev)
        self.top = torch.zeros(n, dtype=_I32, device=dev)
        self.stamps = torch.zeros(n, dtype=_I32, device=dev)
        self.inner = torch.zeros(1024, dtype=_I64, device=dev)
        self.expc = torch.zeros(1024, dtype=_I64, device=dev)
        self.kv = _KvTables(buffers, dev)
        # on the CPU (the interpreter) the kernels write host memory by construction
        self.zero_copy = dev.type != "cuda" or self._probe_zero_copy()
        self._ws = [_Workspace(n, dev, self.zero_copy) for _ in range(3)]
        self.dummy = torch.zeros(1, dtype=_I64, device=dev)
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            self.num_sms = int(props.multi_processor_count)
        else:
            self.num_sms = 1

    def _probe_zero_copy(self) -> bool:
        """Can kernels write pinned host memory directly (unified addressing)? Checked once."""
        if os.environ.get("KVGUARD_TRITON_ZERO_COPY", "1") == "0":
            return False
        try:
            probe = torch.zeros(1, dtype=_I64, pin_memory=True)
            _probe_kernel[(1,)](probe)
            torch.cuda.synchronize(self.device)
            return int(probe[0]) == 1
        except Exception:  # any refusal means: copy instead
            return False

    def workspace_bytes(self) -> int:
        """Device bytes besides the ledger and the records: 16 per page of scratch, 3 per page in
        each of three workspaces, and the per-step arrays."""
        if self._P is None:
            return 0
        ts = [self.winner, self.last, self.top, self.stamps, self.inner, self.expc]
        own = sum(t.numel() * t.element_size() for t in ts)
        return own + sum(w.nbytes() for w in self._ws)

    def _bound(
        self, P: PageArrays, R: RowArrays | None, buffers: list[torch.Tensor] | None
    ) -> None:
        if (
            self._P is not P
            or (R is not None and self._R is not R)
            or (buffers is not None and self._buffers is not buffers)
        ):
            if R is None or buffers is None:
                if self._P is not P:
                    raise RuntimeError("TritonKernels.bind(pages, rows, buffers) must come first")
                return
            self.bind(P, R, buffers)

    def _launch(self, kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        kernel[grid](*args, **meta)
        self.launches += 1

    def _grow(self, name: str, n: int) -> torch.Tensor:
        t: torch.Tensor = getattr(self, name)
        if t.numel() < n:  # with headroom: the next steps (one token longer) do not grow it
            t = torch.zeros(max(2 * n, 2 * t.numel()), dtype=t.dtype, device=t.device)
            setattr(self, name, t)
        return t

    def _finish_pending(self) -> None:
        """A check whose apply or seal never came (the forward failed): put the per-page scratch
        back at rest so the next step starts clean (slow path)."""
        c = self._pending
        self._pending = None
        if c is None:
            return
        self.last.fill_(-1)
        self.top.zero_()
        self.winner.fill_(_BIG32)
        self.inner.zero_()

    # -- the step check -------------------------------------------------------------------------------
    def check_step(
        self,
        P: PageArrays,
        R: RowArrays,
        x: StepInputs,
        cp: CheckParams,
        buffers: list[torch.Tensor],
    ) -> StepCheck:
        self._bound(P, R, buffers)
        self._finish_pending()
        ps = cp.page_size
        B, N, T = x.rows.numel(), x.write_slots.numel(), x.read_pages_total
        num_pages = P.state.numel()
        if N >= 1 << 24:
            raise ValueError("more than 2**24 - 1 KV writes in one step")
        ws_ = x.write_slots
        if ws_.dim() != 1 or not ws_.is_contiguous() or ws_.dtype not in (_I64, _I32):
            raise ValueError(
                "write slots must be a contiguous int64 tensor (the firewall writes it)"
            )
        pt = x.page_table
        if pt.dim() != 2 or pt.stride(1) != 1 or pt.dtype not in (_I32, _I64):
            raise ValueError(
                "page table must be an int32 [rows, positions] tensor, rows contiguous"
            )
        # what the host knows is checked here; indices on the device are checked by the kernels
        if any(n < 0 or n > pt.shape[1] for n in x.prefix_lens_host):
            raise ValueError("kvguard: a request's prefix is out of range")
        if x.write_batch is None and N > B:
            raise ValueError("kvguard: a write is out of range (more writes than requests)")
        if x.prefix_tokens is not None and x.prefix_tokens.numel() < x.read_tokens_total:
            raise ValueError("kvguard: fewer prefix tokens than positions read")
        rows, wpos, wtok = (
            x.rows.contiguous(),
            x.write_pos.contiguous(),
            x.write_tokens.contiguous(),
        )
        has_wb = x.write_batch is not None
        wbatch = x.write_batch.contiguous() if x.write_batch is not None else self.dummy
        has_prefix = x.prefix_tokens is not None
        ptok = x.prefix_tokens.contiguous() if x.prefix_tokens is not None else self.dummy
        has_seeds = x.seeds is not None
        seeds = x.seeds.contiguous() if x.seeds is not None else self.dummy

        t = self._turn
        self._turn += 1
        ws = self._ws[t % 3]
        nxt = self._ws[(t + 1) % 3]
        ws.fit(B, max(N, 1))
        self._fill_meta(ws, x, ps, B, T, has_prefix)

        # what this step hashes (read entries, resting pages)
        verify_all, checksums = cp.verify_all, cp.checksums
        hash_all = verify_all or (checksums and has_prefix)
        window_n = min(cp.window_pages, T) if (cp.window_pages and T and not verify_all) else 0
        n_jobs_e = T if hash_all else window_n
        sweep_n = min(cp.sweep_pages, num_pages) if cp.sweep_pages else 0
        hashing = self.kv.nbuf > 0 and (n_jobs_e > 0 or sweep_n > 0)
        if not hashing:
            n_jobs_e = sweep_n = 0
        nsteps_b = max(1, (B + 1).bit_length())
        nsteps_n = max(1, (N + 1).bit_length())
        psb = min(_pow2(ps), 64)
        be = max(16, min(256, 4096 // psb))
        common = dict(PS=ps)
        rev = self.rev

        if has_prefix and B:
            expc = self._grow("expc", max(T, 1))
            self._launch(_prefix_kernel, (B,), ws.meta, ws.mout, rows, wbatch, R.n_pages,
                         R.chain_len, R.chain_tail, seeds, ptok, expc, B, N, R.gen.numel(), nsteps_n, rev,
                         HAS_WB=has_wb, HAS_SEEDS=has_seeds, BQ=256, **common)  # fmt: skip
        expc = self.expc
        if hashing:
            units = (n_jobs_e + sweep_n) * ps
            inner = self._grow("inner", units)
            bt = self.block_tokens
            nprog = _cdiv(units, bt)
            G = self._groups(nprog)
            self._launch(_hash_kernel, (nprog, G), self.kv.base, self.kv.tab, self.kv.consts,
                         self.kv.wmax, self.kv.nbuf, inner, units, G, rev, ws.meta, rows, pt,
                         pt.stride(0), R.n_pages, P.state, P.fill, B, max(T, 1), num_pages,
                         R.gen.numel(), cp.window_start, window_n, n_jobs_e, cp.sweep_start, nsteps_b,
                         ws.wflags, ws.targets, SEAL=False, HASH_ALL=hash_all,
                         HAS_PREFIX=has_prefix, CHECKSUMS=checksums, VERIFY_ALL=verify_all,
                         BT=bt, **self.kv.meta, **common)  # fmt: skip
        inner = self.inner
        bw, br, bs = 128, 128, 64
        n_entry = _cdiv(T, be)
        n_req = 0 if has_prefix else _cdiv(B, br)
        n_claim = _cdiv(N, bw)
        n_sweep = _cdiv(sweep_n, bs) if sweep_n else 0
        grid = n_entry + n_req + n_claim + n_sweep + 1
        self._launch(_read_kernel, (grid,), P.state, P.prior, P.fill, P.owner, P.owner_gen,
                     P.lpage, P.epoch, P.chain, P.digest, R.gen, R.n_pages, R.chain_len,
                     R.chain_tail, rows, ws_, wbatch, wpos, pt, pt.stride(0), seeds, ws.meta,
                     ws.mout, expc, inner, self.winner, ws.taint_u8, ws.rtaint, ws.marks,
                     ws.flags_out, nxt.taint_u8, nxt.reclaim_u8, nxt.rtaint, nxt.marks, B, N,
                     T, num_pages, R.gen.numel(), cp.window_start, window_n,
                     cp.sweep_start, sweep_n, n_jobs_e, nsteps_b, nsteps_n, n_entry, n_req,
                     n_claim, n_sweep, rev, PSB=psb, BE=be, BR=br, BW=bw, BS=bs, MCAP=MCAP,
                     HAS_WB=has_wb, HAS_PREFIX=has_prefix, HAS_SEEDS=has_seeds, HASH=hashing,
                     HASH_ALL=hash_all, CHECKSUMS=checksums, VERIFY_ALL=verify_all,
                     **common)  # fmt: skip
        if B or N:  # with writes and no request the step is refused: one program firewalls them
            self._launch(_write_kernel, (max(B, 1),), P.state, P.prior, P.fill, P.owner, P.owner_gen,
                         P.lpage, R.gen, R.agg, rows, ws_, wbatch, wpos, wtok, pt, pt.stride(0),
                         pt.shape[1], seeds, ws.meta, ws.mout, self.winner, self.last, self.top,
                         ws.targets, ws.wchain, ws.wflags, ws.taint_u8, ws.reclaim_u8,
                         ws.rtaint, ws.marks, ws.flags_out, B, N, num_pages, cp.pad_slot, rev,
                         BE=be, BW=bw, MCAP=MCAP, HAS_WB=has_wb, HAS_SEEDS=has_seeds,
                         CHECKSUMS=checksums, **common)  # fmt: skip
        check = TritonStepCheck(ws, B, N)
        check.launch = _Step(B, N, rows, wbatch, wpos, has_wb, x.step)
        self._pending = check
        return check

    def _groups(self, nprog: int) -> int:
        if self.buffer_groups is not None:
            return max(1, min(self.buffer_groups, max(self.kv.nbuf, 1)))
        want = 4 * self.num_sms  # enough programs for every multiprocessor
        return max(1, min(self.kv.nbuf, _cdiv(want, max(nprog, 1))))

    def _fill_meta(self, ws: _Workspace, x: StepInputs, ps: int, B: int, T: int,
                   has_prefix: bool) -> None:  # fmt: skip
        """The step's host-side inputs and zeroed accumulators, in one copy to the device."""
        if ws.cuda and not ws.event.query():  # its copy three steps ago still running
            ws.event.synchronize()
        lens = np.asarray(x.prefix_lens_host, dtype=np.int64)
        if lens.shape != (B,):
            raise ValueError("prefix_lens_host must list one length per request")
        m = ws.meta_np
        m[:HDR] = 0
        recs = m[HDR : HDR + (B + 1) * REC].reshape(B + 1, REC)
        recs[:B, 0] = lens
        recs[B, 0] = 0
        recs[0, 1] = 0
        np.cumsum((lens + ps - 1) // ps, out=recs[1:, 1])
        if int(recs[B, 1]) != T:
            raise ValueError(f"read_pages_total {T} != sum of ceil(prefix_len / page size)")
        if has_prefix:
            recs[0, 2] = 0
            np.cumsum(lens[:-1], out=recs[1:B, 2])
        recs[:, 3:] = 0
        ws.flags_np[:] = 0
        if ws.cuda:
            used = HDR + (B + 1) * REC
            size = min(_pow2(used), HDR + (ws.b + 1) * REC)
            dst, src = ws.copies[size]
            dst.copy_(src, non_blocking=True)
            ws.event.record()

    # -- transitions ----------------------------------------------------------------------------------
    def apply_step(
        self, P: PageArrays, R: RowArrays, x: StepInputs, c: StepCheck, page_size: int
    ) -> None:
        assert isinstance(c, TritonStepCheck) and c.launch is not None
        s: _Step = c.launch
        ws = c.ws
        bw = 128
        n_wprog = _cdiv(s.N, bw)
        grid = max(1, n_wprog + s.B)
        self._launch(_apply_kernel, (grid,), P.state, P.prior, P.fill, P.owner, P.owner_gen,
                     P.lpage, P.epoch, P.chain, P.digest, P.history, R.gen, R.n_pages, R.agg,
                     R.chain_len, R.chain_tail, s.rows, s.wbatch, s.wpos, ws.meta, ws.mout,
                     self.winner, self.last, ws.targets, ws.wchain, ws.wflags, ws.flags_out,
                     s.B, s.N, s.step, n_wprog, self.rev, PS=page_size, BW=bw,
                     HAS_WB=s.has_wb)  # fmt: skip
        c.applied = True
        if ws.cuda:
            ws.flags_event.record()

    def seal_step(
        self,
        P: PageArrays,
        x: StepInputs,
        c: StepCheck,
        buffers: list[torch.Tensor],
        page_size: int,
        checksums: bool,
    ) -> torch.Tensor:
        assert isinstance(c, TritonStepCheck) and c.launch is not None
        s: _Step = c.launch
        ws = c.ws
        N = s.N
        if self._pending is c:
            self._pending = None
        if N == 0:
            return ws.seal_view
        checksums = checksums and self.kv.nbuf > 0
        if checksums:
            inner = self._grow("inner", N)
            bt = self.block_tokens
            nprog = _cdiv(N, bt)
            G = self._groups(nprog)
            self._launch(_hash_kernel, (nprog, G), self.kv.base, self.kv.tab, self.kv.consts,
                         self.kv.wmax, self.kv.nbuf, inner, N, G, self.rev, ws.meta, s.rows,
                         self.dummy, 0, self.dummy, P.state, P.fill, s.B, 1, P.state.numel(), 1,
                         0, 0, 0, 0, 1, ws.wflags, ws.targets, SEAL=True, HASH_ALL=False,
                         HAS_PREFIX=False, CHECKSUMS=True, VERIFY_ALL=False, BT=bt,
                         PS=page_size, **self.kv.meta)  # fmt: skip
        bw = 128
        self._launch(_seal_kernel, (_cdiv(N, bw),), P.fill, P.digest, s.wpos, self.inner,
                     self.top, ws.targets, ws.wflags, N, self.rev, PS=page_size, BW=bw,
                     CHECKSUMS=checksums)  # fmt: skip
        return ws.seal_view

    def alloc_pages(self, P: PageArrays, slots: torch.Tensor, page_size: int, step: int) -> None:
        self._bound(P, None, None)
        n = slots.numel()
        if n == 0:
            return
        self._stamp += 1
        if self._stamp >= _BIG32:  # a stamp must never repeat while a page holds it
            self.stamps.zero_()
            self._stamp = 1
        s = slots if slots.dim() == 1 and slots.is_contiguous() else slots.reshape(-1).contiguous()
        block = 256
        self._launch(_alloc_kernel, (_cdiv(n, block),), s, n, self.stamps, self._stamp,
                     P.state, P.prior, P.history, P.state.numel(), step, PS=page_size,
                     BLOCK=block)  # fmt: skip

    def release_pages(
        self, P: PageArrays, pages: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._bound(P, None, None)
        n = pages.numel()
        keep = torch.zeros(n, dtype=torch.bool, device=P.state.device)
        double = torch.zeros(n, dtype=torch.bool, device=P.state.device)
        if n == 0:
            return keep, double
        p = pages if pages.dim() == 1 and pages.is_contiguous() else pages.reshape(-1).contiguous()
        block = 256
        grid = (_cdiv(n, block),)
        num_pages = P.state.numel()
        self._launch(_release_scatter_kernel, grid, p, n, self.winner, num_pages, BLOCK=block)
        self._launch(_release_kernel, grid, p, n, self.winner, keep.view(torch.int8),
                     double.view(torch.int8), P.state, P.prior, P.history, num_pages, step,
                     BLOCK=block)  # fmt: skip
        return keep, double

    def token_digests(
        self, buffers: list[torch.Tensor], slots: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The checksum alone, as the seal computes it (benchmarks and tests)."""
        dev = slots.device
        kv = _KvTables(buffers, dev)
        n = slots.numel()
        out = torch.empty(n, dtype=_I64, device=dev)
        if n == 0:
            return out
        inner = torch.zeros(n, dtype=_I64, device=dev)
        flags = torch.ones(n, dtype=torch.int8, device=dev)
        targets = slots.to(_I64).contiguous()
        z = torch.zeros(1, dtype=_I64, device=dev)
        bt = self.block_tokens
        nprog = _cdiv(n, bt)
        sms = (
            torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        )
        G = self.buffer_groups or max(1, min(kv.nbuf, _cdiv(4 * sms, nprog)))
        G = max(1, min(G, max(kv.nbuf, 1)))
        _hash_kernel[(nprog, G)](kv.base, kv.tab, kv.consts, kv.wmax, kv.nbuf, inner, n, G, 0,
                                 z, z, z, 0, z, z, z, 0, 1, 1, 1, 0, 0, 0, 0, 1, flags, targets,
                                 SEAL=True, HASH_ALL=False, HAS_PREFIX=False, CHECKSUMS=True,
                                 VERIFY_ALL=False, BT=bt, PS=1, **kv.meta)  # fmt: skip
        _finish_digests_kernel[(_cdiv(n, 256),)](inner, positions.contiguous(), out, n, BLOCK=256)
        return out


@triton.jit(do_not_specialize=_dyn("n"))
def _finish_digests_kernel(inner, pos, out, n, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    inn = tl.load(inner + j, mask=m, other=0)
    p = tl.load(pos + j, mask=m, other=0).to(tl.int64)
    tl.store(out + j, _s64(_fmix64(_u64(inn) ^ _poskey(p))), mask=m)

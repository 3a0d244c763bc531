"""The checksum kernels: the partial KV sums of hashed tokens (one launch over every buffer of
the pool), the finishing of page digests, the seal, and the token digests alone.

Reproduces ``guard_ref.seal_step`` (landed tokens sealed: ``fill``; their digests added to their
pages' in checksum modes) and the hashing ``guard_ref.check_step`` does through
``guard_ref.page_digests`` (read pages handed off, in the window or verified, and the sweep's
resting pages: ``_hash_kernel`` sums, ``_page_digest`` finishes inside the step check's read
kernel). A token's digest is ``kv_checksum_ref.token_digests_ref``: ``_token_inner`` is
``inner_sums_ref``, then ``fmix64(inner ^ poskey(position))``. ``_KvTables`` lays the pool's
buffers out for them (host side).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .kv_checksum_ref import KvBuffer, _row_word_views, word_constants
from .triton_common import (
    _HDR,
    _I32,
    _I64,
    _OWNED,
    _REC,
    _SHARED,
    _dyn,
    _fmix64,
    _poskey,
    _pow2,
    _rewrite_helpers,
    _s64,
    _sum,
    _u64,
    _upper_bound,
    _zeros_like,
)

# Triton kernel arguments are pointers and ints that Triton specializes on; annotations other
# than tl.constexpr would change that, so the jitted functions below stay unannotated.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"


@triton.jit
def _token_inner(kv_base, kv_tab, kv_consts, wmax, nbuf, slot, mask, g, G, BT: tl.constexpr,
                 BWORD: tl.constexpr, WCONST: tl.constexpr, ALIGN: tl.constexpr):  # fmt: skip
    """Partial inner sums of tokens at ``slot`` over buffers g, g + G, ...: [BT] uint64.
    kv_tab[b] = (word offset of buffer b from buffer 0, words per row, row stride in words, page
    stride in words (0: slot-major), rows per page): a page-major buffer's slot s is row
    s % per_page of page s // per_page (guard_cpu.c's ``slot_words``).
    Each word w times its odd constant C = lo + hi * 2**32 is summed as w * lo (one widening
    32-bit multiply) plus (w * hi mod 2**32) * 2**32: the same value mod 2**64. WCONST: every
    row has this many words, a multiple of BWORD (unmasked, vectorizable word loads); ALIGN:
    rows start at multiples of this many words."""
    lo_acc = tl.full([BT, BWORD], 0, tl.uint64)
    hi_acc = tl.full([BT, BWORD], 0, tl.uint32)
    cols = tl.arange(0, BWORD)
    for bi in range(g, nbuf, G):
        off = tl.load(kv_tab + bi * 5)
        stride = tl.load(kv_tab + bi * 5 + 2)
        pstride = tl.load(kv_tab + bi * 5 + 3)
        if pstride != 0:  # page-major (DSA index keys and scales)
            per_page = tl.load(kv_tab + bi * 5 + 4)
            start = off + (slot // per_page) * pstride + (slot % per_page) * stride
        else:
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
            w = tl.load(kv_tab + bi * 5 + 1)
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


@triton.jit(do_not_specialize=_dyn("n"))
def _finish_digests_kernel(inner, pos, out, n, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    inn = tl.load(inner + j, mask=m, other=0)
    p = tl.load(pos + j, mask=m, other=0).to(tl.int64)
    tl.store(out + j, _s64(_fmix64(_u64(inn) ^ _poskey(p))), mask=m)


# -- host side --------------------------------------------------------------------------------------
class _KvTables:
    """The pool's KV buffers as one base address plus per-buffer word offsets (the checksum
    kernels read every layer in one launch)."""

    def __init__(self, buffers: Sequence[KvBuffer], device: torch.device):
        views = _row_word_views(buffers) if buffers else []
        self.nbuf = len(views)
        self.wmax = max((v.shape[-1] for v in views), default=1)
        if views:
            self.base = views[0]
            p0 = views[0].data_ptr()
            tab = [
                [(v.data_ptr() - p0) // 4, v.shape[1], v.stride(0), 0, 1]
                if v.dim() == 2
                else [(v.data_ptr() - p0) // 4, v.shape[2], v.stride(1), v.stride(0), v.shape[1]]
                for v in views
            ]
            for v in views:
                if v.device != device:
                    raise ValueError("KV buffers must be on the ledger's device")
                if (v.data_ptr() - p0) % 4:
                    raise ValueError("KV buffers must be 4-byte aligned")
        else:
            self.base = torch.zeros(1, dtype=_I32, device=device)
            tab = [[0, 0, 0, 0, 1]]
        self.tab = torch.tensor(tab, dtype=_I64).to(device)
        self.consts = word_constants(max(self.nbuf, 1), max(self.wmax, 1), device).contiguous()
        widths = {v.shape[-1] for v in views}
        w = widths.pop() if len(widths) == 1 else 0
        even = w & -w  # the largest power of two dividing a common row width
        if w and even >= 16:  # every row the same width: whole tiles, no word mask
            self.bword, self.wconst = min(128, even), w
        else:
            self.bword, self.wconst = min(128, _pow2(max(self.wmax, 1))), 0
        words = [t for row in tab for t in (row[0], row[2], row[3])] if views else [0]
        aligned = views and views[0].data_ptr() % 16 == 0 and all(t % 4 == 0 for t in words)
        self.align = 4 if aligned else 1
        self.meta = dict(BWORD=self.bword, WCONST=self.wconst, ALIGN=self.align)


_rewrite_helpers(globals())  # under the interpreter: the helpers' rewritten bodies

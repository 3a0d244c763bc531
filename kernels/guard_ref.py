"""The guard's kernels in plain torch: the executable specification.

Every backend (the compiled CPU kernels in ``guard_cpu``, the Triton kernels in ``guard_triton``)
must reach the same verdicts and leave the same ``PageArrays``/``RowArrays`` as these functions,
bit for bit (``tests/test_guard_kernels.py`` drives all of them through one corruption matrix).
Each function is one ledger transition or the step check; all are vectorized (no Python loop over
pages, positions or requests) and read no device value on the host.

Definitions (ps = page size; row r reads positions [0, L) and holds logical pages [0, n_pages)):

* page_tag(e, i) = fmix64(e * GOLDEN + i). A row's expectation of the pages it holds is
  ``agg[r] = sum_i page_tag(epoch of the page it claimed or adopted at i, i)`` (mod 2**64): one
  word per row, kept by the reader, so the page's next claimant (a new epoch) cannot refresh it.
* chain(p) = seed + sum_{q <= p} splitmix64(token_q * TOKEN_MUL + q): a page's ``chain`` is the
  chain at its last written token; a prefix-cache page is adopted only if it equals the reader's
  own chain there (tenant-seeded when isolated).
* page digest = wrapping sum over its sealed tokens of token_digest(slot, lpage * ps + offset)
  (``kv_checksum_ref``).

The step check, per request b (row r, prefix L, page entries i < ceil(L / ps)); a batch holds
each row at most once (as SGLang's batches do):

1. Adoption (extend steps, ``prefix_tokens`` given): entries i >= n_pages[r] are prefix-cache
   pages to adopt: SHARED (or freed from SHARED), full, sealed, lpage i, chain equal to the
   reader's own; in checksum modes their bytes re-hash to the page digest (hand-off).
2. Held pages: OWNED by (r, gen[r]), SHARED, QUARANTINED, or FREE but otherwise validly held
   (a premature free: reclaimed at resolve, the reader goes on); lpage i; every position in
   place; fill >= tokens read; sum of page tags == agg[r]; pages and positions agree with the
   row (n_pages, chain_len).
3. Writes, in order: a token at a page's first slot claims the page: it must be ALLOCATED (the
   allocator's hand-out is authoritative) and this step's first claim of it; any other write
   continues a page the row holds (claimed before or earlier this step) at an unsealed offset;
   every write is the slot the row's table names, in place, at the next position. A write that
   fails is redirected to the padding slot (the write firewall): it never lands.
4. Checksums: hand-off (sampled, paranoid), every read page (paranoid, or after a quarantine),
   a rolling window of read pages (sampled), a rolling sweep of resting pages (sampled).
5. Taint (pages whose content is bad): checksum mismatches flag every reader of the page
   (QUARANTINED_PAGE); then what every flagged request writes this step is tainted too (it was
   computed from KV it should not have read, so it must not reach the prefix cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .guard_state import (
    EPOCH_STEP_SHIFT,
    HISTORY,
    NO_ROW,
    Event,
    PageArrays,
    PageState,
    RowArrays,
)
from .kv_checksum_ref import KvBuffer, fmix64, poskey, splitmix64, to_signed64, token_digests_ref

_I64 = torch.int64
GOLDEN = to_signed64(0x9E3779B97F4A7C15)
TOKEN_MUL = GOLDEN
_BIG = 1 << 62

# Verdict bits (kvguard.verdict.Kind has the same values; kernels do not import the core).
TABLE_MISMATCH = 1 << 0
MISPLACED_SLOT = 1 << 1
DOUBLE_ALLOCATION = 1 << 2
WRONG_OWNER = 1 << 3
WRITE_TO_SHARED = 1 << 4
OVERWRITE = 1 << 5
READ_UNWRITTEN = 1 << 6
PREFIX_MISMATCH = 1 << 7
CHECKSUM_MISMATCH = 1 << 8
QUARANTINED_PAGE = 1 << 9
ROW_MISMATCH = 1 << 12
STALE_TRANSFER = 1 << 16
TRANSFER_MISMATCH = 1 << 17

FREE, OWNED, SHARED, QUARANTINED, ALLOCATED = (int(s) for s in PageState)


@dataclass(slots=True)
class StepInputs:
    """One forward as the kernels see it (built from ``kvguard.step.StepView``)."""

    step: int
    rows: torch.Tensor  # [B] int64
    prefix_lens_host: list[int]  # [B] positions each request reads (its KV before this forward)
    write_slots: torch.Tensor  # [N] int64: the engine's own write targets (firewalled in place)
    write_batch: torch.Tensor | None  # [N] int64 ascending; None: one write per request (decode)
    write_pos: torch.Tensor  # [N] int64
    write_tokens: torch.Tensor  # [N] int64
    page_table: torch.Tensor  # [R, S] int32
    seeds: torch.Tensor | None  # [B] int64 chain seeds; None: 0 (no tenant isolation)
    prefix_tokens: torch.Tensor | None  # [sum L] int64 packed per request, extend steps only
    read_pages_total: int  # host: sum ceil(L / ps)
    read_tokens_total: int  # host: sum L

    def batch_index(self) -> torch.Tensor:
        if self.write_batch is not None:
            return self.write_batch.to(_I64)
        return torch.arange(self.write_slots.numel(), device=self.write_slots.device)

    def seed_values(self) -> torch.Tensor:
        if self.seeds is not None:
            return self.seeds.to(_I64)
        return torch.zeros(self.rows.numel(), dtype=_I64, device=self.rows.device)


@dataclass(slots=True)
class CheckParams:
    page_size: int
    checksums: bool  # sampled or paranoid: seals and hand-offs are hashed
    verify_all: bool  # paranoid, or escalated after a quarantine: every read page is hashed
    window_start: int  # sampled: first read-page entry of the rolling window
    window_pages: int  # sampled: read-page entries hashed this step (0: none)
    sweep_start: int  # sampled: first resting page of the sweep
    sweep_pages: int  # sampled: resting pages hashed this step (0: none)
    pad_slot: int  # where a firewalled write goes (SGLang's padding slot 0)


@dataclass(slots=True)
class StepCheck:
    """The step check's result: the verdict and the transitions ``apply_step`` makes."""

    kinds: torch.Tensor  # [B] int64 OR of verdict bits
    taint: torch.Tensor  # [P] bool pages whose content is bad
    reclaim: torch.Tensor  # [P] bool freed pages still validly held (premature free)
    targets: torch.Tensor  # [N] int64 the write targets before the firewall
    write_ok: torch.Tensor  # [N] bool writes that land
    claim: torch.Tensor  # [N] bool writes that claim their page
    write_chain: torch.Tensor  # [N] int64 token chain of each write
    n_pages: torch.Tensor  # [B] int32 pages held after adoption
    agg: torch.Tensor  # [B] int64 page-tag sum after adoption
    chain_len: torch.Tensor  # [B] int32 after adoption
    chain_tail: torch.Tensor  # [B] int64 after adoption
    hashed: torch.Tensor  # [1] int64 tokens hashed by this check

    def flags(self) -> tuple[bool, bool, bool]:
        """(any request flagged, any page tainted, any page to reclaim): host values. Compiled
        backends know them for free; here (and on a GPU) reading them is a sync."""
        return bool(self.kinds.any()), bool(self.taint.any()), bool(self.reclaim.any())

    def tokens_hashed(self) -> int:
        return int(self.hashed.sum())

    def marked_pages(self) -> torch.Tensor:
        """[k] int64 the pages tainted or to reclaim (a scan here; compiled backends keep the
        list as they mark them, so a flagged step costs what it flagged, not the pool)."""
        return torch.nonzero(self.taint | self.reclaim).reshape(-1)


# -- small shared pieces ---------------------------------------------------------------------------
def page_tag(epoch: torch.Tensor, lpage: torch.Tensor) -> torch.Tensor:
    return fmix64(epoch.to(_I64) * GOLDEN + lpage.to(_I64))


def chain_terms(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return splitmix64(tokens.to(_I64) * TOKEN_MUL + positions.to(_I64))


def segment_cumsum(values: torch.Tensor, seg: torch.Tensor, num_segs: int) -> torch.Tensor:
    """Inclusive prefix sums of ``values`` restarted at each segment (``seg`` ascending)."""
    if values.numel() == 0:
        return values.clone()
    cs = torch.cumsum(values, 0)
    counts = torch.zeros(num_segs, dtype=_I64, device=values.device).index_add_(
        0, seg, torch.ones_like(seg)
    )
    starts = torch.cumsum(counts, 0) - counts
    before = torch.where(starts > 0, cs[(starts - 1).clamp(min=0)], torch.zeros_like(starts))
    return cs - before[seg]


def _segments(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ragged segments of ``counts``: (segment id, index within segment) of each element."""
    dev = counts.device
    seg = torch.repeat_interleave(
        torch.arange(counts.numel(), device=dev), counts, output_size=total
    )
    starts = torch.cumsum(counts, 0) - counts
    return seg, torch.arange(total, device=dev) - starts[seg]


def _bits(mask: torch.Tensor, seg: torch.Tensor, num_segs: int, kind: int) -> torch.Tensor:
    """[num_segs] int64: ``kind`` where any element of the segment is set in ``mask``."""
    hit = torch.zeros(num_segs, dtype=_I64, device=mask.device)
    hit.index_add_(0, seg, mask.to(_I64))
    return (hit > 0).to(_I64) * kind


def _push_history(
    P: PageArrays, pages: torch.Tensor, event: Event, step: int, rows: torch.Tensor | int
) -> None:
    """Push (step, event, row) onto each page's history; a page whose newest entry is already
    exactly that keeps one (so a transition repeated within a step is recorded once)."""
    if pages.numel() == 0:
        return
    row_ids = torch.as_tensor(rows, device=pages.device).to(_I64).expand(pages.shape)
    packed = (step << 24) | (int(event) << 20) | (row_ids & NO_ROW)
    new = P.history[pages, 0] != packed
    pages, packed = pages[new], packed[new]
    P.history[pages] = torch.cat((packed[:, None], P.history[pages, : HISTORY - 1]), dim=1)


def _first_occurrence(pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    """[n] bool: the first time each page appears in ``pages`` (sequential semantics)."""
    idx = torch.arange(pages.numel(), device=pages.device)
    first = torch.full((num_pages,), _BIG, dtype=_I64, device=pages.device)
    first.scatter_reduce_(0, pages, idx, reduce="amin")
    return first[pages] == idx


def page_digests(
    buffers: Sequence[KvBuffer], P: PageArrays, pages: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Digest of each page's sealed tokens (at the page's own logical positions): [n] int64."""
    n = pages.numel()
    if n == 0:
        return torch.zeros(0, dtype=_I64, device=pages.device)
    off = torch.arange(page_size, device=pages.device)
    slots = (pages[:, None] * page_size + off).reshape(-1)
    pos = (P.lpage[pages].to(_I64).clamp(min=0)[:, None] * page_size + off).reshape(-1)
    sealed = (off[None, :] < P.fill[pages].to(_I64)[:, None]).reshape(-1)
    d = token_digests_ref(buffers, slots, pos)
    d = torch.where(sealed, d.to(pages.device), torch.zeros_like(d))
    return d.view(n, page_size).sum(1)


def _check_ranges(P: PageArrays, R: RowArrays, x: StepInputs, ps: int) -> None:
    """A step whose indices point outside the pool or the table is refused before anything is
    read (ValueError: the caller aborts the batch). Host reads: the reference only."""
    rows, L = x.rows.to(_I64).cpu(), x.prefix_lens_host
    num_slots, S = P.state.numel() * ps, x.page_table.shape[1]
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= R.gen.numel()):
        raise ValueError("kvguard: a request's row is out of range")
    if any(n < 0 or n > S for n in L):
        raise ValueError("kvguard: a request's prefix is out of range")
    for r, n in zip(rows.tolist(), L):
        t = x.page_table[r, :n]
        if n and (int(t.min()) < 0 or int(t.max()) >= num_slots):
            raise ValueError(f"kvguard: row {r} names a slot outside the pool")
    ws, wp, wb = x.write_slots.cpu(), x.write_pos.cpu(), x.batch_index().cpu()
    if ws.numel() and (
        int(ws.min()) < 0 or int(ws.max()) >= num_slots or int(wp.min()) < 0
        or int(wb.min()) < 0 or int(wb.max()) >= rows.numel() or bool((wb[1:] < wb[:-1]).any())
    ):  # fmt: skip
        raise ValueError("kvguard: a write is out of range")


# -- the step check (pure) -------------------------------------------------------------------------
def check_step(
    P: PageArrays,
    R: RowArrays,
    x: StepInputs,
    cp: CheckParams,
    buffers: Sequence[KvBuffer],
) -> StepCheck:
    ps = cp.page_size
    dev = P.state.device
    B, N, T = x.rows.numel(), x.write_slots.numel(), x.read_pages_total
    num_pages = P.state.numel()
    rows = x.rows.to(_I64)
    L = torch.tensor(x.prefix_lens_host, dtype=_I64).to(dev)
    kinds = torch.zeros(B, dtype=_I64, device=dev)
    taint = torch.zeros(num_pages, dtype=torch.bool, device=dev)
    hashed = torch.zeros(1, dtype=_I64, device=dev)
    pt = x.page_table
    _check_ranges(P, R, x, ps)
    gen = R.gen[rows]
    n_pages0 = R.n_pages[rows].to(_I64)
    chain_len0 = R.chain_len[rows].to(_I64)

    # ---- read entries: one per (request, logical page read) ----
    np_b = torch.div(L + ps - 1, ps, rounding_mode="floor")
    eb, ei = _segments(np_b, T)
    er = rows[eb]
    head = pt[er, ei * ps].to(_I64)
    page = torch.div(head, ps, rounding_mode="floor")
    head_ok = (head % ps) == 0
    st = P.state[page].to(_I64)
    pr = P.prior[page].to(_I64)
    fill = P.fill[page].to(_I64)
    mine = (P.owner[page].to(_I64) == er) & (P.owner_gen[page] == gen[eb])
    lpage_ok = P.lpage[page].to(_I64) == ei

    # every position of a page read is that page's slot at its offset
    pos_bad = torch.zeros(B, dtype=_I64, device=dev)
    if ps > 1 and x.read_tokens_total:
        qb, q = _segments(L, x.read_tokens_total)
        pstarts = torch.cumsum(np_b, 0) - np_b
        qpage = page[pstarts[qb] + torch.div(q, ps, rounding_mode="floor")]
        slot_q = pt[rows[qb], q].to(_I64)
        pos_bad = _bits(slot_q != qpage * ps + q % ps, qb, B, MISPLACED_SLOT)
    kinds |= pos_bad

    # ---- adoption of prefix-cache pages (extend steps) ----
    cand = torch.zeros_like(head_ok)
    chain_len1, chain_tail1 = chain_len0, R.chain_tail[rows].clone()
    if x.prefix_tokens is not None:
        cand = ei >= n_pages0[eb]
        qb, q = _segments(L, x.read_tokens_total)
        own_chain = x.seed_values()[qb] + segment_cumsum(
            chain_terms(x.prefix_tokens.to(dev), q), qb, B
        )
        lstarts = torch.cumsum(L, 0) - L
        end = (ei + 1) * ps - 1
        full_read = end < L[eb]
        exp_chain = own_chain[(lstarts[eb] + torch.minimum(end, L[eb] - 1)).clamp(min=0)]
        adopting = _bits(cand, eb, B, 1) > 0
        kinds |= torch.where(adopting & (chain_len0 != n_pages0 * ps), ROW_MISMATCH, 0)
        kinds |= _bits(cand & ~full_read, eb, B, ROW_MISMATCH)
        kinds |= _bits(cand & (P.chain[page] != exp_chain), eb, B, PREFIX_MISMATCH)
        kinds |= _bits(cand & (fill != ps), eb, B, READ_UNWRITTEN)
        last = own_chain[(lstarts + L - 1).clamp(min=0)] if own_chain.numel() else chain_tail1
        chain_len1 = torch.where(adopting, L, chain_len0)
        chain_tail1 = torch.where(adopting, last, chain_tail1)

    # ---- every page read: state, owner, place, fill, tags ----
    free_ok = (st == FREE) & (((pr == OWNED) & mine) | (pr == SHARED))
    quar = st == QUARANTINED
    held_ok = ((st == OWNED) & mine) | (st == SHARED) | quar | free_ok
    adopt_ok = (st == SHARED) | ((st == FREE) & (pr == SHARED))
    state_ok = torch.where(cand, adopt_ok, held_ok)
    kinds |= _bits(~state_ok & ~quar, eb, B, WRONG_OWNER)
    kinds |= _bits(cand & quar, eb, B, QUARANTINED_PAGE)
    kinds |= _bits(~lpage_ok | ~head_ok, eb, B, MISPLACED_SLOT)
    need = torch.clamp(L[eb] - ei * ps, max=ps)
    kinds |= _bits(fill < need, eb, B, READ_UNWRITTEN)
    tags = page_tag(P.epoch[page], ei)
    held = ~cand
    acc = torch.zeros(B, dtype=_I64, device=dev).index_add_(0, eb, torch.where(held, tags, 0))
    adopted = torch.zeros(B, dtype=_I64, device=dev).index_add_(0, eb, torch.where(cand, tags, 0))
    kinds |= torch.where(acc != R.agg[rows], WRONG_OWNER, 0)
    n_pages1 = n_pages0 + torch.zeros_like(n_pages0).index_add_(0, eb, cand.to(_I64))
    agg1 = R.agg[rows] + adopted
    kinds |= torch.where((np_b != n_pages1) | (chain_len1 != L), ROW_MISMATCH, 0)

    # ---- checksums of pages read ----
    bad_read = torch.zeros_like(head_ok)
    hashed_mask = torch.zeros_like(head_ok)
    if cp.checksums and x.prefix_tokens is not None:
        hashed_mask |= cand
    if cp.verify_all:
        hashed_mask |= torch.ones_like(head_ok)
    elif cp.window_pages and T:
        w = min(cp.window_pages, T)
        widx = (torch.arange(w, device=dev) + cp.window_start) % T
        hashed_mask[widx] = True
    hashed_mask &= fill > 0
    if T:
        hidx = torch.nonzero(hashed_mask).reshape(-1)
        hp = page[hidx]
        found = page_digests(buffers, P, hp, ps)
        bad_read[hidx] = found != P.digest[hp]
        hashed += P.fill[hp].to(_I64).sum()
    kinds |= _bits(bad_read, eb, B, CHECKSUM_MISMATCH)
    taint.index_put_((page,), bad_read, accumulate=True)
    # a quarantined page is read only where its bytes were just verified intact
    verified = hashed_mask & ~bad_read if cp.verify_all else torch.zeros_like(head_ok)
    kinds |= _bits(quar & ~cand & ~verified, eb, B, QUARANTINED_PAGE)

    # ---- sweep of resting pages ----
    if cp.sweep_pages:
        sp = (torch.arange(min(cp.sweep_pages, num_pages), device=dev) + cp.sweep_start) % num_pages
        sst = P.state[sp]
        live = ((sst == OWNED) | (sst == SHARED)) & (P.fill[sp] > 0)
        sp = sp[live]
        found = page_digests(buffers, P, sp, ps)
        taint[sp[found != P.digest[sp]]] = True
        hashed += P.fill[sp].to(_I64).sum()

    # ---- writes ----
    targets = x.write_slots.to(_I64).clone()
    wb = x.batch_index()
    wr = rows[wb]
    wp = x.write_pos.to(_I64)
    wpage = torch.div(targets, ps, rounding_mode="floor")
    woff = targets % ps
    wlp = torch.div(wp, ps, rounding_mode="floor")
    j = torch.arange(N, device=dev)
    counts = torch.zeros(B, dtype=_I64, device=dev).index_add_(0, wb, torch.ones_like(wb))
    k = j - (torch.cumsum(counts, 0) - counts)[wb]
    pos_ok = wp == chain_len1[wb] + k
    in_table = wp < pt.shape[1]
    table_ok = in_table & (pt[wr, wp.clamp(max=pt.shape[1] - 1)].to(_I64) == targets)
    in_place = woff == wp % ps
    claim = (woff == 0) & in_place
    wst = P.state[wpage].to(_I64)
    winner = torch.full((num_pages,), _BIG, dtype=_I64, device=dev)
    winner.scatter_reduce_(0, wpage, torch.where(claim, j, _BIG), reduce="amin")
    is_winner = claim & (winner[wpage] == j)
    claim_ok = is_winner & (wst == ALLOCATED) & table_ok & pos_ok
    wmine = (P.owner[wpage].to(_I64) == wr) & (P.owner_gen[wpage] == gen[wb])
    held_before = (
        (wst == OWNED)
        & wmine
        & (P.lpage[wpage].to(_I64) == wlp)
        & (wlp < n_pages1[wb])
        & (woff >= P.fill[wpage].to(_I64))
    )
    wj = winner[wpage].clamp(max=max(N - 1, 0))  # this step's winning claim of the page
    held_now = (winner[wpage] < j) & (wb[wj] == wb) & (wlp[wj] == wlp) & claim_ok[wj]
    cont_ok = ~claim & in_place & table_ok & pos_ok & (held_before | held_now)
    write_ok = claim_ok | cont_ok
    kinds |= _bits(~table_ok, wb, B, TABLE_MISMATCH)
    kinds |= _bits(~in_place, wb, B, MISPLACED_SLOT)
    kinds |= _bits(~pos_ok, wb, B, ROW_MISMATCH)
    kinds |= _bits(claim & (wst == OWNED), wb, B, DOUBLE_ALLOCATION)
    kinds |= _bits(claim & (wst == ALLOCATED) & ~is_winner, wb, B, DOUBLE_ALLOCATION)
    kinds |= _bits(claim & (wst == SHARED), wb, B, WRITE_TO_SHARED)
    kinds |= _bits(claim & (wst == QUARANTINED), wb, B, QUARANTINED_PAGE)
    kinds |= _bits(claim & (wst == FREE), wb, B, WRONG_OWNER)
    not_held = ~claim & ~(held_before | held_now)
    overwrite = (
        not_held
        & (wst == OWNED)
        & wmine
        & (P.lpage[wpage].to(_I64) == wlp)
        & (woff < P.fill[wpage].to(_I64))
    )
    kinds |= _bits(not_held & (wst == SHARED), wb, B, WRITE_TO_SHARED)
    kinds |= _bits(overwrite, wb, B, OVERWRITE)
    kinds |= _bits(not_held & (wst != SHARED) & ~overwrite, wb, B, WRONG_OWNER)

    base = torch.where(chain_len1 > 0, chain_tail1, x.seed_values())
    write_chain = base[wb] + segment_cumsum(chain_terms(x.write_tokens, wp), wb, B)

    # ---- taint: readers of bad content are flagged; what flagged requests write is tainted ----
    kinds |= _bits(taint[page], eb, B, QUARANTINED_PAGE)
    taint.index_put_((wpage,), write_ok & (kinds[wb] != 0), accumulate=True)

    reclaim = torch.zeros(num_pages, dtype=torch.bool, device=dev)
    reclaim.index_put_(
        (page,), free_ok & lpage_ok & head_ok & (fill >= need) & (kinds[eb] == 0), accumulate=True
    )

    # ---- the firewall: a write that failed its check never lands ----
    x.write_slots.copy_(torch.where(write_ok, targets, cp.pad_slot).to(x.write_slots.dtype))
    return StepCheck(
        kinds=kinds,
        taint=taint,
        reclaim=reclaim,
        targets=targets,
        write_ok=write_ok,
        claim=claim_ok,
        write_chain=write_chain,
        n_pages=n_pages1.to(torch.int32),
        agg=agg1,
        chain_len=chain_len1.to(torch.int32),
        chain_tail=chain_tail1,
        hashed=hashed,
    )


# -- transitions -----------------------------------------------------------------------------------
def apply_step(P: PageArrays, R: RowArrays, x: StepInputs, c: StepCheck, page_size: int) -> None:
    """Claims, page chains and row records after the check, before the forward."""
    ps, dev = page_size, P.state.device
    N, B = c.targets.numel(), x.rows.numel()
    rows = x.rows.to(_I64)
    wb = x.batch_index()
    wr = rows[wb]
    wpage = torch.div(c.targets, ps, rounding_mode="floor")
    wlp = torch.div(x.write_pos.to(_I64), ps, rounding_mode="floor")
    j = torch.arange(N, device=dev)
    epoch = (x.step << EPOCH_STEP_SHIFT) | (j + 1)
    ci = torch.nonzero(c.claim).reshape(-1)
    cpage, crow = wpage[ci], wr[ci]
    P.prior[cpage] = P.state[cpage]
    P.state[cpage] = OWNED
    P.epoch[cpage] = epoch[ci]
    P.owner[cpage] = crow.to(torch.int32)
    P.owner_gen[cpage] = R.gen[crow]
    P.lpage[cpage] = wlp[ci].to(torch.int32)
    P.fill[cpage] = 0
    P.digest[cpage] = 0
    P.chain[cpage] = 0
    _push_history(P, cpage, Event.CLAIM, x.step, crow)
    last = torch.full((P.state.numel(),), -1, dtype=_I64, device=dev)
    last.scatter_reduce_(0, wpage, torch.where(c.write_ok, j, -1), reduce="amax")
    lp = torch.nonzero(last[wpage] == j).reshape(-1)  # the last landing write of each page
    P.chain[wpage[lp]] = c.write_chain[lp]

    claimed = torch.zeros(B, dtype=_I64, device=dev).index_add_(0, wb, c.claim.to(_I64))
    tags = torch.where(c.claim, page_tag(epoch, wlp), 0)
    counts = torch.zeros(B, dtype=_I64, device=dev).index_add_(0, wb, torch.ones_like(wb))
    lastw = torch.full((B,), -1, dtype=_I64, device=dev)
    lastw.scatter_reduce_(0, wb, j, reduce="amax")
    has = lastw >= 0
    R.n_pages[rows] = (c.n_pages.to(_I64) + claimed).to(torch.int32)
    R.agg[rows] = c.agg + torch.zeros(B, dtype=_I64, device=dev).index_add_(0, wb, tags)
    R.chain_len[rows] = (c.chain_len.to(_I64) + counts).to(torch.int32)
    tail = c.write_chain[lastw.clamp(min=0)] if N else c.chain_tail
    R.chain_tail[rows] = torch.where(has, tail, c.chain_tail)


def seal_step(
    P: PageArrays,
    x: StepInputs,
    c: StepCheck,
    buffers: Sequence[KvBuffer],
    page_size: int,
    checksums: bool,
    written: torch.Tensor | None = None,
) -> torch.Tensor:
    """After the forward wrote them: landed tokens are sealed (fill) and, in checksum modes,
    their digests added to their pages'. ``written`` [N] (the writer's inner sums, per write:
    ``hash_rows`` over what each layer handed its store) gives the digests; without it they are
    hashed from the pool. Returns the number of tokens hashed ([1] int64)."""
    ps, dev = page_size, P.state.device
    wpage = torch.div(c.targets, ps, rounding_mode="floor")
    off = (c.targets % ps) + 1
    top = torch.zeros(P.state.numel(), dtype=_I64, device=dev)
    top.scatter_reduce_(0, wpage, torch.where(c.write_ok, off, 0), reduce="amax")
    P.fill.copy_(torch.maximum(P.fill.to(_I64), top).to(torch.int16))
    hashed = torch.zeros(1, dtype=_I64, device=dev)
    if checksums and c.targets.numel():
        if written is not None:
            d = fmix64(written.to(dev) ^ poskey(x.write_pos.to(_I64).to(dev)))
        else:
            d = token_digests_ref(buffers, c.targets, x.write_pos.to(_I64)).to(dev)
        P.digest.index_add_(0, wpage, torch.where(c.write_ok, d, 0))
        hashed += c.write_ok.to(_I64).sum()
        c.hashed = c.hashed + hashed  # tokens_hashed() counts the check and the seal
    return hashed


def alloc_pages(P: PageArrays, slots: torch.Tensor, page_size: int, step: int) -> None:
    """The allocator handed out ``slots``; pages starting at them are new hand-outs. Its word is
    authoritative: a page still held is handed out anyway (ALLOCATED), and its old holders fail
    their reads from now on (they are the stale ones)."""
    slots = slots.to(_I64)
    ok = (slots >= 0) & (slots % page_size == 0) & (slots < P.state.numel() * page_size)
    pages = torch.unique(torch.div(slots[ok], page_size, rounding_mode="floor"))
    packed = (step << 24) | (int(Event.ALLOC) << 20) | NO_ROW
    again = (P.state[pages] == ALLOCATED) & (P.history[pages, 0] == packed)
    pages = pages[~again]
    P.prior[pages] = P.state[pages]
    P.state[pages] = ALLOCATED
    _push_history(P, pages, Event.ALLOC, step, NO_ROW)


def attribute_free(P: PageArrays, R: RowArrays, pages: torch.Tensor, row: int) -> torch.Tensor:
    """While row ``row``'s request is released: [n] bool, the pages that may be its to free. A
    page now held by someone else (another row's claim, the prefix cache, a new hand-out) is
    not: the releasing request is its stale holder. Pure."""
    pages = pages.to(_I64)
    valid = (pages >= 0) & (pages < P.state.numel())  # not a page: the release drops it
    pages = torch.where(valid, pages, 0)
    st = P.state[pages].to(_I64)
    gen = int(R.gen[row]) if 0 <= row < R.gen.numel() else -1
    mine = (P.owner[pages].to(_I64) == row) & (P.owner_gen[pages] == gen)
    other = (
        ((st == OWNED) & ~mine) | (st == SHARED) | ((st == ALLOCATED) & (P.prior[pages] != FREE))
    )
    return ~other | ~valid


def release_pages(
    P: PageArrays, pages: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages returned to the engine's free list. Returns ([n] bool pages that really go back,
    [n] bool double frees). A page already free (or repeated in the call) is a double free and
    is not pushed twice; a quarantined page is withheld."""
    pages = pages.to(_I64)
    valid = (pages >= 0) & (pages < P.state.numel())  # not a page of this pool: never pushed
    safe = torch.where(valid, pages, 0)
    n = P.state.numel()
    first = _first_occurrence(torch.where(valid, pages, n), n + 1)  # invalid ones: a bucket apart
    st = P.state[safe].to(_I64)
    keep = valid & first & ((st == OWNED) | (st == SHARED) | (st == ALLOCATED))
    double = ~valid | (st == FREE) | ~first
    kp = pages[keep]
    P.prior[kp] = P.state[kp]
    P.state[kp] = FREE
    _push_history(P, kp, Event.FREE, step, NO_ROW)
    return keep, double


def share_pages(P: PageArrays, R: RowArrays, pages: torch.Tensor, row: int, step: int) -> None:
    """The prefix cache took row ``row``'s pages: those it owns become shared."""
    pages = torch.unique(pages.to(_I64))
    pages = pages[(pages >= 0) & (pages < P.state.numel())]
    if not 0 <= row < R.gen.numel():
        return
    own = (
        (P.state[pages] == OWNED)
        & (P.owner[pages].to(_I64) == row)
        & (P.owner_gen[pages] == R.gen[row])
    )
    pages = pages[own]
    P.prior[pages] = OWNED
    P.state[pages] = SHARED
    _push_history(P, pages, Event.SHARE, step, row)


def rebind_row(
    P: PageArrays,
    R: RowArrays,
    row: int,
    first_lpage: int,
    old_pages: torch.Tensor,
    new_pages: torch.Tensor,
    page_size: int,
    step: int,
) -> None:
    """The prefix cache replaced row ``row``'s own copies of logical pages first_lpage... by its
    own: the row's expectation moves to the new pages where they hold the same tokens (same
    chain, full, shared, same place). Elsewhere it stays, so the next read check flags the row."""
    n = min(old_pages.numel(), new_pages.numel())
    old, new = old_pages[:n].to(_I64), new_pages[:n].to(_I64)
    if not 0 <= row < R.gen.numel():
        return
    valid = (old >= 0) & (old < P.state.numel()) & (new >= 0) & (new < P.state.numel())
    old, new = torch.where(valid, old, 0), torch.where(valid, new, 0)
    i = first_lpage + torch.arange(old.numel(), device=old.device)
    ok = (
        valid
        & (old != new)
        & (P.state[new] == SHARED)
        & (P.fill[new].to(_I64) == page_size)
        & (P.fill[old].to(_I64) == page_size)
        & (P.lpage[new].to(_I64) == i)
        & (P.chain[new] == P.chain[old])
    )
    delta = torch.where(ok, page_tag(P.epoch[new], i) - page_tag(P.epoch[old], i), 0)
    R.agg[row] += delta.sum()
    _push_history(P, torch.unique(new[ok]), Event.REBIND, step, row)


def adoptable(
    P: PageArrays, heads: torch.Tensor, tokens: list[int], seed: int, page_size: int
) -> bool:
    """Would a reader with these prompt tokens (and chain seed) adopt the prefix-cache pages whose
    first slots are ``heads`` (logical pages 0.., ``tokens`` covering them whole)? The step
    check's hand-off rule (1.) without the checksum, asked when the prefix cache matches."""
    ps, dev = page_size, P.state.device
    heads = heads.to(_I64).to(dev)
    pages = torch.div(heads, ps, rounding_mode="floor")
    i = torch.arange(pages.numel(), device=dev)
    toks = torch.tensor(tokens, dtype=_I64, device=dev)
    own = seed + torch.cumsum(chain_terms(toks, torch.arange(toks.numel(), device=dev)), 0)
    ok = (
        (heads % ps == 0)
        & (P.state[pages] == SHARED)
        & (P.fill[pages].to(_I64) == ps)
        & (P.lpage[pages].to(_I64) == i)
        & (P.chain[pages] == own[(i + 1) * ps - 1])
    )
    return bool(ok.all())


def quarantine_pages(
    P: PageArrays, pages: torch.Tensor, epochs: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Withhold pages whose content was proven bad, unless re-claimed or handed out since the
    check (``epochs``: their epoch then). Returns (pages quarantined now, those of them that
    were free: to be taken out of the engine's free list)."""
    pages, epochs = pages.to(_I64), epochs.to(_I64)
    st = P.state[pages]
    ok = (P.epoch[pages] == epochs) & (st != ALLOCATED) & (st != QUARANTINED)
    pages = pages[ok]
    was_free = P.state[pages] == FREE
    P.prior[pages] = P.state[pages]
    P.state[pages] = QUARANTINED
    _push_history(P, pages, Event.QUARANTINE, step, NO_ROW)
    return pages, pages[was_free]


def reclaim_pages(
    P: PageArrays, pages: torch.Tensor, epochs: torch.Tensor, step: int
) -> torch.Tensor:
    """Freed pages still validly held by a reader (a premature free caught before reuse) go back
    to what they were; returns them (to be taken out of the engine's free list)."""
    pages, epochs = pages.to(_I64), epochs.to(_I64)
    pr = P.prior[pages]
    ok = (P.state[pages] == FREE) & (P.epoch[pages] == epochs) & ((pr == OWNED) | (pr == SHARED))
    pages = pages[ok]
    P.state[pages] = P.prior[pages]
    P.prior[pages] = FREE
    _push_history(P, pages, Event.RECLAIM, step, NO_ROW)
    return pages


def reset_rows(R: RowArrays, rows: torch.Tensor) -> None:
    """Rows handed to new requests: a new generation, nothing held."""
    rows = rows.to(_I64)
    rows = rows[(rows >= 0) & (rows < R.gen.numel())]
    R.gen[rows] += 1
    R.n_pages[rows] = 0
    R.agg[rows] = 0
    R.chain_len[rows] = 0
    R.chain_tail[rows] = 0


# -- transfers: KV written by another server (prefill/decode disaggregation) -----------------------
# Reference only, on every backend (like quarantine_pages): one call per transferred request.
def claim_transfer(
    P: PageArrays,
    R: RowArrays,
    row: int,
    slots: torch.Tensor,
    tokens: torch.Tensor,
    seed: int,
    page_size: int,
    epoch0: int,
    step: int,
) -> tuple[int, torch.Tensor]:
    """A transfer into row ``row``'s positions [0, n) was issued: ``slots`` [n] are its
    destination slots (the allocator's hand-out, in position order), ``tokens`` [n] the tokens
    whose KV will land there. Each destination page is claimed for the row now, as a forward's
    first write claims it, at epoch ``epoch0 + logical index`` (fresh, unique per claim), but
    sealed nothing (fill 0): until the transfer lands every read of it is unwritten. The row
    holds the pages and the tokens' chain from then on.

    Returns (verdict bits, [n_pages] int64 the pages claimed; empty if the claim failed). The
    claim is all or nothing: a page not freshly handed out (ALLOCATED), a slot out of place, a
    page twice, or a row that already holds KV claims nothing (the transfer is then flagged when
    it lands, and its first read reads unwritten KV)."""
    ps = page_size
    n = slots.numel()
    dev = P.state.device
    none = torch.empty(0, dtype=_I64, device=dev)
    slots = slots.to(_I64).to(dev)
    if n == 0:
        return 0, none
    if (
        not 0 <= row < R.gen.numel()
        or int(slots.min()) < 0
        or int(slots.max()) >= P.state.numel() * ps
    ):
        return MISPLACED_SLOT, none
    pos = torch.arange(n, device=dev)
    pages = torch.div(slots[::ps], ps, rounding_mode="floor")
    i = torch.arange(pages.numel(), device=dev)
    kinds = 0
    lp = torch.div(pos, ps, rounding_mode="floor")
    placed = (slots % ps == pos % ps) & (torch.div(slots, ps, rounding_mode="floor") == pages[lp])
    if not bool(placed.all()):
        kinds |= MISPLACED_SLOT
    if torch.unique(pages).numel() != pages.numel():
        kinds |= DOUBLE_ALLOCATION
    st = P.state[pages].to(_I64)
    if bool(((st == OWNED) | (st == SHARED) | (st == QUARANTINED)).any()):
        kinds |= DOUBLE_ALLOCATION  # handed out while someone holds it
    if bool((st == FREE).any()):
        kinds |= WRONG_OWNER  # freed again before its transfer was issued
    if int(R.n_pages[row]) or int(R.chain_len[row]):
        kinds |= ROW_MISMATCH  # a transfer behind KV the row already holds: not modelled
    if kinds:
        return kinds, none
    chain = seed + torch.cumsum(chain_terms(tokens.to(_I64).to(dev), pos), 0)
    epochs = epoch0 + i
    P.prior[pages] = P.state[pages]
    P.state[pages] = OWNED
    P.epoch[pages] = epochs
    P.owner[pages] = row
    P.owner_gen[pages] = R.gen[row]
    P.lpage[pages] = i.to(torch.int32)
    P.fill[pages] = 0
    P.digest[pages] = 0
    P.chain[pages] = chain[torch.clamp((i + 1) * ps - 1, max=n - 1)]
    _push_history(P, pages, Event.CLAIM, step, row)
    R.n_pages[row] = pages.numel()
    R.agg[row] = page_tag(epochs, i).sum()
    R.chain_len[row] = n
    R.chain_tail[row] = chain[-1]
    return 0, pages


def seal_transfer(
    P: PageArrays,
    R: RowArrays,
    row: int,
    gen: int,
    pages: torch.Tensor,
    epoch0: int,
    n: int,
    buffers: Sequence[KvBuffer],
    page_size: int,
    step: int,
    checksums: bool,
    digests: Callable[..., torch.Tensor] = token_digests_ref,
) -> tuple[int, torch.Tensor]:
    """The transfer claimed by ``claim_transfer`` (row ``row`` at generation ``gen``, ``pages``
    at epochs ``epoch0 + i``, ``n`` tokens) landed. Where every page is still that claim
    (OWNED by the row at that generation and epoch, in place, unsealed) its tokens are sealed
    as a forward's writes are: fill, and in checksum modes the digests of the bytes that
    arrived. Otherwise nothing is sealed (the bytes landed in pages the request no longer holds:
    freed, handed out again, claimed by another) and the transfer is flagged.

    Returns (verdict bits, [k] int64 the pages whose claim changed)."""
    ps = page_size
    dev = P.state.device
    pages = pages.to(_I64).to(dev)
    i = torch.arange(pages.numel(), device=dev)
    ok = (
        (P.state[pages] == OWNED)
        & (P.owner[pages].to(_I64) == row)
        & (P.owner_gen[pages].to(_I64) == gen)
        & (P.epoch[pages] == epoch0 + i)
        & (P.lpage[pages].to(_I64) == i)
        & (P.fill[pages] == 0)
    )
    if int(R.gen[row]) != gen:  # the row was handed to another request since
        ok = torch.zeros_like(ok)
    if not bool(ok.all()):
        return STALE_TRANSFER, pages[~ok]
    fills = torch.clamp(n - i * ps, max=ps)
    P.fill[pages] = fills.to(torch.int16)
    if checksums and pages.numel():
        off = torch.arange(ps, device=dev)
        sealed = (off[None, :] < fills[:, None]).reshape(-1)
        slots = (pages[:, None] * ps + off).reshape(-1)[sealed]
        pos = (i[:, None] * ps + off).reshape(-1)[sealed]
        d = digests(buffers, slots, pos).to(dev)
        P.digest[pages] = torch.zeros(pages.numel(), dtype=_I64, device=dev).index_add_(
            0, torch.div(pos, ps, rounding_mode="floor"), d
        )
    _push_history(P, pages, Event.ARRIVE, step, row)
    return 0, pages[:0]


def range_digest(
    P: PageArrays,
    slots: torch.Tensor,
    buffers: Sequence[KvBuffer],
    page_size: int,
    sealed: bool,
    digests: Callable[..., torch.Tensor] = token_digests_ref,
) -> int | None:
    """The hand-off seal of a request's positions [0, n), held in ``slots`` [n] (in position
    order): the wrapping sum of their token digests. A token digest is keyed by position, not
    slot, so the same bytes at the same positions give the same seal on any server.

    ``sealed``: the sum of the ledger's page digests (checksum modes), i.e. of the bytes as they
    were when written, not as they are now; None where those pages do not hold exactly
    positions [0, n), in place and sealed (the ledger cannot vouch for them). Otherwise the
    bytes in the slots are hashed now."""
    ps, dev = page_size, P.state.device
    n = slots.numel()
    if n == 0:
        return 0
    slots = slots.to(_I64).to(dev)
    if int(slots.min()) < 0 or int(slots.max()) >= P.state.numel() * ps:
        return None
    pos = torch.arange(n, device=dev)
    if not sealed:
        return int(digests(buffers, slots, pos).to(_I64).sum())
    pages = torch.div(slots[::ps], ps, rounding_mode="floor")
    lp = torch.div(pos, ps, rounding_mode="floor")
    i = torch.arange(pages.numel(), device=dev)
    fills = torch.clamp(n - i * ps, max=ps)
    held = P.state[pages].to(_I64)
    ok = (
        bool((slots == pages[lp] * ps + pos % ps).all())
        and torch.unique(pages).numel() == pages.numel()
        and bool((P.lpage[pages].to(_I64) == i).all())
        and bool((P.fill[pages].to(_I64) == fills).all())
        and bool(((held == OWNED) | (held == SHARED)).all())
    )
    return int(P.digest[pages].sum()) if ok else None

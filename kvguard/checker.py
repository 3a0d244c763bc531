"""The checker: turns one step's reads and writes into per-request verdicts, on the device.

Data flow: engine event -> ledger -> checker -> verdict -> action. ``before_forward`` checks every
write target and every page read, claims fresh pages, adopts prefix-cache pages whose token chain
matches the reader, and leaves a ``StepVerdict`` of device tensors; the engine reads it at the sync
point that already follows the forward. ``after_forward`` seals the tokens the forward wrote.
No Python loop over pages or tokens, no host read of a device value on this path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvguard.config import GuardConfig, Mode
from kvguard.kernels.kv_checksum import token_digests
from kvguard.kernels.kv_checksum_ref import splitmix64, to_signed64
from kvguard.ledger import Event, PageLedger, PageState
from kvguard.records import RowRecords
from kvguard.step import StepView
from kvguard.verdict import Kind

_TOKEN_MUL = to_signed64(0x9E3779B97F4A7C15)
# sampled mode sweeps resting KV in batches: every SWEEP_EVERY steps, SWEEP_EVERY steps' worth of
# slots, so a checksum call's fixed cost (dozens of small tensor ops) is paid once per batch. The
# read-set window runs every step: it is what catches a bad token before it is read.
SWEEP_EVERY = 8


def chain_terms(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-token term of the prefix chain: chain(p) = seed + sum_{i<=p} term(token_i, i)."""
    return splitmix64(tokens.to(torch.int64) * _TOKEN_MUL + positions.to(torch.int64))


def segment_prefix_sums(terms: torch.Tensor, seg: torch.Tensor, num_segs: int) -> torch.Tensor:
    """Inclusive prefix sums of ``terms`` restarted at each segment (``seg`` ascending)."""
    cs = torch.cumsum(terms, 0)
    counts = torch.zeros(num_segs, dtype=torch.int64, device=terms.device)
    counts.index_add_(0, seg, torch.ones_like(seg))
    starts = torch.cumsum(counts, 0) - counts
    before = torch.where(starts > 0, cs[(starts - 1).clamp(min=0)], torch.zeros_like(starts))
    return cs - before[seg]


@dataclass(slots=True)
class StepVerdict:
    view: StepView
    kinds: torch.Tensor  # [B] int64 bitmask of Kind per request
    taint: torch.Tensor  # [num_pages] bool: pages whose content this step proved bad
    # epoch of each tainted page when the step was checked (-1 elsewhere; None: nothing tainted):
    # a page re-handed out before the verdict is read is the new owner's, not bad any more
    taint_epoch: torch.Tensor | None = None


class StepChecker:
    def __init__(self, ledger: PageLedger, records: RowRecords, config: GuardConfig, kv_buffers):
        self.ledger = ledger
        self.records = records
        self.config = config
        self.kv_buffers = list(kv_buffers)  # [k0, v0, k1, v1, ...] slot-major
        self.sweep_cursor = 0  # resting-pool sweep position (slots)
        self.read_cursor = 0  # read-set window position (flattened batch x position grid)
        self.tokens_hashed = 0  # host counter of tokens checksummed (metrics)
        # Set by the guard after a quarantine, until the engine flushes its caches: every read is
        # verified (as in paranoid), so readers of a quarantined page whose bytes are intact go on.
        self.escalated = False
        # On CPU a host read of a device value costs nothing (no sync), so a step whose reads are
        # all clean (the common case) skips the per-kind diagnosis; on GPU every step runs the
        # branch-free path so that nothing waits on the device.
        self.host_reads_free = ledger.device.type == "cpu"

    def _digests(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens_hashed += slots.numel()
        return token_digests(self.kv_buffers, slots, positions)

    # -- before the forward ------------------------------------------------------------------------
    def before_forward(self, v: StepView, taint: torch.Tensor | None = None) -> StepVerdict:
        """``taint``: pages already known bad (found between forwards); updated in place."""
        L = self.ledger
        dev = L.device
        B = v.rows.numel()
        kinds = torch.zeros(B, dtype=torch.int64, device=dev)
        if taint is None:
            taint = torch.zeros(L.num_pages, dtype=torch.bool, device=dev)
        rows = v.rows.to(torch.int64)

        def flag(batch_idx: torch.Tensor, mask: torch.Tensor, kind: Kind):
            hit = torch.zeros(B, dtype=torch.int64, device=dev)
            hit.index_add_(0, batch_idx.reshape(-1), mask.reshape(-1).to(torch.int64))
            kinds.bitwise_or_((hit > 0).to(torch.int64) * int(kind))

        if self._sampling() and v.step % SWEEP_EVERY == 0:
            self._sweep(v.step, taint)
        # Reads first: adoption fills the records the write chain continues from.
        reads = self._check_reads(v, rows, taint, flag) if v.max_prefix_len > 0 else None
        if v.write_slots.numel():
            self._check_writes(v, rows, taint, flag)
            # What a request flagged this step writes was computed from KV it should not have
            # read: its pages must not reach the prefix cache (hits through them are refused).
            wb = v.write_batch.to(torch.int64)
            wpage = torch.div(
                v.write_slots.to(torch.int64), self.ledger.page_size, rounding_mode="floor"
            )
            if not (self.host_reads_free and not bool(kinds.any())):
                taint.index_put_((wpage,), kinds[wb] != 0, accumulate=True)
        if reads is not None and not (self.host_reads_free and not bool(taint.any())):
            # A page found bad anywhere this step poisons every read of it.
            bidx, valid, page = reads
            flag(bidx, valid & taint[page], Kind.QUARANTINED_PAGE)
        taint_epoch = None
        if not (self.host_reads_free and not bool(taint.any())):
            taint_epoch = torch.where(taint, L.epoch, torch.full_like(L.epoch, -1))
        return StepVerdict(view=v, kinds=kinds, taint=taint, taint_epoch=taint_epoch)

    def _check_writes(self, v: StepView, rows, taint, flag):
        L, R, ps = self.ledger, self.records, self.ledger.page_size
        b = v.write_batch.to(torch.int64)
        r = rows[b]
        p = v.write_pos.to(torch.int64)
        s = v.write_slots.to(torch.int64)
        page = torch.div(s, ps, rounding_mode="floor")
        lp = torch.div(p, ps, rounding_mode="floor")
        first = (p % ps) == 0  # a token at a page boundary claims a fresh page
        table_ok = v.page_table[r, p].to(torch.int64) == s
        in_place = (s % ps) == (p % ps)
        written = L.written[s]
        st = L.state[page]
        claimable = (st == PageState.FREE) | (st == PageState.ALLOCATED)
        if self.host_reads_free:
            # CPU: check the common case (every target fresh and in place, every claim of a free
            # page, no page claimed twice) at once; diagnose kind by kind only when it fails.
            ok = table_ok & in_place & ~written & (claimable | ~first)
            claimed = page[first]
            clean = bool(ok.all()) and torch.unique(claimed).numel() == claimed.numel()
        else:
            clean = False
        if not clean:
            flag(b, ~table_ok, Kind.TABLE_MISMATCH)
            flag(b, ~in_place, Kind.MISPLACED_SLOT)
            flag(b, written, Kind.OVERWRITE)
            taint.index_put_((page,), written, accumulate=True)
            claimed_busy = first & ~claimable
            flag(b, claimed_busy & (st == PageState.OWNED), Kind.DOUBLE_ALLOCATION)
            flag(b, claimed_busy & (st == PageState.SHARED), Kind.WRITE_TO_SHARED)
            flag(b, claimed_busy & (st == PageState.QUARANTINED), Kind.QUARANTINED_PAGE)
            taint.index_put_((page,), claimed_busy, accumulate=True)
            # Two rows claiming one page in the same step: both are double allocations.
            claims = torch.zeros(L.num_pages, dtype=torch.int64, device=L.device)
            claims.index_add_(0, page, first.to(torch.int64))
            contested = first & (claims[page] > 1)
            flag(b, contested, Kind.DOUBLE_ALLOCATION)
            taint.index_put_((page,), contested, accumulate=True)

        # Claim: epochs are unique per (step, token), so a stale reference never validates.
        epoch = (v.step << 20) + torch.arange(1, s.numel() + 1, device=L.device)
        if self.host_reads_free:
            fi = torch.nonzero(first).reshape(-1)
            if fi.numel():  # most decode steps claim nothing
                cp, cr, clp = page[fi], r[fi], lp[fi]
                L.state[cp] = PageState.OWNED
                L.epoch[cp] = epoch[fi]
                L.owner_row[cp] = cr.to(torch.int32)
                L.lpage[cp] = clp.to(torch.int32)
                R.epoch[cr, clp] = epoch[fi]
                L.record(cp, Event.CLAIM, v.step, cr)
        else:
            cp = torch.where(first, page, torch.zeros_like(page))  # page 0 is SGLang's padding page
            keep = ~first
            L.state[cp] = torch.where(
                keep, L.state[cp], torch.full_like(L.state[cp], PageState.OWNED)
            )
            L.epoch[cp] = torch.where(keep, L.epoch[cp], epoch)
            L.owner_row[cp] = torch.where(keep, L.owner_row[cp], r.to(torch.int32))
            L.lpage[cp] = torch.where(keep, L.lpage[cp], lp.to(torch.int32))
            rr, ll = (
                torch.where(first, r, 0),
                torch.where(first, lp, 0),
            )  # row 0 is SGLang's padding row
            R.epoch[rr, ll] = torch.where(keep, R.epoch[rr, ll], epoch)
            L.record(torch.where(first, page, torch.zeros_like(page)), Event.CLAIM, v.step, r)

        # Every written token: its page must now be ours (claimed above or earlier).
        st = L.state[page]
        mine = (L.epoch[page] == R.epoch[r, lp]) & (st == PageState.OWNED)
        if not (self.host_reads_free and bool(mine.all())):
            flag(b, ~mine & (st == PageState.SHARED), Kind.WRITE_TO_SHARED)
            flag(b, ~mine & (st != PageState.SHARED), Kind.WRONG_OWNER)
            taint.index_put_((page,), ~mine, accumulate=True)

        # Token chain: bound into the slot (the page's tag) and into the reader's record.
        prev = (v.prefix_lens.to(torch.int64) - 1).clamp(min=0)
        base = torch.where(v.prefix_lens > 0, R.chain[rows, prev], self._seeds(v, None))
        terms = chain_terms(v.write_tokens, p)
        if s.numel() == rows.numel() and self.host_reads_free:
            chain = base + terms  # one token per request (decode): b is 0..B-1 in order
        else:
            chain = base[b] + segment_prefix_sums(terms, b, rows.numel())
        L.chain[s] = chain
        R.chain[r, p] = chain
        R.sealed[r, p] = False

    def _seeds(self, v: StepView, b):
        if v.tenant_seeds is None:
            n = v.rows.numel() if b is None else b.numel()
            return torch.zeros(n, dtype=torch.int64, device=self.ledger.device)
        seeds = v.tenant_seeds.to(torch.int64)
        return seeds if b is None else seeds[b]

    def _check_reads(self, v: StepView, rows, taint, flag):
        L, R, ps = self.ledger, self.records, self.ledger.page_size
        dev = L.device
        B = rows.numel()
        pos = torch.arange(v.max_prefix_len, device=dev)[None, :].expand(B, -1)
        valid = pos < v.prefix_lens.to(torch.int64)[:, None]
        bidx = torch.arange(B, device=dev)[:, None].expand_as(pos)
        r = rows[:, None].expand_as(pos)
        slots = v.page_table[r, pos].to(torch.int64)
        slots = torch.where(valid, slots, torch.zeros_like(slots))
        page = torch.div(slots, ps, rounding_mode="floor")
        lp = torch.div(pos, ps, rounding_mode="floor")
        st = L.state[page]
        live = (st == PageState.OWNED) | (st == PageState.SHARED)
        tag_ok = (L.epoch[page] == R.epoch[r, lp]) & live
        if v.prefix_tokens is None and self.host_reads_free:
            in_place = (slots % ps) == (pos % ps)
            clean = tag_ok & (L.chain[slots] == R.chain[r, pos]) & in_place & R.sealed[r, pos]
            if bool((clean | ~valid).all()):
                # Every read carries its reader's tags: only the checksum checks remain.
                self._verify_read_bytes(v, slots, pos, r, bidx, valid, page, taint, flag)
                return bidx, valid, page

        # The token chain the reader expects at each position: from its own prompt on a
        # prefix-cache hand-off (extend steps), else from its own record.
        handoff = v.prefix_tokens is not None
        if handoff:
            pl = v.prefix_lens.to(torch.int64)
            seg = torch.repeat_interleave(torch.arange(B, device=dev), pl)
            tok_pos = torch.arange(seg.numel(), device=dev) - (torch.cumsum(pl, 0) - pl)[seg]
            want = self._seeds(v, seg) + segment_prefix_sums(
                chain_terms(v.prefix_tokens, tok_pos), seg, B
            )
            expected = torch.zeros_like(slots)
            expected[seg, tok_pos] = want
        else:
            expected = R.chain[r, pos]
        chain_ok = L.chain[slots] == expected
        mismatch_kind = Kind.PREFIX_MISMATCH if handoff else Kind.WRONG_OWNER

        # Adopt a live page that holds exactly our prefix (prefix-cache hit, or the cache
        # replacing our copy with its own): re-bind its epoch, take its sealed digest.
        written = L.written[slots]
        adopt = valid & ~tag_ok & live & written & chain_ok
        flag(bidx, valid & ~tag_ok & live & ~chain_ok, mismatch_kind)
        flag(bidx, valid & ~tag_ok & live & chain_ok & ~written, Kind.READ_UNWRITTEN)
        flag(bidx, valid & tag_ok & ~chain_ok, mismatch_kind)
        quarantined = valid & (st == PageState.QUARANTINED)
        stale = valid & ~live & (st != PageState.QUARANTINED)
        flag(bidx, stale, Kind.WRONG_OWNER)
        # A freed page still referenced (use-after-free): withhold it before it is reused.
        taint.index_put_((page.reshape(-1),), stale.reshape(-1), accumulate=True)
        flag(bidx, valid & ((slots % ps) != (pos % ps)), Kind.MISPLACED_SLOT)
        # Masked-out entries land on row 0 / position 0: SGLang never gives row 0 to a request.
        ar = torch.where(adopt, r, torch.zeros_like(r))
        apos = torch.where(adopt, pos, torch.zeros_like(pos))
        alp = torch.div(apos, ps, rounding_mode="floor")
        R.epoch[ar, alp] = torch.where(adopt, L.epoch[page], R.epoch[ar, alp])
        R.chain[ar, apos] = torch.where(adopt, L.chain[slots], R.chain[ar, apos])
        R.digest[ar, apos] = torch.where(adopt, L.digest[slots], R.digest[ar, apos])
        R.sealed[ar, apos] = R.sealed[ar, apos] | adopt
        if self.config.checksums and handoff:
            # Hand-off: the bytes must still be what their writer sealed.
            found = self._digests(slots.reshape(-1), pos.reshape(-1)).view_as(slots)
            bad = adopt & (found != L.digest[slots])
            flag(bidx, bad, Kind.CHECKSUM_MISMATCH)
            taint.index_put_((page.reshape(-1),), bad.reshape(-1), accumulate=True)
        # A slot out of place (entries swapped) is not bad content: it must not taint its page.
        in_place = (slots % ps) == (pos % ps)
        tag_ok = (tag_ok | adopt) & in_place
        flag(bidx, valid & tag_ok & ~R.sealed[r, pos], Kind.READ_UNWRITTEN)
        intact = self._verify_read_bytes(v, slots, pos, r, bidx, valid & tag_ok, page, taint, flag)
        if intact is None:
            flag(bidx, quarantined, Kind.QUARANTINED_PAGE)
        else:
            # A quarantined page still carrying this reader's tag, chain and sealed bytes is read
            # intact (the bad bytes were elsewhere, or a late load has landed): the page stays
            # withheld from reuse, the reader goes on.
            mine = (L.epoch[page] == R.epoch[r, lp]) & chain_ok & in_place & intact
            flag(bidx, quarantined & ~mine, Kind.QUARANTINED_PAGE)
        return bidx, valid, page

    def _verify_all(self) -> bool:
        return self.config.mode is Mode.PARANOID or (self.config.checksums and self.escalated)

    def _sampling(self) -> bool:
        return self.config.mode is Mode.SAMPLED and self.config.sweep_tokens_per_step > 0

    def _verify_read_bytes(self, v: StepView, slots, pos, r, bidx, ok, page, taint, flag):
        """Checksums of the read set: all of it (paranoid, or escalated after a quarantine), or a
        rolling window (sampled). ``ok``: reads whose tags verified. Returns, when every read was
        hashed, which reads are sealed and still hold their sealed bytes; else None."""
        R, ps = self.records, self.ledger.page_size
        if self._verify_all():
            found = self._digests(slots.reshape(-1), pos.reshape(-1)).view_as(slots)
            intact = R.sealed[r, pos] & (found == R.digest[r, pos])
            bad = ok & R.sealed[r, pos] & ~intact
            flag(bidx, bad, Kind.CHECKSUM_MISMATCH)
            taint.index_put_((page.reshape(-1),), bad.reshape(-1), accumulate=True)
            return intact
        if self._sampling():
            # Rolling window over this batch's read set: the KV about to be read is re-hashed
            # first, so a read set within the budget is fully verified every step.
            n = slots.numel()
            k = min(self.config.sweep_tokens_per_step, n)
            idx = (torch.arange(k, device=slots.device) + self.read_cursor) % n
            self.read_cursor = (self.read_cursor + k) % n
            ws, wp, wb, wr = (t.reshape(-1)[idx] for t in (slots, pos, bidx, r))
            wok = ok.reshape(-1)[idx] & R.sealed[wr, wp]
            bad = wok & (self._digests(ws, wp) != R.digest[wr, wp])
            flag(wb, bad, Kind.CHECKSUM_MISMATCH)
            taint.index_put_((torch.div(ws, ps, rounding_mode="floor"),), bad, accumulate=True)
        return None

    def _sweep(self, step: int, taint: torch.Tensor):
        """Re-hash a rolling window of resting slots against their first-seal digests."""
        L, ps = self.ledger, self.ledger.page_size
        n = min(max(self.config.sweep_tokens_per_step // 4, 1) * SWEEP_EVERY, L.num_slots)
        slots = (torch.arange(n, device=L.device) + self.sweep_cursor) % L.num_slots
        self.sweep_cursor = (self.sweep_cursor + n) % L.num_slots
        page = torch.div(slots, ps, rounding_mode="floor")
        pos = L.lpage[page].to(torch.int64) * ps + slots % ps
        live = L.written[slots] & (
            (L.state[page] == PageState.OWNED) | (L.state[page] == PageState.SHARED)
        )
        bad = live & (self._digests(slots, pos.clamp(min=0)) != L.digest[slots])
        taint.index_put_((page,), bad, accumulate=True)

    # -- after the forward -------------------------------------------------------------------------
    def after_forward(self, v: StepView):
        """Seal the tokens this forward wrote: enqueued after its writes, so no sync is needed."""
        if v.write_slots.numel() == 0:
            return
        L, R = self.ledger, self.records
        s = v.write_slots.to(torch.int64)
        p = v.write_pos.to(torch.int64)
        r = v.rows.to(torch.int64)[v.write_batch.to(torch.int64)]
        if self.config.checksums:
            d = self._digests(s, p)
            L.digest[s] = d
            R.digest[r, p] = d
        L.written[s] = True
        R.sealed[r, p] = True

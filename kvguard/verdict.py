"""What the checker concludes: violation kinds (bit flags), a step's verdict, and the forensic
record of one violation."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntFlag
from typing import TYPE_CHECKING

import torch

from kvguard.kernels.guard_ref import StepCheck, StepInputs
from kvguard.kernels.kv_checksum_ref import fmix64, poskey

if TYPE_CHECKING:
    from kvguard.ledger import PageLedger
    from kvguard.records import RowRecords
    from kvguard.step import ReadSums, StepView


class Kind(IntFlag):
    """One bit per check; a request's verdict is the OR of the checks it failed. The values are
    the kernels' (``kernels.guard_ref``)."""

    TABLE_MISMATCH = 1 << 0  # write target is not the slot the request's page table names
    MISPLACED_SLOT = 1 << 1  # a slot's page or offset disagrees with the logical position
    DOUBLE_ALLOCATION = 1 << 2  # a page claimed while another holds it, or twice in one step
    WRONG_OWNER = 1 << 3  # a page read or written is not (or no longer) the request's
    WRITE_TO_SHARED = 1 << 4  # a write into a page the prefix cache shares
    OVERWRITE = 1 << 5  # a write into a slot already written and sealed
    READ_UNWRITTEN = 1 << 6  # a read of a slot never written / sealed
    PREFIX_MISMATCH = 1 << 7  # a shared page's token chain differs from the reader's prefix
    CHECKSUM_MISMATCH = 1 << 8  # a sealed token's bytes changed since sealing
    QUARANTINED_PAGE = 1 << 9  # a read of a page found bad (and not verified intact)
    DOUBLE_FREE = 1 << 10  # engine event: a page released twice
    GUARD_ERROR = 1 << 11  # the guard itself failed on this step: nothing unchecked is served
    ROW_MISMATCH = 1 << 12  # the request's positions or pages disagree with what its row holds
    STALE_FREE = 1 << 13  # engine event: a request freed a page someone else now holds
    PREMATURE_FREE = 1 << 14  # engine event: a page freed while still read (taken back)
    # the bytes attention read differ from those sealed, or were not the request's pages
    READ_MISMATCH = 1 << 15
    # a transfer (KV from another server) landed in slots whose claim changed since it was
    # issued (freed, handed out again, claimed by another request)
    STALE_TRANSFER = 1 << 16
    # a transfer's bytes, as they landed, differ from the sender's seal (changed in flight, sent
    # from the wrong pages or for another request, truncated)
    TRANSFER_MISMATCH = 1 << 17

    def names(self) -> list[str]:
        return [k.name.lower() for k in Kind if k & self and k.name]


ENGINE_EVENTS = Kind.DOUBLE_FREE | Kind.STALE_FREE | Kind.PREMATURE_FREE

_ids = itertools.count(1)


def new_violation_id() -> str:
    """Short, unique within the process; the pid tells schedulers (TP ranks) apart."""
    return f"kvg-{os.getpid():x}-{next(_ids):06d}"


@dataclass(slots=True)
class StepVerdict:
    """One step's verdict, as device tensors until the engine's own post-forward sync."""

    view: StepView
    inputs: StepInputs
    check: StepCheck
    # On a CPU, the pages the check marked (tainted or to reclaim), from its own list; None:
    # none, or a GPU (whose flags are read at resolve)
    suspects: torch.Tensor | None = None
    # With peer ranks on a CPU: the step's agreement, started as soon as the check was done so
    # that it completes during the forward; called at resolve, it returns the agreed words.
    agreement: Callable[[], torch.Tensor] | None = None
    # The seal after the forward failed: the step's reads were checked, its writes not recorded
    seal_failed: bool = False
    # Verified reads, judged after the last layer: [B] bool requests whose read failed, and the
    # pages whose content did (None: reads not verified this step)
    read_bad: torch.Tensor | None = None
    read_pages: torch.Tensor | None = None
    read_flagged: bool = False
    read: ReadSums | None = None  # what attention read, kept for a flagged step's forensics

    # Questions asked before the verdict is resolved (host reads: CPU pools only).
    def found_bad_pages(self) -> bool:
        """Did the check or attention's read find a page whose content is bad?"""
        return self.check.flags()[1] or (
            self.read_pages is not None and bool(self.read_pages.numel())
        )

    def suspects_any(
        self, request_id: str | None, slots: torch.Tensor | None, ledger: PageLedger
    ) -> bool:
        """Was this request flagged, or does one of these slots sit in a page found bad?"""
        flagged, tainted, _ = self.check.flags()
        read_bad = self.read_bad if self.read_flagged else None  # what attention read failed
        v = self.view
        if request_id is not None and (flagged or read_bad is not None) and v.request_ids:
            B = len(v.prefix_lens_host)
            kinds = self.check.kinds[:B].tolist()
            bad = read_bad[:B].tolist() if read_bad is not None else [False] * B
            ids = v.request_ids
            if any(rid == request_id and (k or b) for rid, k, b in zip(ids, kinds, bad)):
                return True
        if slots is not None and (tainted or read_bad is not None):
            pages = ledger.pages_of(slots.to(ledger.device))
            if tainted and bool(self.check.taint[pages].any()):
                return True
            if self.read_pages is not None and self.read_pages.numel():
                return bool(torch.isin(pages, self.read_pages.to(pages.device)).any())
        return False


@dataclass(slots=True)
class Violation:
    """A request's KV failed a check. Everything needed to file an engine bug from the log alone."""

    id: str
    kinds: Kind
    step: int
    request: str | None  # engine request id; None for engine-level events (double free)
    row: int | None
    pages: list[dict[str, object]] = field(default_factory=list)  # suspect pages, with history
    # what became of the request: "abort", "recompute", or "none" (it had finished already)
    action: str = "abort"
    recomputes: int = 0  # how often the request has been recomputed, this one included
    why_not_healed: str | None = None  # an abort where recompute was configured: why

    @property
    def message(self) -> str:
        return (
            f"KV cache integrity violation {self.id}: {', '.join(self.kinds.names())}; "
            "request aborted by kvguard before its output could be corrupted"
        )

    def as_event(self) -> dict[str, object]:
        return {
            "violation_id": self.id,
            "kinds": self.kinds.names(),
            "step": self.step,
            "request": self.request,
            "row": self.row,
            "pages": self.pages,
            "action": self.action,
            "recomputes": self.recomputes,
            **({"why_not_healed": self.why_not_healed} if self.why_not_healed else {}),
        }


def forensic_record(
    verdict: StepVerdict, b: int, kinds: Kind, ledger: PageLedger, records: RowRecords
) -> Violation:
    """Slow path: name request b's suspect pages (read or written), with what the ledger holds
    and why each one is suspect. The request's pages are read in one gather, the suspects'
    histories in another (each field read page by page would be a device sync each)."""
    v, c, ps = verdict.view, verdict.check, ledger.page_size
    P = ledger.pages
    row = int(v.rows[b])
    n = v.prefix_lens_host[b]
    gen = int(records.rows.gen[row])
    reasons: dict[int, list[dict[str, object]]] = {}

    def note(page: int, why: str, position: int, slot: int, write: bool = False) -> None:
        if page not in reasons and len(reasons) >= 8:
            return
        positions = reasons.setdefault(page, [])
        if len(positions) < 8:
            positions.append({"position": position, "slot": slot, "write": write, "why": why})

    heads_t = v.page_table[row, :n:ps].to(torch.int64) if n else torch.empty(0, dtype=torch.int64)
    pg_t = torch.div(heads_t, ps, rounding_mode="floor").to(P.state.device)
    cols = torch.stack(
        [
            P.state[pg_t].to(torch.int64),
            P.owner[pg_t].to(torch.int64),
            P.owner_gen[pg_t].to(torch.int64),
            P.lpage[pg_t].to(torch.int64),
            P.fill[pg_t].to(torch.int64),
            c.taint[pg_t].to(torch.int64),
        ]
    ).cpu()
    heads = heads_t.cpu().tolist()
    for i, head in enumerate(heads):
        pg = head // ps
        st, owner, og, lpage, fill, tainted = (int(x) for x in cols[:, i])
        at = {"position": i * ps, "slot": head}
        if head % ps or lpage != i:
            note(pg, "misplaced", **at)
        if st == 1 and (owner != row or og != gen):
            note(pg, "owned_by_another_row", **at)
        if st in (0, 4):
            note(pg, "freed" if st == 0 else "handed_out_again", **at)
        if st == 3:
            note(pg, "quarantined", **at)
        if fill < min(ps, n - i * ps):
            note(pg, "unsealed_tokens", **at)
        if tainted:
            note(pg, "content_bad", **at)
    mine = torch.nonzero(verdict.inputs.batch_index().cpu() == b).reshape(-1)
    if mine.numel():
        ok = c.write_ok[mine.to(c.write_ok.device)].cpu()
        for j in mine[~ok].tolist():
            t = int(c.targets[j])
            note(t // ps, "write_refused", int(v.write_pos[j]), t, write=True)
    if kinds & Kind.READ_MISMATCH and verdict.read is not None:
        _note_read(verdict, verdict.read, b, ledger, note)
    if not reasons and heads:  # only the row's page-tag sum disagrees: a page was swapped
        for i, head in enumerate(heads[:8]):
            note(head // ps, "row_tags_disagree", i * ps, head)
    described = ledger.describe_many(list(reasons))
    suspects = [{**d, "positions": reasons[int(d["page"])]} for d in described]  # type: ignore[call-overload]
    rid = v.request_ids[b] if v.request_ids else None
    return Violation(new_violation_id(), kinds, v.step, rid, row, suspects)


def guard_errors(handles: list[object], step: int) -> list[Violation]:
    """One GUARD_ERROR violation per request of a step the guard could not judge."""
    return [
        Violation(new_violation_id(), Kind.GUARD_ERROR, step, getattr(h, "rid", None), None)
        for h in handles
    ]


def step_violations(
    verdict: StepVerdict | None,
    handles: list[object],
    kinds: torch.Tensor,
    step: int,
    ledger: PageLedger,
    records: RowRecords,
) -> tuple[list[Violation], list[object]]:
    """The violations of a step's flagged requests (``kinds``: the agreed verdict bits), and
    their handles: forensic records, or bare ones where this rank has no verdict to name pages
    from (or the guard could not judge the step)."""
    violations: list[Violation] = []
    bad: list[object] = []
    for b in torch.nonzero(kinds).reshape(-1).tolist():
        kind = Kind(int(kinds[b]))
        if verdict is None or kind == Kind.GUARD_ERROR:
            rid = getattr(handles[b], "rid", None)
            violations.append(Violation(new_violation_id(), kind, step, rid, None))
        else:
            violations.append(forensic_record(verdict, b, kind, ledger, records))
        bad.append(handles[b])
    return violations, bad


def reads_not_checked(verdict: StepVerdict, read: ReadSums) -> list[int]:
    """The requests whose attention read is not the one the step check judged: another page-table
    row (a neighbour's rows verify as the neighbour's) or another length than the positions it
    held plus those it wrote (indices or lengths changed after the check)."""
    x = verdict.inputs
    want_rows, want_lens = _checked_reads(verdict)
    if read.seq_lens == want_lens and torch.equal(read.req_rows, x.rows.cpu()):
        return []
    got_rows = read.req_rows.tolist()
    return [
        b
        for b in range(len(want_lens))
        if b >= len(read.seq_lens)
        or read.seq_lens[b] != want_lens[b]
        or got_rows[b] != want_rows[b]
    ]


def _checked_reads(verdict: StepVerdict) -> tuple[list[int], list[int]]:
    """(page-table row, positions read) per request, as the step check judged them."""
    x = verdict.inputs
    B = len(x.prefix_lens_host)
    if x.write_batch is None:  # decode: one write each
        lens = [n + 1 for n in x.prefix_lens_host]
    else:
        counts = torch.bincount(x.write_batch.cpu(), minlength=B)[:B].tolist()
        lens = [n + c for n, c in zip(x.prefix_lens_host, counts)]
    return x.rows.cpu().tolist(), lens


def _note_read(
    verdict: StepVerdict,
    read: ReadSums,
    b: int,
    ledger: PageLedger,
    note: Callable[[int, str, int, int], None],
) -> None:
    """Slow path: which page of request b's read failed, and how (the torch reference of
    ``verify_reads`` for one request): read another row or length than checked, a position out of
    place, a page sealed less or more far than read, or the digests read not adding up to the
    page's sealed digest (its bytes are not what their writer stored)."""
    ps, P = ledger.page_size, ledger.pages
    if b >= len(read.seq_lens):
        return
    start, L = sum(read.seq_lens[:b]), read.seq_lens[b]
    rows = read.rows[start : start + L].to(torch.int64).cpu()
    acc = read.acc[start : start + L].cpu()
    if b in reads_not_checked(verdict, read) and L and 0 <= int(rows[0]) < ledger.num_slots:
        note(int(rows[0]) // ps, "read_other_row_or_length", 0, int(rows[0]))
    digests = fmix64(acc ^ poskey(torch.arange(L, dtype=torch.int64)))
    for j in range(-(-L // ps)):
        lo, hi = j * ps, min(L, (j + 1) * ps)
        head = int(rows[lo])
        if not 0 <= head < ledger.num_slots:
            continue  # never read (a slot outside the pool): the verdict says so
        page = head // ps
        want = page * ps + torch.arange(hi - lo)
        off = torch.nonzero(rows[lo:hi] != want).reshape(-1)
        if off.numel():
            p = lo + int(off[0])
            note(page, "read_misplaced", p, int(rows[p]))
        elif int(P.fill[page]) != hi - lo:
            note(page, "read_unsealed", lo, head)
        elif int(digests[lo:hi].sum()) != int(P.digest[page]):
            note(page, "read_digest_mismatch", lo, head)

"""What the checker concludes: violation kinds (bit flags), a step's verdict, and the forensic
record of one violation."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from enum import IntFlag
from typing import TYPE_CHECKING

import torch

from kvguard.kernels.guard_ref import StepCheck, StepInputs

if TYPE_CHECKING:
    from kvguard.ledger import PageLedger
    from kvguard.records import RowRecords
    from kvguard.step import StepView


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
    # epoch of each tainted or reclaimable page when the step was checked (-1 elsewhere; None:
    # neither): a page handed out again before the verdict is read is the new owner's
    epochs: torch.Tensor | None = None


@dataclass(slots=True)
class Violation:
    """A request's KV failed a check. Everything needed to file an engine bug from the log alone."""

    id: str
    kinds: Kind
    step: int
    request: str | None  # engine request id; None for engine-level events (double free)
    row: int | None
    pages: list[dict[str, object]] = field(default_factory=list)  # suspect pages, with history

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
        }


def forensic_record(
    verdict: StepVerdict, b: int, kinds: Kind, ledger: PageLedger, records: RowRecords
) -> Violation:
    """Slow path: name request b's suspect pages (read or written), with what the ledger holds
    and why each one is suspect."""
    v, c, ps = verdict.view, verdict.check, ledger.page_size
    P = ledger.pages
    row = int(v.rows[b])
    n = v.prefix_lens_host[b]
    gen = int(records.rows.gen[row])
    suspects: dict[int, dict[str, object]] = {}

    def note(page: int, why: str, position: int, slot: int, write: bool = False) -> None:
        if page not in suspects and len(suspects) >= 8:
            return
        entry = suspects.setdefault(page, {**ledger.describe(page), "positions": []})
        positions = entry["positions"]
        assert isinstance(positions, list)
        if len(positions) < 8:
            positions.append({"position": position, "slot": slot, "write": write, "why": why})

    heads = v.page_table[row, :n:ps].to(torch.int64).cpu().tolist() if n else []
    for i, head in enumerate(heads):
        pg = head // ps
        st, owner, og = int(P.state[pg]), int(P.owner[pg]), int(P.owner_gen[pg])
        at = {"position": i * ps, "slot": head}
        if head % ps or int(P.lpage[pg]) != i:
            note(pg, "misplaced", **at)
        if st == 1 and (owner != row or og != gen):
            note(pg, "owned_by_another_row", **at)
        if st in (0, 4):
            note(pg, "freed" if st == 0 else "handed_out_again", **at)
        if st == 3:
            note(pg, "quarantined", **at)
        if int(P.fill[pg]) < min(ps, n - i * ps):
            note(pg, "unsealed_tokens", **at)
        if bool(c.taint[pg]):
            note(pg, "content_bad", **at)
    mine = torch.nonzero(verdict.inputs.batch_index().cpu() == b).reshape(-1)
    for j in mine.tolist():
        if not bool(c.write_ok[j]):
            t = int(c.targets[j])
            note(t // ps, "write_refused", int(v.write_pos[j]), t, write=True)
    if not suspects and heads:  # only the row's page-tag sum disagrees: a page was swapped
        for i, head in enumerate(heads[:8]):
            note(head // ps, "row_tags_disagree", i * ps, head)
    rid = v.request_ids[b] if v.request_ids else None
    return Violation(new_violation_id(), kinds, v.step, rid, row, list(suspects.values()))

"""What the checker concludes: violation kinds (bit flags) and the forensic record of one violation."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from enum import IntFlag


class Kind(IntFlag):
    """One bit per check; a request's verdict is the OR of the checks it failed."""

    TABLE_MISMATCH = 1 << 0  # write target is not the slot the request's page table names
    MISPLACED_SLOT = 1 << 1  # slot offset inside its page disagrees with the logical position
    DOUBLE_ALLOCATION = 1 << 2  # a page handed to a writer while another owner holds it
    WRONG_OWNER = 1 << 3  # a page read or written is not (or no longer) the request's
    WRITE_TO_SHARED = 1 << 4  # a write into a page the prefix cache shares
    OVERWRITE = 1 << 5  # a write into a slot already written and sealed
    READ_UNWRITTEN = 1 << 6  # a read of a slot never written / sealed
    PREFIX_MISMATCH = 1 << 7  # a shared page's token chain differs from the reader's prefix
    CHECKSUM_MISMATCH = 1 << 8  # a sealed token's bytes changed since sealing
    QUARANTINED_PAGE = 1 << 9  # a read of a page the guard quarantined
    DOUBLE_FREE = 1 << 10  # a page released twice (engine-level, no request attached)
    GUARD_ERROR = 1 << 11  # the guard itself failed on this step: nothing unchecked is served

    def names(self) -> list[str]:
        return [k.name.lower() for k in Kind if k & self]


_ids = itertools.count(1)


def new_violation_id() -> str:
    """Short, unique within the process; the pid tells schedulers (TP ranks) apart."""
    return f"kvg-{os.getpid():x}-{next(_ids):06d}"


@dataclass(slots=True)
class Violation:
    """A request's KV failed a check. Everything needed to file an engine bug from the log alone."""

    id: str
    kinds: Kind
    step: int
    request: str | None  # engine request id; None for engine-level events (double free)
    row: int | None
    pages: list[dict] = field(default_factory=list)  # per suspect page: expected vs found, history

    @property
    def message(self) -> str:
        return (
            f"KV cache integrity violation {self.id}: {', '.join(self.kinds.names())}; "
            "request aborted by kvguard before its output could be corrupted"
        )

    def as_event(self) -> dict:
        return {
            "violation_id": self.id,
            "kinds": self.kinds.names(),
            "step": self.step,
            "request": self.request,
            "row": self.row,
            "pages": self.pages,
        }

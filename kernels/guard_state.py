"""The guard's device state as plain arrays, and the values its kernels agree on.

``PageArrays`` (one entry per KV page) and ``RowArrays`` (one entry per page-table row) are what
every kernel backend (the torch reference in ``guard_ref``, the compiled CPU kernels in
``guard_cpu``, the Triton kernels in ``guard_triton``) reads and writes. They grow with the pool
(pages) and the number of rows, never with rows x context: a reader's expectation of the pages it
holds is one wrapping sum per row (``RowArrays.agg``), not one record per position.
``kvguard.ledger.PageLedger`` and ``kvguard.records.RowRecords`` own them and their transitions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum

import torch


class PageState(IntEnum):
    FREE = 0  # in the engine's free list
    OWNED = 1  # claimed by one request row (its first token written)
    SHARED = 2  # held by the prefix cache; readers adopt it
    QUARANTINED = 3  # content proven bad: withheld from reuse until the pool is flushed
    ALLOCATED = 4  # handed out by the engine's allocator, not yet claimed by a writer


class Event(IntEnum):
    """History entries (4 bits): what happened to a page, at which step, for which row."""

    CLAIM = 1
    SHARE = 3
    FREE = 4
    QUARANTINE = 5
    ALLOC = 6
    RECLAIM = 7  # a freed page still validly held: taken back from the free list
    REBIND = 8  # the prefix cache replaced a row's own copy of this page by its own
    SCRUB = 9  # a quarantined page's bytes zeroed and its entry reset: back in service
    ARRIVE = 10  # a transfer claimed for the page's row landed: its tokens sealed


HISTORY = 4  # events kept per page
NO_ROW = 0xFFFFF  # history's row field when no row is involved
EPOCH_STEP_SHIFT = 24  # claim epoch = step << 24 | (write index + 1): unique per claim
MAX_WRITES_PER_STEP = (1 << EPOCH_STEP_SHIFT) - 1
# bytes per page the CPU backend keeps outside the ledger: two workspaces x (taint + reclaim)
WORKSPACE_BYTES_PER_PAGE = 4
# the Triton backend's (CUDA pools): 4 int32 scratch words + 3 flag bytes in each of 3 workspaces
TRITON_WORKSPACE_BYTES_PER_PAGE = 25

_I64 = torch.int64
_I32 = torch.int32


@dataclass(slots=True)
class PageArrays:
    state: torch.Tensor  # [P] uint8 PageState
    prior: torch.Tensor  # [P] uint8 state before the last release / hand-out / quarantine
    fill: torch.Tensor  # [P] int16 tokens sealed (written and their forward done), in order
    owner: torch.Tensor  # [P] int32 row of the claim (kept after release: forensics, reclaim)
    owner_gen: torch.Tensor  # [P] int32 that row's generation at the claim
    lpage: torch.Tensor  # [P] int32 logical page index in the claiming row
    epoch: torch.Tensor  # [P] int64 claim id (0: never claimed)
    chain: torch.Tensor  # [P] int64 token chain at the page's last written token
    digest: torch.Tensor  # [P] int64 wrapping sum of the sealed tokens' digests
    history: torch.Tensor  # [P, HISTORY] int64 (step << 24 | event << 20 | row), newest first

    @classmethod
    def empty(cls, num_pages: int, device: torch.device | str) -> PageArrays:
        d = torch.device(device)

        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(num_pages, dtype=dtype, device=d)

        return cls(
            state=z(torch.uint8),
            prior=z(torch.uint8),
            fill=z(torch.int16),
            owner=torch.full((num_pages,), -1, dtype=_I32, device=d),
            owner_gen=z(_I32),
            lpage=torch.full((num_pages,), -1, dtype=_I32, device=d),
            epoch=z(_I64),
            chain=z(_I64),
            digest=z(_I64),
            history=torch.zeros(num_pages, HISTORY, dtype=_I64, device=d),
        )

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def clone(self) -> PageArrays:
        return PageArrays(*(t.clone() for t in self.tensors()))


@dataclass(slots=True)
class RowArrays:
    gen: torch.Tensor  # [R] int32 bumped each time the row is handed to a new request
    n_pages: torch.Tensor  # [R] int32 pages held (claimed or adopted): logical pages [0, n_pages)
    agg: torch.Tensor  # [R] int64 sum over held pages i of page_tag(epoch_i, i) (wrapping)
    chain_len: torch.Tensor  # [R] int32 positions written or adopted: [0, chain_len)
    chain_tail: torch.Tensor  # [R] int64 token chain at position chain_len - 1 (0 if none)

    @classmethod
    def empty(cls, num_rows: int, device: torch.device | str) -> RowArrays:
        d = torch.device(device)

        def z(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(num_rows, dtype=dtype, device=d)

        return cls(gen=z(_I32), n_pages=z(_I32), agg=z(_I64), chain_len=z(_I32), chain_tail=z(_I64))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def clone(self) -> RowArrays:
        return RowArrays(*(t.clone() for t in self.tensors()))

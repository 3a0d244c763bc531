"""Reader-held records: what each request row expects of the KV it holds.

Like a ZFS block pointer, the expectation lives with the reader, never with the page, so whoever
claims a page next cannot refresh it. Compactly: per row, the wrapping sum of
``page_tag(epoch, logical index)`` over the pages it holds, their count, and the token chain it
has written up to (``kernels.guard_state.RowArrays``: 28 bytes per row). Rows are SGLang's
``req_to_token`` rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvguard.kernels.backend import per_request
from kvguard.kernels.guard_state import RowArrays

if TYPE_CHECKING:
    from kvguard.ledger import PageLedger


class RowRecords:
    def __init__(self, num_rows: int, device: torch.device | str, kernels: object = None):
        self.num_rows = num_rows
        self.device = torch.device(device)
        self.kernels = kernels  # the backend (its per-request transitions, where it has them)
        self.rows = RowArrays.empty(num_rows, self.device)

    def nbytes(self) -> int:
        return self.rows.nbytes()

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Rows handed to new requests: a new generation, nothing held."""
        rows = rows if rows.device == self.device else rows.to(self.device)
        per_request(self.kernels, "reset_rows")(self.rows, rows)

    def rebind(
        self,
        pages: PageLedger,
        row: int,
        first_lpage: int,
        old_pages: torch.Tensor,
        new_pages: torch.Tensor,
        step: int,
    ) -> None:
        """The prefix cache replaced the row's own copies of some pages by its own."""
        per_request(self.kernels, "rebind_row")(
            pages.pages, self.rows, row, first_lpage, old_pages, new_pages, pages.page_size, step
        )

    def reset(self) -> None:
        """The engine cleared its pool: no row holds anything (generations stay: they only grow)."""
        for t in (self.rows.n_pages, self.rows.agg, self.rows.chain_len, self.rows.chain_tail):
            t.zero_()

"""Reader-held records: what each request row expects of the KV it holds.

Like a ZFS block pointer, the expectation lives with the reader, never with the page, so whoever
claims a page next cannot refresh it. Compactly: per row, the wrapping sum of
``page_tag(epoch, logical index)`` over the pages it holds, their count, and the token chain it
has written up to (``kernels.guard_state.RowArrays``: 28 bytes per row). Rows are SGLang's
``req_to_token`` rows.
"""

from __future__ import annotations

import torch

from kvguard.kernels.backend import per_request
from kvguard.kernels.guard_state import RowArrays


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

    def reset(self) -> None:
        """The engine cleared its pool: no row holds anything (generations stay: they only grow)."""
        for t in (self.rows.n_pages, self.rows.agg, self.rows.chain_len, self.rows.chain_tail):
            t.zero_()

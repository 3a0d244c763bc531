"""Transfers: KV that another server writes into this one's pool (prefill/decode disaggregation).

A transfer is a writer the guard checks, as a forward is, but split in time: its destination
pages are claimed for the receiving request when it is issued (``TransferClaims.issue``: owned
by the request's row at a fresh epoch, nothing sealed), and sealed when it lands
(``TransferClaims.land``: the tokens' fill and, in checksum modes, the digests of the bytes that
arrived), provided the claim is still the one issued. Between the two, a read of those pages is
a read of unwritten KV; a landing into pages whose claim changed meanwhile (freed, handed out
again, claimed by another request, the row handed to another request) seals nothing and is
flagged (``STALE_TRANSFER``). The arithmetic is ``kernels.guard_ref.claim_transfer`` and
``seal_transfer``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvguard.kernels import guard_ref
from kvguard.kernels.guard_state import EPOCH_STEP_SHIFT
from kvguard.kernels.kv_checksum_ref import KvBuffer
from kvguard.ledger import PageLedger
from kvguard.records import RowRecords

# Claims made between two forwards take epochs of the next step, above any write index of its
# forward: (step << 24) | (2**23 + k). A forward writes fewer than 2**23 tokens.
_TRANSFER_BASE = 1 << (EPOCH_STEP_SHIFT - 1)
_TRANSFER_MAX = (1 << (EPOCH_STEP_SHIFT - 1)) - 1


@dataclass(slots=True)
class TransferClaim:
    row: int
    gen: int  # the row's generation when the transfer was issued
    pages: torch.Tensor  # [n_pages] int64, logical page i at pages[i]
    epoch0: int  # page i's claim epoch is epoch0 + i
    num_tokens: int
    kinds: int  # verdict bits of the claim itself (nonzero: nothing was claimed)


class TransferClaims:
    """Transfers issued and not landed yet, by destination row (a row holds one request)."""

    def __init__(self, ledger: PageLedger, records: RowRecords):
        self.ledger = ledger
        self.records = records
        self._by_row: dict[int, TransferClaim] = {}
        self._epoch_step = -1
        self._epoch_used = 0

    def __len__(self) -> int:
        return len(self._by_row)

    def pending(self, row: int) -> TransferClaim | None:
        return self._by_row.get(row)

    def _epochs(self, step: int, count: int) -> int:
        if step != self._epoch_step:
            self._epoch_step, self._epoch_used = step, 0
        if self._epoch_used + count > _TRANSFER_MAX:
            raise RuntimeError(f"more than {_TRANSFER_MAX} transfer pages claimed in one step")
        first = (step << EPOCH_STEP_SHIFT) + _TRANSFER_BASE + self._epoch_used
        self._epoch_used += count
        return first

    def issue(
        self, row: int, slots: torch.Tensor, tokens: torch.Tensor, seed: int, step: int
    ) -> int:
        """A transfer of ``tokens`` (positions [0, n)) into ``slots`` of row ``row`` was issued:
        claim its pages. Returns the claim's verdict bits (0: claimed)."""
        ps = self.ledger.page_size
        n_pages = -(-slots.numel() // ps)
        # Issued after forward ``step`` (whose verdict may not be read yet), before the next: its
        # epochs carry the next step's number, so that verdict never takes them for its own
        # (Guard._my_pages keeps epochs of its step or earlier).
        epoch0 = self._epochs(step + 1, n_pages)
        kinds, pages = guard_ref.claim_transfer(
            self.ledger.pages, self.records.rows, row, slots, tokens, seed, ps, epoch0, step
        )
        gen = int(self.records.rows.gen[row]) if 0 <= row < self.records.num_rows else -1
        self._by_row[row] = TransferClaim(row, gen, pages, epoch0, slots.numel(), kinds)
        return kinds

    def land(
        self,
        row: int,
        step: int,
        buffers: Sequence[KvBuffer],
        checksums: bool,
        digests: Callable[..., torch.Tensor],
    ) -> tuple[int, torch.Tensor]:
        """The transfer into row ``row`` landed: seal it if its claim is unchanged. Returns
        (verdict bits, pages to name in a violation). A row with no claim issued (the guard
        failed when it was) fails closed."""
        claim = self._by_row.pop(row, None)
        none = torch.empty(0, dtype=torch.int64)
        if claim is None:
            return int(guard_ref.STALE_TRANSFER), none
        if claim.kinds:
            return claim.kinds, none
        return guard_ref.seal_transfer(
            self.ledger.pages,
            self.records.rows,
            row,
            claim.gen,
            claim.pages,
            claim.epoch0,
            claim.num_tokens,
            buffers,
            self.ledger.page_size,
            step,
            checksums,
            digests,
        )

    def forget(self, rows: torch.Tensor) -> None:
        """Rows handed to new requests: the claims of their previous requests are dropped."""
        if self._by_row:
            for r in rows.tolist():
                self._by_row.pop(int(r), None)

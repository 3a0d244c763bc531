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

The sender seals what it sends (``TransferClaims.send_seal``: the wrapping sum of the token
digests of the transferred positions, from the sender's ledger where it keeps digests); the seal
travels with the request, and the receiver compares it with the bytes that landed, once, as it
seals them (``land``'s ``sent_seal``): bytes changed in flight, taken from the wrong pages or sent
for another request are ``TRANSFER_MISMATCH``. Seals are compared only between servers of one
layout (``layout_signature``): the same buffers, rows of the same width, the same TP shard.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvguard.kernels import guard_ref
from kvguard.kernels.guard_state import EPOCH_STEP_SHIFT
from kvguard.kernels.kv_checksum_ref import DIGEST_VERSION, KvBuffer, row_words
from kvguard.ledger import PageLedger
from kvguard.records import RowRecords
from kvguard.verdict import Kind, Violation, new_violation_id

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

    def __init__(
        self,
        ledger: PageLedger,
        records: RowRecords,
        buffers: Sequence[KvBuffer],
        digests: Callable[..., torch.Tensor],
    ):
        """``buffers``: the guarded KV buffers; ``digests``: the token digests of the kernel
        backend (``token_digests_ref``'s signature)."""
        self.ledger = ledger
        self.records = records
        self.buffers = buffers
        self.digests = digests
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
        # (Agreement.my_pages keeps epochs of its step or earlier).
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
        checksums: bool,
        request_id: str | None = None,
        sent_seal: int | None = None,
        sent_tokens: int | None = None,
    ) -> Violation | None:
        """The transfer into row ``row`` (request ``request_id``) landed: seal it if its claim is
        unchanged, and where the sender's seal came with it (``sent_tokens``: how many positions
        it covers; ``sent_seal`` None: the sender could not vouch for them) compare the landed
        bytes with it. Returns the violation, if any. A row with no claim issued (the guard
        failed when it was) fails closed."""
        kinds, pages = self._seal_landed(row, step, checksums, sent_seal, sent_tokens)
        if not kinds:
            return None
        described = self.ledger.describe_many(pages[:8].tolist())
        return Violation(new_violation_id(), Kind(kinds), step, request_id, row, described)

    def _seal_landed(
        self, row: int, step: int, checksums: bool, sent_seal: int | None, sent_tokens: int | None
    ) -> tuple[int, torch.Tensor]:
        """(verdict bits, pages to name in a violation) of ``land``."""
        claim = self._by_row.pop(row, None)
        none = torch.empty(0, dtype=torch.int64)
        if claim is None:
            return int(guard_ref.STALE_TRANSFER), none
        if claim.kinds:
            return claim.kinds, none
        kinds, pages = guard_ref.seal_transfer(
            self.ledger.pages,
            self.records.rows,
            row,
            claim.gen,
            claim.pages,
            claim.epoch0,
            claim.num_tokens,
            self.buffers,
            self.ledger.page_size,
            step,
            checksums,
            self.digests,
        )
        if kinds or sent_tokens is None:
            return kinds, pages
        if sent_seal is None or sent_tokens != claim.num_tokens:  # unvouched, or truncated
            return int(guard_ref.TRANSFER_MISMATCH), claim.pages
        ps = self.ledger.page_size
        off = torch.arange(ps, device=claim.pages.device)
        slots = (claim.pages[:, None] * ps + off).reshape(-1)[: claim.num_tokens]
        # checksum modes sealed the landed bytes' digests just now: their sum is the landed seal
        landed = guard_ref.range_digest(
            self.ledger.pages, slots, self.buffers, ps, checksums, self.digests
        )
        if landed != sent_seal:
            return int(guard_ref.TRANSFER_MISMATCH), claim.pages
        return 0, pages

    def send_seal(self, slots: torch.Tensor, checksums: bool) -> int | None:
        """The sender's seal of the positions [0, n) it sends from ``slots`` [n]: in checksum
        modes the ledger's digests of the bytes as they were written (None where the ledger does
        not hold exactly those positions sealed: nothing to vouch with), else the bytes now."""
        return guard_ref.range_digest(
            self.ledger.pages, slots, self.buffers, self.ledger.page_size, checksums, self.digests
        )

    def forget(self, rows: torch.Tensor) -> None:
        """Rows handed to new requests: the claims of their previous requests are dropped."""
        if self._by_row:
            for r in rows.tolist():
                self._by_row.pop(int(r), None)


def layout_signature(buffers: Sequence[KvBuffer], *shape: int) -> int:
    """A 31-bit word naming the layout a seal was taken under: each guarded buffer's row width in
    words and element type, ``shape`` (page size, TP rank and size) and the digest's definition
    (``DIGEST_VERSION``). Two servers compare seals only when their words agree: other layouts
    hash other bytes for the same KV, other versions hash them differently."""
    rows = [(int(row_words(b).shape[-1]), str(getattr(b, "dtype", "page-major"))) for b in buffers]
    return zlib.crc32(repr((rows, shape, DIGEST_VERSION)).encode()) & 0x7FFFFFFF

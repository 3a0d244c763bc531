"""The page ledger: what the guard believes about every KV page and slot, as device tensors.

Per page: state, epoch (fresh per claim, so a stale reference never validates), the row that
claimed it, its logical page index in that row, and a short event history for forensics.
Per slot: written (sealed) bit, the token chain it was written under, and its first-seal digest
(the prefix cache's record, handed to new readers). All updates are vectorized scatters on the
pool's device; nothing here loops over pages in Python or reads a device value on the host.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class PageState(IntEnum):
    FREE = 0
    OWNED = 1  # claimed by one request row
    SHARED = 2  # held by the prefix cache; readers adopt it
    QUARANTINED = 3  # suspect: never handed out again, any read is a violation
    ALLOCATED = 4  # handed out by the engine's allocator, not yet written by a request


class Event(IntEnum):
    ALLOC = 6
    CLAIM = 1
    SEAL = 2
    SHARE = 3
    FREE = 4
    QUARANTINE = 5


class PageLedger:
    HISTORY = 4  # events kept per page

    def __init__(self, num_slots: int, page_size: int, device: torch.device | str):
        self.page_size = page_size
        self.num_slots = num_slots  # including the padding slots SGLang reserves
        self.num_pages = (num_slots + page_size - 1) // page_size
        self.device = torch.device(device)
        p, s, d = self.num_pages, num_slots, self.device
        self.state = torch.zeros(p, dtype=torch.int8, device=d)
        self.epoch = torch.zeros(p, dtype=torch.int64, device=d)
        self.owner_row = torch.full((p,), -1, dtype=torch.int32, device=d)
        self.lpage = torch.full((p,), -1, dtype=torch.int32, device=d)
        # history[page, k] = step << 8 | event << 4 ... packed: (step, event, row) in one int64
        self.history = torch.zeros(p, self.HISTORY, dtype=torch.int64, device=d)
        self.written = torch.zeros(s, dtype=torch.bool, device=d)
        self.chain = torch.zeros(s, dtype=torch.int64, device=d)
        self.digest = torch.zeros(s, dtype=torch.int64, device=d)
        self.num_quarantined = 0  # host count, changed only on the (host-side) verdict path

    # -- history -----------------------------------------------------------------------------
    def record(self, pages: torch.Tensor, event: Event, step: int, rows: torch.Tensor | int = -1):
        """Shift each page's history and push (step, event, row). Duplicate pages keep one entry."""
        if pages.numel() == 0:
            return
        rows = torch.as_tensor(rows, device=self.device).to(torch.int64).expand(pages.shape)
        packed = (step << 24) | (int(event) << 20) | (rows & 0xFFFFF)
        self.history[pages] = torch.cat(
            (packed[:, None], self.history[pages, : self.HISTORY - 1]), dim=1
        )

    def describe(self, page: int) -> dict:
        """Host-side forensic snapshot of one page (slow path, violations only)."""
        hist = []
        for v in self.history[page].tolist():
            if v == 0:
                continue
            row = v & 0xFFFFF
            hist.append(
                {
                    "step": v >> 24,
                    "event": Event((v >> 20) & 0xF).name.lower(),
                    "row": None if row == 0xFFFFF else row,
                }
            )
        return {
            "page": page,
            "state": PageState(int(self.state[page])).name.lower(),
            "epoch": int(self.epoch[page]),
            "owner_row": int(self.owner_row[page]),
            "logical_page": int(self.lpage[page]),
            "history": hist,
        }

    # -- transitions (engine events) ------------------------------------------------------------
    def release(self, pages: torch.Tensor, step: int):
        """Pages returned to the engine's free list (the guard already dropped double frees)."""
        pages = pages.to(torch.int64)
        self.state[pages] = PageState.FREE
        self.owner_row[pages] = -1
        slots = (
            pages[:, None] * self.page_size + torch.arange(self.page_size, device=self.device)
        ).reshape(-1)
        self.written[slots] = False
        self.record(pages, Event.FREE, step)

    def allocate(self, slots: torch.Tensor, step: int) -> torch.Tensor:
        """The allocator handed out these slots; pages starting at them are new. Returns a page
        mask of pages handed out while still held (double allocation)."""
        slots = slots.to(torch.int64)
        first = (slots % self.page_size) == 0
        held = torch.zeros(self.num_pages, dtype=torch.bool, device=self.device)
        if self.device.type == "cpu":  # host reads are free: touch only the new pages
            page = torch.div(slots[first], self.page_size, rounding_mode="floor")
            busy = self.state[page] != PageState.FREE
            self.state[page] = PageState.ALLOCATED
            self.record(page, Event.ALLOC, step)
            if bool(busy.any()):
                held[page[busy]] = True
            return held
        page = torch.where(first, torch.div(slots, self.page_size, rounding_mode="floor"), 0)
        st = self.state[page]
        busy = first & (st != PageState.FREE)
        self.state[page] = torch.where(first, torch.full_like(st, PageState.ALLOCATED), st)
        self.record(page, Event.ALLOC, step)
        held.index_put_((page,), busy, accumulate=True)
        return held

    def share(self, slots: torch.Tensor, step: int):
        """The prefix cache took these slots' pages (radix insert)."""
        pages = torch.div(slots.to(torch.int64), self.page_size, rounding_mode="floor")
        owned = self.state[pages] == PageState.OWNED
        self.state[pages] = torch.where(
            owned, torch.full_like(self.state[pages], PageState.SHARED), self.state[pages]
        )
        self.record(pages, Event.SHARE, step)

    def quarantine(self, pages: torch.Tensor, step: int):
        pages = pages.to(torch.int64)
        self.state[pages] = PageState.QUARANTINED
        self.record(pages, Event.QUARANTINE, step)

    def reset(self):
        """The engine cleared its pool (flush): every page is free, nothing quarantined."""
        self.state.zero_()
        self.owner_row.fill_(-1)
        self.written.zero_()
        self.num_quarantined = 0

"""The checker: turns one step's reads and writes into a verdict. It only judges.

``check(view)`` runs the step check of the selected kernel backend over the ledger and the
records (``kernels.guard_ref`` defines it): every page read, every write target, adoption of
prefix-cache pages, checksums by mode. It changes no ledger or record state; the ledger applies
the claims it returns. The only state here is where the rolling checksum windows stand.
"""

from __future__ import annotations

import torch

from kvguard.config import GuardConfig, Mode
from kvguard.kernels.guard_ref import CheckParams, StepCheck, StepInputs
from kvguard.ledger import PageLedger
from kvguard.records import RowRecords
from kvguard.step import StepView

# sampled mode sweeps resting pages in batches: every SWEEP_EVERY steps, SWEEP_EVERY steps'
# worth, so the call's fixed cost is paid once per batch. The read-set window runs every step:
# it is what catches a bad page before it is read.
SWEEP_EVERY = 8


class StepChecker:
    def __init__(
        self,
        ledger: PageLedger,
        records: RowRecords,
        config: GuardConfig,
        kv_buffers: list[torch.Tensor],
    ):
        self.ledger = ledger
        self.records = records
        self.config = config
        self.kv_buffers = list(
            kv_buffers
        )  # every stored byte, slot-major ([k0, v0, ...] or latents)
        self.window_cursor = 0  # read-set window position (read-page entries of the batch)
        self.sweep_cursor = 0  # resting-pool sweep position (pages)
        # Set by the guard after a quarantine, until the engine flushes its caches: every read is
        # verified (as in paranoid), so readers of a quarantined page whose bytes are intact go on.
        self.escalated = False

    def inputs(self, v: StepView) -> StepInputs:
        ps = self.ledger.page_size
        return StepInputs(
            step=v.step,
            rows=v.rows,
            prefix_lens_host=v.prefix_lens_host,
            write_slots=v.write_slots,
            write_batch=v.write_batch,
            write_pos=v.write_pos,
            write_tokens=v.write_tokens,
            page_table=v.page_table,
            seeds=v.tenant_seeds,
            prefix_tokens=v.prefix_tokens,
            read_pages_total=sum((n + ps - 1) // ps for n in v.prefix_lens_host),
            read_tokens_total=sum(v.prefix_lens_host),
        )

    def params(self, step: int, read_pages: int) -> CheckParams:
        c, ps, num_pages = self.config, self.ledger.page_size, self.ledger.num_pages
        sampling = c.mode is Mode.SAMPLED and c.sweep_tokens_per_step > 0
        verify_all = c.mode is Mode.PARANOID or (c.checksums and self.escalated)
        window = sweep = 0
        if sampling and not verify_all and read_pages:
            window = min(read_pages, max(1, -(-c.sweep_tokens_per_step // ps)))
        if sampling and step % SWEEP_EVERY == 0:
            sweep = min(num_pages, max(1, -(-(c.sweep_tokens_per_step // 4) * SWEEP_EVERY // ps)))
        p = CheckParams(
            page_size=ps,
            checksums=c.checksums,
            verify_all=verify_all,
            window_start=self.window_cursor % max(read_pages, 1),
            window_pages=window,
            sweep_start=self.sweep_cursor,
            sweep_pages=sweep,
            pad_slot=0,
        )
        self.window_cursor = (p.window_start + window) % max(read_pages, 1)
        self.sweep_cursor = (self.sweep_cursor + sweep) % num_pages
        return p

    def check(self, x: StepInputs, pad_slot: int = 0) -> StepCheck:
        cp = self.params(x.step, x.read_pages_total)
        cp.pad_slot = pad_slot
        return self.ledger.kernels.check_step(
            self.ledger.pages, self.records.rows, x, cp, self.kv_buffers
        )

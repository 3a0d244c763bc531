"""The checker: turns one step's reads and writes into a verdict. It only judges.

``check(view)`` runs the step check of the selected kernel backend over the ledger and the
records (``kernels.guard_ref`` defines it): every page read, every write target, adoption of
prefix-cache pages, checksums by mode. It changes no ledger or record state; the ledger applies
the claims it returns. The only state here is where the rolling checksum windows stand.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvguard.config import GuardConfig, Mode, ReadPath
from kvguard.kernels.guard_ref import CheckParams, StepCheck, StepInputs
from kvguard.kernels.kv_checksum_ref import KvBuffer
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
        kv_buffers: Sequence[KvBuffer],
    ):
        self.ledger = ledger
        self.records = records
        self._hashed = False  # see ``read_path``
        self.config = config  # a property: the mode's constants are worked out once
        # every stored byte: slot-major tensors ([k0, v0, ...] or latents), then page-major
        # views (DSA's index keys and scales)
        self.kv_buffers: list[KvBuffer] = list(kv_buffers)
        self.window_cursor = 0  # read-set window position (read-page entries of the batch)
        self.sweep_cursor = 0  # resting-pool sweep position (pages)
        # Set by the guard after a quarantine, until the engine flushes its caches: every read is
        # verified (as in paranoid), so readers of a quarantined page whose bytes are intact go on.
        self.escalated = False

    @property
    def read_path(self) -> bool:
        """The adapter hashes the attention backend's read (set once at start). Verified reads
        need it; where it cannot be, every read is verified before the forward instead
        (``GuardConfig.read_path``: the read path in force)."""
        return self._hashed

    @read_path.setter
    def read_path(self, hashed: bool) -> None:
        self._hashed = hashed
        self._pre_forward = self._config.read_path(hashed) is ReadPath.PRE_FORWARD_CHECK

    @property
    def config(self) -> GuardConfig:
        return self._config

    @config.setter
    def config(self, c: GuardConfig) -> None:
        # What each step's parameters need, once per mode (the step itself is cache-cold on a
        # CPU: every attribute and branch it skips saves microseconds there).
        ps, num_pages = self.ledger.page_size, self.ledger.num_pages
        self._config = c
        self._sampling = c.mode is Mode.SAMPLED and c.sweep_tokens_per_step > 0
        self._paranoid = c.mode is Mode.PARANOID
        self._pre_forward = c.read_path(self._hashed) is ReadPath.PRE_FORWARD_CHECK
        self._window_budget = max(1, -(-c.sweep_tokens_per_step // ps))
        self._sweep_budget = min(
            num_pages, max(1, -(-(c.sweep_tokens_per_step // 4) * SWEEP_EVERY // ps))
        )

    def inputs(self, v: StepView) -> StepInputs:
        ps, lens = self.ledger.page_size, v.prefix_lens_host
        tokens = sum(lens)
        pages = tokens if ps == 1 else sum([(n + ps - 1) // ps for n in lens])
        return StepInputs(
            v.step, v.rows, lens, v.write_slots, v.write_batch, v.write_pos, v.write_tokens,
            v.page_table, v.tenant_seeds, v.prefix_tokens, pages, tokens,
        )  # fmt: skip

    def params(self, step: int, read_pages: int) -> CheckParams:
        checksums = self._config.checksums
        verify_all = self._paranoid or (checksums and self.escalated) or self._pre_forward
        window = sweep = 0
        start = 0
        if self._sampling:
            if read_pages and not verify_all:
                window = min(read_pages, self._window_budget)
                start = self.window_cursor % read_pages
                self.window_cursor = (start + window) % read_pages
            if step % SWEEP_EVERY == 0:
                sweep = self._sweep_budget
        p = CheckParams(
            self.ledger.page_size, checksums, verify_all, start, window, self.sweep_cursor,
            sweep, 0,
        )  # fmt: skip
        if sweep:
            self.sweep_cursor = (self.sweep_cursor + sweep) % self.ledger.num_pages
        return p

    def check(self, x: StepInputs, pad_slot: int = 0) -> StepCheck:
        cp = self.params(x.step, x.read_pages_total)
        cp.pad_slot = pad_slot
        return self.ledger.kernels.check_step(
            self.ledger.pages, self.records.rows, x, cp, self.kv_buffers
        )

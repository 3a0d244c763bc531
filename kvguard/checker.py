"""The checker: turns one step's reads and writes into a verdict. It only judges.

``check(view)`` runs the step check of the selected kernel backend over the ledger and the
records (``kernels.guard_ref`` defines it): every page read, every write target, adoption of
prefix-cache pages, checksums by mode. It changes no ledger or record state; the ledger applies
the claims it returns. After the forward, ``verify_reads`` judges what attention read (verified
reads) and ``writer_sums`` checks the stores the seal takes. The only state here is where the
rolling checksum windows stand, and the read path in force.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvguard.config import GuardConfig, Mode, ReadPath
from kvguard.kernels.guard_ref import CheckParams, StepCheck, StepInputs
from kvguard.kernels.kv_checksum_ref import KvBuffer
from kvguard.ledger import PageLedger
from kvguard.records import RowRecords
from kvguard.step import ReadSums, StepView, WriteSums
from kvguard.verdict import StepVerdict, reads_not_checked

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
        self._hashed = False  # see ``hashed_in_attention``
        self.read_path = ReadPath.NONE  # decided with the config (``_decide_read_path``)
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
    def hashed_in_attention(self) -> bool:
        """The adapter hashes the attention backend's read (set once at start). Verified reads
        need it; where it cannot be, every read is verified before the forward instead."""
        return self._hashed

    @hashed_in_attention.setter
    def hashed_in_attention(self, hashed: bool) -> None:
        self._hashed = hashed
        self._decide_read_path()

    def _decide_read_path(self) -> None:
        """The read path in force (``GuardConfig.read_path``), decided here whenever the mode or
        the hashing changes: the step check, the guard's after-forward judgement, healing and
        the hooks all read ``read_path``."""
        self.read_path = self._config.read_path(self._hashed)
        self._pre_forward = self.read_path is ReadPath.PRE_FORWARD_CHECK

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
        self._decide_read_path()
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

    def writer_sums(self, verdict: StepVerdict, written: WriteSums | None) -> torch.Tensor:
        """The writer's sums of this forward's writes, checked complete: every guarded buffer
        stored exactly once for every write. Otherwise the seal fails (the step fails closed):
        a token whose digest no writer gave is never sealed from the pool instead."""
        n = verdict.inputs.write_slots.numel()
        if written is None:
            raise RuntimeError("the forward's KV stores were not digested")
        nbuf = len(self.kv_buffers)
        if written.acc.numel() != n or (n and sorted(written.buffers) != list(range(nbuf))):
            raise RuntimeError(
                f"the forward stored {written.acc.numel()} tokens into KV buffers "
                f"{sorted(written.buffers)} of {nbuf} (each exactly once); it wrote {n}"
            )
        return written.acc

    def verify_reads(self, verdict: StepVerdict, read: ReadSums | None) -> int:
        """After the seal: judge what attention read (``read.rows``, request by request, and the
        checksum sums ``read.acc`` folded in over ``read.buffers``) against the sealed page
        digests and the rows' page tags. The result waits in the verdict for ``resolve``, which
        runs before the step's tokens are emitted. A read not hashed, or not over every stored
        byte of the pool, cannot be vouched for (raises). Returns the tokens hashed."""
        if read is None:
            raise RuntimeError("the forward's attention read was not hashed")
        B, nbuf = len(verdict.view.prefix_lens_host), len(self.kv_buffers)
        if len(read.seq_lens) != B or sorted(read.buffers) != list(range(nbuf)):
            raise RuntimeError(
                f"attention read {len(read.seq_lens)} requests, hashing KV buffers "
                f"{sorted(read.buffers)} of {nbuf} (each exactly once); the step had {B} requests"
            )
        P = self.ledger.pages
        bad, pages = _verify_reads_kernel(self.ledger.kernels.name)(
            read.acc, read.rows, read.seq_lens, read.req_rows, self.ledger.page_size,
            self.ledger.num_slots, P.digest, P.fill, P.epoch, self.records.rows.agg,
        )  # fmt: skip
        strays = reads_not_checked(verdict, read)
        if strays:  # read other rows or lengths than the step view checked: judged as read
            bad = bad.clone()
            bad[strays] = True
        verdict.read_bad, verdict.read_pages = bad, pages
        verdict.read_flagged = bool(pages.numel()) or bool(bad.any())
        if verdict.read_flagged:  # its forensic record names the pages that failed, and how
            verdict.read = read
        return int(read.rows.numel())


def _verify_reads_kernel(backend: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The compiled read verification beside the compiled CPU kernels, else the reference."""
    if backend == "cpu":
        from kvguard.kernels import read_verify

        return read_verify.verify_reads
    from kvguard.kernels import read_verify_ref

    return read_verify_ref.verify_reads

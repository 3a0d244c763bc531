"""The guard: one object per KV pool, and the small interface engine adapters use.

An adapter (``kvguard.patches`` for SGLang) calls, in engine order: ``before_forward(view)`` ->
the forward runs -> ``after_forward(verdict)``; later, at the sync that already follows the
forward, ``resolve(verdict, handles)`` reads the verdict and acts. Pool events arrive as
``on_alloc`` (the allocator handed out slots), ``on_release`` (pages back to the free list;
inside ``releasing(row)`` while a request is released, so a stale holder cannot free pages
someone else now holds), ``on_share`` / ``on_rebind`` (the prefix cache took a row's pages or
replaced them by its own) and ``on_rows_allocated`` (a page-table row handed to a new request).

Data flows one way: engine event -> ledger (and records) -> checker -> verdict -> actions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import structlog
import torch

from kvguard.actions import Actions, EngineControl
from kvguard.checker import StepChecker
from kvguard.config import GuardConfig, Mode, ReadPath
from kvguard.healing import HealPolicy
from kvguard.health import GuardHealth
from kvguard.kernels import guard_ref
from kvguard.kernels.backend import GuardKernels, select
from kvguard.kernels.guard_ref import StepCheck
from kvguard.kernels.guard_state import EPOCH_STEP_SHIFT
from kvguard.kernels.kv_checksum_ref import KvBuffer, token_digests_ref
from kvguard.ledger import PageLedger, PageState
from kvguard.metrics import GuardMetrics
from kvguard.ratelimit import RateLimitedLog
from kvguard.records import RowRecords
from kvguard.step import ReadSums, StepView, WriteSums
from kvguard.transfers import TransferClaims
from kvguard.verdict import (
    Kind,
    StepVerdict,
    Violation,
    forensic_record,
    new_violation_id,
    reads_not_checked,
)

log = structlog.get_logger("kvguard")
PageEpochs = tuple[torch.Tensor, torch.Tensor]  # host (pages, their epochs when checked)
_NO_PAGES: PageEpochs = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


def _union(lists: list[PageEpochs]) -> PageEpochs:
    pages = torch.cat([p for p, _ in lists])
    epochs = torch.cat([e for _, e in lists])
    if pages.numel() == 0:
        return _NO_PAGES
    uniq, inverse = torch.unique(pages, return_inverse=True)
    first = torch.full_like(uniq, pages.numel()).scatter_reduce(
        0, inverse, torch.arange(pages.numel()), reduce="amin"
    )
    return uniq, epochs[first]


def _intersection(lists: list[PageEpochs]) -> PageEpochs:
    pages, epochs = lists[0]
    for other, _ in lists[1:]:
        keep = torch.isin(pages, other)
        pages, epochs = pages[keep], epochs[keep]
    return pages, epochs


def _verify_reads_kernel(backend: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The compiled read verification beside the compiled CPU kernels, else the reference."""
    if backend == "cpu":
        from kvguard.kernels import read_verify

        return read_verify.verify_reads
    from kvguard.kernels import read_verify_ref

    return read_verify_ref.verify_reads


# The guard's own time is the CPU time of the thread running its hooks: on a machine whose
# cores the scheduler shares (tokenizer, detokenizer, clients), wall time inside a hook also
# counts the moments the thread was preempted by others.
clock = time.thread_time
FLUSH_EVERY_S = 0.5


class PeerRanks(Protocol):
    """The tensor-parallel peers a verdict is agreed with (an engine adapter provides it). Every
    rank calls the same methods in the same order, once per step."""

    def or_words(self, words: torch.Tensor) -> torch.Tensor:
        """Bitwise OR of a small host int64 tensor over every rank."""
        ...

    def start_or(self, words: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The same, started now; the returned call waits for it and returns the result."""
        ...

    def gather(self, item: object) -> list[object]:
        """Every rank's ``item`` (a few pages at most), in rank order."""
        ...


# The flag word that closes a step's agreement: what the per-request kinds do not say.
# BREAKER: some rank's recompute breaker is open (the step's violations abort on every rank).
TAINTED, RECLAIMING, FAILED, BREAKER = 1, 2, 4, 8
# After a quarantine, every read is verified (readers of a quarantined page whose bytes are
# intact go on) while quarantined pages are still held, for at most this many steps: past it a
# read of a still-quarantined page that was not verified that step is a violation again.
ESCALATION_STEPS = 1024


class Guard:
    def __init__(
        self,
        config: GuardConfig,
        *,
        num_slots: int,
        page_size: int,
        num_rows: int,
        kv_buffers: list[torch.Tensor],
        device: torch.device | str,
        engine: EngineControl | None = None,
        metrics: GuardMetrics | None = None,
        kernels: GuardKernels | str | None = None,
        peers: PeerRanks | None = None,
    ):
        """``peers``: verdicts are agreed with these ranks at resolve (tensor parallelism). A
        clean step agrees on its batch's verdict bits and one flag word; pages move only on a
        step some rank flagged, as lists of (page, epoch)."""
        self.config = config
        self.peers = peers
        self.device = torch.device(device)
        k = kernels if kernels is not None and not isinstance(kernels, str) else None
        self.kernels: GuardKernels = k or select(
            self.device, kernels if isinstance(kernels, str) else None
        )
        self.ledger = PageLedger(num_slots, page_size, self.device, self.kernels)
        self.records = RowRecords(num_rows, self.device, self.kernels)
        self.checker = StepChecker(self.ledger, self.records, config, kv_buffers)
        self.kernels.bind(self.ledger.pages, self.records.rows, self.checker.kv_buffers)
        self.metrics = metrics or GuardMetrics.default()
        self.log = RateLimitedLog(self.metrics)
        self.healing = HealPolicy(config, self.metrics, read_path=lambda: self.read_path)
        self.actions = Actions(self.ledger, self.metrics, engine, self.log, self.healing)
        self.health = GuardHealth(config.quarantine_cap_pages(self.ledger.num_pages))
        self.transfers = TransferClaims(self.ledger, self.records)
        self.health.listeners.append(self._health_changed)
        self.step = 0
        # A quarantine happened: the engine should drop its prefix cache at its next idle moment
        # (nodes over pages an engine bug touched; quarantined ones among them are scrubbed).
        self.flush_wanted = False
        # A violation happened since the prefix cache was last flushed: a node of it may hold a
        # page an engine bug handed to someone else (inserts then check what they would adopt)
        self.tree_suspect = False
        self.num_internal_errors = 0  # since start: a failed free may have leaked pages
        self.last_quarantine_step = -(1 << 62)
        self._release_row: int | None = None
        self._double_freed: list[torch.Tensor] = []  # pages released twice, reported at resolve
        self._stale_freed: list[torch.Tensor] = []  # pages a stale holder tried to free
        self._unresolved: StepVerdict | None = None  # the newest verdict not read yet
        self._buffer_index = {b.data_ptr(): i for i, b in enumerate(self.checker.kv_buffers)}
        # The adapter digests every KV store as it is handed its bytes (``after_forward``'s
        # ``written``): seals take the writer's digests, not a hash of what the pool holds.
        self.write_path = False
        self.host_reads_free = self.device.type == "cpu"
        self._seconds, self._steps, self._tokens, self._hashed = 0.0, 0, 0, 0  # not yet flushed
        self._transfer_seconds, self._transfers = 0.0, 0  # hand-off checks, not yet flushed
        self._forward_seconds = 0.0  # hashing inside the forward, not yet flushed
        self._flushed_at = 0.0
        self.metrics.state_bytes.set(self.state_bytes)
        self.metrics.quarantine_cap_pages.set(self.health.quarantine_cap_pages)
        self.metrics.quarantined_pages.set(0)
        self.metrics.healthy.set(1)

    # -- configuration --------------------------------------------------------------------------------
    def set_mode(self, mode: Mode | str) -> None:
        """Switch mode at run time (benchmarks interleave modes in one server). ``off`` here means
        installed but idle; a server started with mode off has no hooks at all."""
        self.config = self.config.with_(mode=mode)
        self.checker.config = self.healing.config = self.config

    @property
    def active(self) -> bool:
        return self.config.enabled

    @property
    def read_path(self) -> ReadPath:
        """How reads are verified now: the mode's, given whether the adapter hashes the attention
        backend's read (``enable_read_path``). Healing, the hooks and the status all ask here."""
        return self.config.read_path(self.checker.read_path)

    @property
    def verifies_reads(self) -> bool:
        """Attention hashes what it reads and ``verify_reads`` judges it after the forward (the
        mode asks for it and the adapter hooked the attention backend's read)."""
        return self.read_path is ReadPath.VERIFIED_IN_ATTENTION

    def enable_read_path(self) -> None:
        """The adapter hashes attention's reads (``verify_reads`` will be called every step);
        without it, a mode that verifies reads checks every read before the forward instead."""
        self.checker.read_path = True

    def enable_write_path(self) -> None:
        """The adapter digests every store of the forward (``after_forward`` gets ``written``)."""
        self.write_path = True

    @property
    def digests_writes(self) -> bool:
        """Seals take the writer's digests (checksum modes, stores digested by the adapter)."""
        return self.write_path and self.config.checksums

    def buffer_index(self, cache: torch.Tensor | KvBuffer) -> int | None:
        """Which of the guarded KV buffers attention reads or a store writes (None: not one of
        them)."""
        return self._buffer_index.get(cache.data_ptr())

    @property
    def state_bytes(self) -> int:
        """Bytes of the guard's own state: ledger, records, the kernel backend's workspaces."""
        return self.ledger.nbytes() + self.records.nbytes() + self.kernels.workspace_bytes()

    # -- forward ----------------------------------------------------------------------------------------
    def before_forward(self, view: StepView, t0: float | None = None) -> StepVerdict:
        """Check the step, apply its claims. ``t0``: when the adapter started building the view
        (``clock()``), so that its time is counted without a second clock read."""
        if t0 is None:
            t0 = clock()
        self.step = view.step
        self.checker.escalated = (
            self.ledger.num_quarantined > 0
            and view.step - self.last_quarantine_step <= ESCALATION_STEPS
        )
        x = self.checker.inputs(view)
        check = self.checker.check(x, view.pad_slot)
        self.ledger.apply_step(self.records, x, check)
        verdict = StepVerdict(view=view, inputs=x, check=check)
        if self.host_reads_free:  # on a CPU the flags are known now
            flagged, tainted, reclaim = check.flags()
            if tainted or reclaim:  # the check's own list of what it marked: no pool scan
                verdict.suspects = check.marked_pages()
            if self.peers is not None and not self.verifies_reads:  # last: nothing may fail after
                B = len(view.prefix_lens_host)
                words = self._summary(check, B, flagged, tainted, reclaim, verdict)
                verdict.agreement = self.peers.start_or(words)
        self._unresolved = verdict
        self._steps += 1
        self._tokens += len(view.prefix_lens_host) + view.write_slots.numel()
        self._account(t0)
        return verdict

    def after_forward(
        self, verdict: StepVerdict, read: ReadSums | None = None, written: WriteSums | None = None
    ) -> None:
        """Seal what the forward wrote (enqueued after its writes: no sync needed), then, when
        reads are verified, judge what attention read (``read``) against the sealed digests, in
        the same entry. Where the stores were digested (``written``: ``digests_writes``) the
        seal takes the writer's digests: a store that never landed, landed elsewhere or was
        changed before attention read it fails the very read of this forward. A seal that
        hashes nothing (tags, on a CPU) is only queued in the ledger: not timed here, it is
        applied and timed by the next step's check."""
        if not self.config.checksums and self.ledger.queues:
            self.ledger.seal(verdict.inputs, verdict.check, self.checker.kv_buffers, False)
            return
        t0 = clock()
        try:
            sums = self._writer_sums(verdict, written) if self.digests_writes else None
            self.ledger.seal(
                verdict.inputs,
                verdict.check,
                self.checker.kv_buffers,
                self.config.checksums,
                sums,
            )
            if self.verifies_reads:
                try:
                    self._verify_reads(verdict, read)
                except Exception as exc:  # nothing unverified is served: the step fails closed
                    self.internal_error("verify", exc)
                    verdict.seal_failed = True
        finally:
            self._account(t0)

    def _writer_sums(self, verdict: StepVerdict, written: WriteSums | None) -> torch.Tensor:
        """The writer's sums of this forward's writes, checked complete: every guarded buffer
        stored exactly once for every write. Otherwise the seal fails (the step fails closed):
        a token whose digest no writer gave is never sealed from the pool instead."""
        n = verdict.inputs.write_slots.numel()
        if written is None:
            raise RuntimeError("the forward's KV stores were not digested")
        nbuf = len(self.checker.kv_buffers)
        if written.acc.numel() != n or (n and sorted(written.buffers) != list(range(nbuf))):
            raise RuntimeError(
                f"the forward stored {written.acc.numel()} tokens into KV buffers "
                f"{sorted(written.buffers)} of {nbuf} (each exactly once); it wrote {n}"
            )
        return written.acc

    def _verify_reads(self, verdict: StepVerdict, read: ReadSums | None) -> None:
        """After the seal: judge what attention read (``read.rows``, request by request, and the
        checksum sums ``read.acc`` folded in over ``read.buffers``) against the sealed page
        digests and the rows' page tags. The result waits in the verdict for ``resolve``, which
        runs before the step's tokens are emitted. A read not hashed, or not over every stored
        byte of the pool, cannot be vouched for."""
        if read is None:
            raise RuntimeError("the forward's attention read was not hashed")
        B, nbuf = len(verdict.view.prefix_lens_host), len(self.checker.kv_buffers)
        if len(read.seq_lens) != B or sorted(read.buffers) != list(range(nbuf)):
            raise RuntimeError(
                f"attention read {len(read.seq_lens)} requests, hashing KV buffers "
                f"{sorted(read.buffers)} of {nbuf} (each exactly once); the step had {B} requests"
            )
        P = self.ledger.pages
        bad, pages = _verify_reads_kernel(self.kernels.name)(
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
        self._hashed += int(read.rows.numel())

    def resolve(self, verdict: StepVerdict | None, handles: list[object]) -> list[Violation]:
        """Read a step's verdict (the caller has synced) and act on it. Returns the violations.
        ``verdict`` None: the step could not be checked (the adapter's check or seal failed):
        every request of it fails closed.

        With peers (tensor parallelism) each rank hashes its own KV heads, so verdicts can
        differ: the batch's verdict bits and a flag word are OR-ed over the ranks, and only on a
        step some rank flagged do the flagged pages follow, as (page, epoch) lists; so every
        rank aborts, quarantines and takes back exactly the same things. A rank whose guard
        failed still joins the agreement, with a failure flag: no peer is left waiting.

        A clean step on a single CPU rank (its flags came back with the check) returns at once,
        untimed: reading a thread-CPU clock in a cache-cold moment would cost more than the
        step's whole resolve."""
        if self._unresolved is verdict:
            self._unresolved = None
        B = len(handles)
        events = bool(self._double_freed or self._stale_freed)
        t0 = None if self.host_reads_free else clock()  # a GPU's flag read is real work
        if (
            verdict is not None
            and verdict.seal_failed
            and (self.peers is None or verdict.agreement is None)
        ):
            # fail the step closed now; with peers it joins the agreement below with its failure
            # flag (an agreement already in flight cannot carry it: see below)
            verdict = None
        summary: torch.Tensor | None = None
        agreement = verdict.agreement if verdict is not None else None  # in flight: waited below
        if verdict is not None:
            try:
                c = verdict.check
                self._hashed += c.tokens_hashed()
                if verdict.agreement is None:
                    flagged, tainted, reclaim = c.flags()
                    flagged = flagged or verdict.read_flagged
                    if self.peers is None and not (events or flagged or tainted or reclaim):
                        if t0 is not None:
                            self._account(t0)
                        self.health.step_succeeded()
                        self._flush_metrics()
                        return []  # a clean step: nothing to agree on or gather
                    summary = self._summary(c, B, flagged, tainted, reclaim, verdict)
            except Exception as exc:
                self.internal_error("resolve", exc)
                verdict = None
        if t0 is None:
            t0 = clock()
        if agreement is not None:
            # Started when the check was done, and done during the forward. A seal that failed
            # since cannot be told to the peers this step: the tokens it did not record fail
            # their first read on this rank, and the agreed verdict aborts their readers then.
            summary = agreement()
        else:
            if summary is None:  # this rank could not check the step: it fails closed
                summary = torch.full((B + 1,), int(Kind.GUARD_ERROR), dtype=torch.int64)
                summary[B] = FAILED
            if self.peers is not None:
                summary = self.peers.or_words(summary)
        kinds, word = summary[:B], int(summary[B])
        if not (word & ~BREAKER or events or bool(kinds.any())):  # agreed clean: nothing to act on
            self.health.step_succeeded()
            self._account(t0)
            self._flush_metrics()
            return []
        if word & FAILED:  # some rank could not check this step: nothing of it is served
            kinds = kinds | int(Kind.GUARD_ERROR)
        to_quarantine: PageEpochs | None = None
        to_reclaim: PageEpochs | None = None
        if word & (TAINTED | RECLAIMING):
            to_quarantine, to_reclaim = self._agreed_pages(verdict)
        violations: list[Violation] = []
        try:
            self._report_engine_events(self.step if verdict is None else verdict.view.step)
            breaker = (
                bool(word & BREAKER) if self.peers is not None else self.healing.breaker_open()
            )
            violations = self._act(verdict, handles, kinds, to_quarantine, to_reclaim, breaker)
        except Exception as exc:  # acting failed: fail the whole batch closed
            self.internal_error("resolve", exc)
            violations = self.fail_closed(handles)
            # pages it would have quarantined may sit in the prefix cache: flush it when idle
            self.flush_wanted = self.tree_suspect = True
            try:
                step = self.step if verdict is None else verdict.view.step
                self._quarantine_bad(verdict, kinds, to_quarantine, step)
            except Exception as exc2:
                self.internal_error("resolve", exc2)
        if verdict is not None and not word & FAILED:
            self.health.step_succeeded()
        self._account(t0)
        self._flush_metrics()
        return violations

    def _summary(
        self,
        c: StepCheck,
        B: int,
        flagged: bool,
        tainted: bool,
        reclaim: bool,
        verdict: StepVerdict,
    ) -> torch.Tensor:
        """This rank's words for the step's agreement: the batch's verdict bits (the read's
        included), then a flag."""
        out = torch.zeros(B + 1, dtype=torch.int64)
        if flagged or self.peers is not None:
            out[:B] = c.kinds[:B].to(torch.int64).cpu()
        if verdict.read_flagged and verdict.read_bad is not None:
            out[:B] |= verdict.read_bad[:B].to(torch.int64) * int(Kind.READ_MISMATCH)
            tainted = tainted or bool(verdict.read_pages is not None and verdict.read_pages.numel())
        out[B] = (TAINTED if tainted else 0) | (RECLAIMING if reclaim else 0)
        if self.peers is not None and self.healing.breaker_open():
            out[B] |= BREAKER
        return out

    def _agreed_pages(self, verdict: StepVerdict | None) -> tuple[PageEpochs, PageEpochs]:
        """(tainted, reclaimable) pages with their epochs when checked, agreed over the ranks:
        tainted on any rank, reclaimable on every rank. A rank that cannot say sends None: then
        nothing is taken back, and the others' tainted pages are still quarantined."""
        mine: tuple[PageEpochs, PageEpochs] | None = None
        if verdict is not None:
            try:
                mine = self._my_pages(verdict)
            except Exception as exc:
                self.internal_error("resolve", exc)
        if self.peers is None:
            return mine if mine is not None else (_NO_PAGES, _NO_PAGES)
        every = self.peers.gather(mine)
        known = [m for m in every if m is not None]
        if not known:
            return _NO_PAGES, _NO_PAGES
        taint = _union([m[0] for m in known])  # type: ignore[index]
        reclaim = _intersection([m[1] for m in every]) if len(known) == len(every) else _NO_PAGES  # type: ignore[index]
        return taint, reclaim

    def _my_pages(self, verdict: StepVerdict) -> tuple[PageEpochs, PageEpochs]:
        """This rank's flagged pages, as host (pages, epochs) pairs. A page claimed again after
        the check (its epoch names a later step: an epoch changes only at a claim) is its new
        owner's and is left out; one handed out but not claimed yet is left alone by quarantine
        and reclaim (ALLOCATED). So no epoch snapshot is taken at check time."""
        c = verdict.check
        read = verdict.read_pages if verdict.read_pages is not None else _NO_PAGES[0]
        if verdict.suspects is not None:
            pages = verdict.suspects
        elif self.host_reads_free:  # CPU, nothing flagged by the check here
            pages = _NO_PAGES[0]
        else:  # a GPU: the flags are read now, after the engine's sync
            pages = torch.nonzero(c.taint | c.reclaim).reshape(-1)
        t, r = c.taint[pages], c.reclaim[pages]
        if read.numel():  # pages whose bytes, as attention read them, failed their digest
            read = torch.unique(read).to(pages.device)  # once each, however many read them
            t = t | torch.isin(pages, read)
            extra = read[~torch.isin(read, pages)]
            pages = torch.cat((pages, extra))
            t = torch.cat((t, torch.ones(extra.numel(), dtype=torch.bool, device=t.device)))
            r = torch.cat((r, torch.zeros(extra.numel(), dtype=torch.bool, device=r.device)))
        epochs = self.ledger.epoch[pages]
        same = (epochs >> EPOCH_STEP_SHIFT) <= verdict.view.step
        pages, epochs, t, r = pages[same], epochs[same], t[same], r[same]
        pages, epochs, t, r = (x.cpu() for x in (pages, epochs, t, r))
        return (pages[t], epochs[t]), (pages[r], epochs[r])

    def _act(
        self,
        verdict: StepVerdict | None,
        handles: list[object],
        kinds: torch.Tensor,
        taint: PageEpochs | None,
        reclaim: PageEpochs | None,
        breaker_open: bool = False,
    ) -> list[Violation]:
        step = self.step if verdict is None else verdict.view.step
        violations: list[Violation] = []
        bad: list[object] = []
        for b in torch.nonzero(kinds).reshape(-1).tolist():
            kind = Kind(int(kinds[b]))
            if verdict is None or kind == Kind.GUARD_ERROR:
                rid = getattr(handles[b], "rid", None)
                violations.append(Violation(new_violation_id(), kind, step, rid, None))
            else:
                violations.append(forensic_record(verdict, b, kind, self.ledger, self.records))
            bad.append(handles[b])
        self.actions.act(violations, bad, breaker_open)
        self.tree_suspect = True  # the prefix cache may hold a node a fault touched
        self.flush_wanted = True  # ... until it is flushed at the next idle moment
        self._quarantine_bad(verdict, kinds, taint, step)
        if reclaim is not None and reclaim[0].numel():
            self.actions.reclaim(reclaim[0], reclaim[1], step)
        return violations

    def _quarantine_bad(
        self,
        verdict: StepVerdict | None,
        kinds: torch.Tensor,
        taint: PageEpochs | None,
        step: int,
    ) -> None:
        """Quarantine the step's agreed bad pages and the prefix-cache nodes its flagged
        requests wrote. Also run when acting failed part-way (resolve), so no request adopts
        them from the prefix cache before the idle flush (requests arriving at once leave the
        engine no idle moment). The pages are the agreed ones, the same on every rank (a
        failure on one rank alone still aborts that rank's whole batch: fail_closed)."""
        if (
            verdict is not None
            and bool(kinds.any())
            and not bool((kinds & int(Kind.GUARD_ERROR)).any())
        ):  # (a step some rank could not judge: that rank has no verdict to name pages from)
            poisoned = self._poisoned_nodes(verdict, kinds)
            if poisoned[0].numel():
                taint = poisoned if taint is None else _union([taint, poisoned])
        if taint is not None and taint[0].numel():
            self._quarantine(taint, step)

    def _poisoned_nodes(self, verdict: StepVerdict, kinds: torch.Tensor) -> PageEpochs:
        """Pages flagged requests wrote this step that the prefix cache holds by now: computed
        from what those requests read, they must never be adopted (a chunked prefill's chunk is
        checkpointed into the tree before its verdict is read; on a single rank the insert asks
        the unread verdict and bars it, with tensor parallelism it cannot). The same on every
        rank: the kinds are agreed and every ledger sees the same engine events."""
        x, c = verdict.inputs, verdict.check
        if x.write_slots.numel() == 0:
            return _NO_PAGES
        flagged = kinds.to(self.device) != 0
        mine = flagged[x.batch_index()] & c.write_ok
        if not bool(mine.any()):
            return _NO_PAGES
        pages = torch.unique(self.ledger.pages_of(c.targets[mine]))
        pages = pages[self.ledger.state[pages] == PageState.SHARED]
        return pages.cpu(), self.ledger.epoch[pages].cpu()

    def _quarantine(self, taint: PageEpochs, step: int) -> None:
        new, were_free = self.actions.quarantine(taint[0], taint[1], step)
        if new:
            self.last_quarantine_step = step
            self.flush_wanted = True
        if were_free.numel():  # nobody holds them: back to service at once, scrubbed
            self.scrub(were_free)
        self._quarantine_changed()

    def fail_closed(self, handles: list[object]) -> list[Violation]:
        """Abort every request of a step the guard could not judge (GUARD_ERROR)."""
        violations = [
            Violation(
                new_violation_id(), Kind.GUARD_ERROR, self.step, getattr(h, "rid", None), None
            )
            for h in handles
        ]
        try:
            self.actions.abort(violations, handles)
        except Exception as exc:
            self.internal_error("abort", exc)
        return violations

    def internal_error(self, hook: str, exc: BaseException) -> None:
        """A hook of the guard raised: counted, logged (rate-limited, with its traceback), and
        the health told; the caller fails what that hook guarded closed."""
        self.num_internal_errors += 1
        self.metrics.internal_errors.labels(hook=hook).inc()
        self.log("error", "kvguard_internal_error", hook=hook, step=self.step, exc_info=exc)
        if hook in ("check", "seal", "verify", "resolve"):  # a step that could not be checked
            self.health.step_failed(hook)

    def _health_changed(self, reason: str | None) -> None:
        self.metrics.healthy.set(1 if reason is None else 0)
        if reason is None:
            log.warning("kvguard_healthy_again")
        else:
            log.error("kvguard_failed_closed", reason=reason)

    def _quarantine_changed(self) -> None:
        n = self.ledger.num_quarantined
        self.metrics.quarantined_pages.set(n)
        self.health.quarantined(n)

    def scrub(self, pages: torch.Tensor) -> torch.Tensor:
        """Quarantined pages nobody holds: bytes zeroed, entries reset, back in service."""
        done = self.ledger.scrub(pages, self.checker.kv_buffers, self.step)
        if done.numel():
            self.metrics.pages_scrubbed.inc(int(done.numel()))
            self._quarantine_changed()
        return done

    # -- pool events ------------------------------------------------------------------------------------
    def on_alloc(self, slots: torch.Tensor) -> None:
        """The engine's allocator handed out slots: its hand-out is authoritative. On a CPU pool
        it is queued in the ledger (a copy and an append, not timed) and applied, and timed, by
        the guard's next entry; elsewhere applied (and timed) here."""
        if self.ledger.queues:
            self.ledger.allocate(slots, self.step)
            return
        t0 = clock()
        self.ledger.allocate(slots, self.step)
        self._account(t0)

    @property
    def release_row(self) -> int | None:
        """The row of the request being released (inside ``releasing``), else None."""
        return self._release_row

    @contextmanager
    def releasing(self, row: int) -> Iterator[None]:
        """While the request on ``row`` is released: frees are attributed to it."""
        outer, self._release_row = self._release_row, row
        try:
            yield
        finally:
            self._release_row = outer

    def attribute_free(self, pages: torch.Tensor) -> torch.Tensor:
        """Inside ``releasing(row)``: [n] bool, which of these pages the releasing request may
        free. A page someone else now holds (its claim, the prefix cache's, a new hand-out) is
        kept from the free list: the releasing request is its stale holder."""
        if self._release_row is None:
            return torch.ones(pages.shape, dtype=torch.bool, device=pages.device)
        t0 = clock()
        keep = self.ledger.attributable(self.records, pages, self._release_row)
        if not bool(keep.all()):
            self._stale_freed.append(pages[~keep].to(torch.int64))
        self._account(t0)
        return keep

    def on_release(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages go back to the engine's free list. Returns the pages that really may be reused:
        a double free is not pushed twice, a quarantined page goes back only scrubbed."""
        t0 = clock()
        pages = pages.to(torch.int64)
        keep, double = self.ledger.release(pages, self.step)
        if bool(double.any()):  # a sync on GPU, like the torch.unique SGLang's free already does
            self._double_freed.append(pages[double])
        out = pages[keep]
        if self.ledger.num_quarantined:  # a quarantined page's last holder let it go: scrub it
            bad = pages[~keep & ~double]
            if bad.numel():
                out = torch.cat((out, self.scrub(bad).to(out.device)))
        self._account(t0)
        return out

    def on_share(self, slots: torch.Tensor, row: int) -> None:
        """The prefix cache took row ``row``'s KV up to these slots: its own pages become shared."""
        t0 = clock()
        self.ledger.share(self.records, slots, row, self.step)
        self._account(t0)

    def on_rebind(
        self, row: int, first_position: int, old_slots: torch.Tensor, new_slots: torch.Tensor
    ) -> None:
        """The prefix cache replaced the row's slots from ``first_position`` by its own copies."""
        t0 = clock()
        ps = self.ledger.page_size
        start = -(-first_position // ps) * ps  # only whole pages move (inserts are page aligned)
        skip = start - first_position
        old, new = old_slots[skip::ps], new_slots[skip::ps]
        if old.numel() and not torch.equal(old, new):
            self.records.rebind(
                self.ledger,
                row,
                start // ps,
                self.ledger.pages_of(old),
                self.ledger.pages_of(new),
                self.step,
            )
        self._account(t0)

    def on_rows_allocated(self, rows: torch.Tensor) -> None:
        """Rows handed to new requests: forget what their previous owners expected."""
        t0 = clock()
        self.records.reset_rows(rows)
        self.transfers.forget(rows)
        self._account(t0)

    # -- transfers (KV written by another server: prefill/decode disaggregation) -------------------
    def on_transfer_issued(
        self, row: int, slots: torch.Tensor, tokens: torch.Tensor, seed: int = 0
    ) -> int:
        """A transfer of ``tokens``' KV into row ``row``'s positions [0, n) (its destination
        ``slots``, as the allocator handed them out) was issued: its pages are claimed for the
        row now, unsealed until it lands (``kvguard.transfers``). Returns the claim's verdict
        bits (0: claimed); a failed claim is acted on when the transfer lands."""
        t0 = clock()
        try:
            return self.transfers.issue(row, slots, tokens, seed, self.step)
        finally:
            self._account_transfer(t0)

    def on_transfer_sent(self, slots: torch.Tensor) -> int | None:
        """A transfer of a request's positions [0, n) from ``slots`` [n] is being sent: the
        sender's seal, which travels with it (``kvguard.transfers``); None where this server's
        ledger cannot vouch for those positions."""
        t0 = clock()
        try:
            digests = getattr(self.kernels, "token_digests", None) or token_digests_ref
            return self.transfers.send_seal(
                slots, self.checker.kv_buffers, self.config.checksums, digests
            )
        finally:
            self._account_transfer(t0)

    def on_transfer_landed(
        self,
        row: int,
        handle: object,
        request_id: str | None = None,
        sent_seal: int | None = None,
        sent_tokens: int | None = None,
    ) -> Violation | None:
        """The transfer into row ``row`` (request ``handle``) landed: its bytes are sealed if its
        claim is unchanged and, where the sender's seal came with it (``TransferClaims.land``),
        they match it; otherwise
        the request is aborted (it has read nothing yet, and nothing it could be recomputed from
        is on this server) and the violation returned."""
        t0 = clock()
        try:
            digests = getattr(self.kernels, "token_digests", None) or token_digests_ref
            kinds, pages = self.transfers.land(
                row,
                self.step,
                self.checker.kv_buffers,
                self.config.checksums,
                digests,
                sent_seal,
                sent_tokens,
            )
            if not kinds:
                return None
            described = self.ledger.describe_many(pages[:8].tolist())
            violation = Violation(
                new_violation_id(), Kind(kinds), self.step, request_id, row, described
            )
            self.actions.abort([violation], [handle])
            return violation
        finally:
            self._account_transfer(t0)

    def reset(self) -> None:
        """The engine cleared its pool: every page free, no record, nothing quarantined (the
        quarantined pages' bytes scrubbed first: a flush returns them to service too)."""
        n = self.ledger.num_quarantined
        self.ledger.reset(self.checker.kv_buffers)
        if n:
            self.metrics.pages_scrubbed.inc(n)
        self._quarantine_changed()
        self.records.reset()
        self.flush_wanted = self.tree_suspect = False
        self._double_freed.clear()
        self._stale_freed.clear()
        self._flush_metrics(force=True)

    # -- questions the adapter may ask --------------------------------------------------------------------
    def unread_taint(self) -> bool:
        """Did the newest unread verdict find bad pages? (CPU only, like suspect_before_resolve.)"""
        v = self._unresolved
        if v is None or not self.host_reads_free:
            return False
        return v.check.flags()[1] or (v.read_pages is not None and bool(v.read_pages.numel()))

    def suspect_before_resolve(
        self, request_id: str | None = None, slots: torch.Tensor | None = None
    ) -> bool:
        """Was this request flagged, or does one of these slots sit in a page found bad, by a step
        whose verdict is not read yet? An overlap scheduler prepares the next step (prefix-cache
        inserts and hits) before it reads the last verdict. Answered where a host read is free
        (CPU); elsewhere False: the verdict is then acted on one step later."""
        v = self._unresolved
        if v is None or not self.host_reads_free:
            return False
        flagged, tainted, _ = v.check.flags()
        read_bad = v.read_bad if v.read_flagged else None  # what attention read failed
        if request_id is not None and (flagged or read_bad is not None) and v.view.request_ids:
            B = len(v.view.prefix_lens_host)
            kinds = v.check.kinds[:B].tolist()
            bad = read_bad[:B].tolist() if read_bad is not None else [False] * B
            ids = v.view.request_ids
            if any(rid == request_id and (k or b) for rid, k, b in zip(ids, kinds, bad)):
                return True
        if slots is not None and (tainted or read_bad is not None):
            pages = self.ledger.pages_of(slots.to(self.device))
            if tainted and bool(v.check.taint[pages].any()):
                return True
            if v.read_pages is not None and v.read_pages.numel():
                return bool(torch.isin(pages, v.read_pages.to(pages.device)).any())
        return False

    def in_unresolved_step(self, request_id: str) -> bool:
        """Was this request in the newest step whose verdict is not read yet? (Answered from the
        step's own request list: the same on every tensor-parallel rank.)"""
        v = self._unresolved
        return v is not None and request_id in (v.view.request_ids or ())

    def adoptable(self, slots: torch.Tensor, tokens: list[int], seed: int = 0) -> bool:
        """Would a reader with these prompt tokens (and chain seed) adopt these prefix-cache slots
        (whole pages, from position 0)? The hand-off rule of the step check, asked early so the
        engine can refuse the hit (the request prefills its own KV) instead of the guard aborting
        it. Host reads: CPU pools only."""
        t0 = clock()
        try:
            return self._adoptable(slots, tokens, seed)
        finally:
            self._account(t0)

    def _adoptable(self, slots: torch.Tensor, tokens: list[int], seed: int) -> bool:
        ps, n = self.ledger.page_size, slots.numel()
        if n == 0 or n % ps or len(tokens) < n:
            return n == 0
        compiled = getattr(self.kernels, "adoptable", None)
        if compiled is not None:
            return bool(compiled(self.ledger.pages, slots[::ps], tokens[:n], seed, ps))
        P = self.ledger.pages
        heads = slots[::ps].to(torch.int64).to(self.device)
        pages = torch.div(heads, ps, rounding_mode="floor")
        i = torch.arange(pages.numel(), device=self.device)
        toks = torch.tensor(tokens[:n], dtype=torch.int64, device=self.device)
        own = seed + torch.cumsum(
            guard_ref.chain_terms(toks, torch.arange(n, device=self.device)), 0
        )
        ok = (
            (heads % ps == 0)
            & (P.state[pages] == PageState.SHARED)
            & (P.fill[pages].to(torch.int64) == ps)
            & (P.lpage[pages].to(torch.int64) == i)
            & (P.chain[pages] == own[(i + 1) * ps - 1])
        )
        return bool(ok.all())

    def holds_quarantined(self, slots: torch.Tensor) -> bool:
        """Slow path (only while something is quarantined): does this slot list touch one?"""
        t0 = clock()
        pages = self.ledger.pages_of(slots.to(self.device))
        out = bool((self.ledger.state[pages] == PageState.QUARANTINED).any())
        self._account(t0)
        return out

    def private_pages(self, row: int) -> torch.Tensor:
        """Pages the ledger says this row's request owns privately (slow path: aborted requests)."""
        P = self.ledger.pages
        gen = self.records.rows.gen[row]
        mine = (P.owner == row) & (P.owner_gen == gen) & (P.state == PageState.OWNED)
        return torch.nonzero(mine).reshape(-1)

    def status(self) -> dict[str, object]:
        """This guard as plain builtins (start-up handshake, /server_info)."""
        return {
            "mode": self.config.mode.value,
            "sweep_tokens_per_step": self.config.sweep_tokens_per_step,
            "tenant_isolation": self.config.tenant_isolation,
            "on_violation": self.config.on_violation.value,
            "read_path": self.read_path.value,
            "recompute_budget": self.config.recompute_budget,
            "recompute_breaker_per_minute": self.config.recompute_breaker_per_minute,
            "page_size": self.ledger.page_size,
            "num_pages": self.ledger.num_pages,
            "kernels": self.kernels.name,
            "state_bytes": self.state_bytes,
            "quarantine_cap_pages": self.health.quarantine_cap_pages,
            "healthy": self.health.healthy,
        }

    # -- internals ----------------------------------------------------------------------------------------
    def _report_engine_events(self, step: int) -> None:
        for kind, pending in (
            (Kind.DOUBLE_FREE, self._double_freed),
            (Kind.STALE_FREE, self._stale_freed),
        ):
            if pending:
                pages = torch.unique(torch.cat(pending)).cpu()
                pending.clear()
                self.actions.engine_event(kind, step, self.ledger.describe_many(pages[:8].tolist()))

    def _account(self, t0: float) -> None:
        self._seconds += clock() - t0

    def _account_transfer(self, t0: float) -> None:
        """A hand-off check's time: the guard's, and also reported apart (the cost of guarding a
        prefill/decode pair per transfer)."""
        spent = clock() - t0
        self._seconds += spent
        self._transfer_seconds += spent
        self._transfers += 1

    def account_in_forward(self, seconds: float) -> None:
        """Time spent hashing inside the forward (attention's hashed gather, a store's digest):
        the guard's, and also reported apart. The gather is counted whole, SGLang's own share of
        it included (its loop would gather the same rows): an upper bound of the hash's cost."""
        self._seconds += seconds
        self._forward_seconds += seconds

    def flush_metrics(self) -> None:
        """Send the counters gathered since the last flush (the engine calls this when idle),
        and let the recompute breaker close once its minute has passed (it is otherwise asked
        only when a step has something to heal)."""
        self._flush_metrics(force=True)
        self.healing.breaker_open()

    def _flush_metrics(self, force: bool = False) -> None:
        """Counters reach Prometheus at most every FLUSH_EVERY_S seconds while serving (each
        increment is a write into SGLang's multiprocess metric files, tens of microseconds),
        and at once when the engine goes idle or the pool is flushed."""
        if not (self._seconds or self._steps or self._hashed):
            return  # nothing gathered (an idle engine calls this on every loop)
        now = time.monotonic()
        if not force and now - self._flushed_at < FLUSH_EVERY_S:
            return
        self._flushed_at = now
        self.healing.breaker_open()  # its gauge follows the trailing minute while serving
        m = self.metrics
        m.check_seconds.inc(self._seconds)
        if self._forward_seconds:
            m.forward_hash_seconds.inc(self._forward_seconds)
            self._forward_seconds = 0.0
        if self._transfers:
            m.transfers_checked.inc(self._transfers)
            m.transfer_check_seconds.inc(self._transfer_seconds)
            self._transfer_seconds, self._transfers = 0.0, 0
        if self._steps:
            m.steps_checked.inc(self._steps)
            m.tokens_checked.inc(self._tokens)
        if self._hashed:
            m.tokens_checksummed.inc(self._hashed)
        self._seconds, self._steps, self._tokens, self._hashed = 0.0, 0, 0, 0

    @property
    def contained_faults(self) -> int:
        """Violations and internal errors since start: after either, the engine's own memory
        self-checks may see their footprint (a leak, a page both free and cached)."""
        return self.actions.num_violations + self.num_internal_errors

    def charge(self, t0: float) -> None:
        """The adapter's own time for the guard since ``t0`` (``kvguard.guard.clock()``):
        building the step view, capturing rows around a prefix-cache insert."""
        self._account(t0)

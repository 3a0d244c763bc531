"""The guard: one object per KV pool, and the small interface engine adapters use.

An adapter (``kvguard.patches`` for SGLang) calls, in engine order: ``before_forward(view)`` ->
the forward runs -> ``after_forward(verdict)``; later, at the sync that already follows the
forward, ``resolve(verdict, handles)`` reads the verdict and acts. Pool events arrive as
``on_alloc``, ``on_release`` (inside ``releasing(row)`` while a request is released, so a stale
holder cannot free pages someone else now holds), ``on_share`` / ``on_rebind`` (prefix cache)
and ``on_rows_allocated``.

Data flows one way: engine event -> ledger (and records) -> checker -> verdict -> actions. This
class wires the owners of each concern: ``checker`` (the step check, the read after the
forward), ``agreement`` (tensor parallelism), ``quarantine`` (quarantine, reclaim, scrub),
``releases`` (who frees what), ``transfers`` (KV from another server), ``cost`` (its own time).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import structlog
import torch

from kvguard.actions import ActionPlan, Actions, EngineControl
from kvguard.agreement import BREAKER, FAILED, Agreement, PeerRanks
from kvguard.checker import StepChecker
from kvguard.config import GuardConfig, Mode, OnViolation, ReadPath
from kvguard.cost import GuardCost, clock
from kvguard.healing import HealPolicy
from kvguard.health import GuardHealth
from kvguard.kernels.backend import GuardKernels, select
from kvguard.kernels.kv_checksum_ref import KvBuffer, token_digests_ref
from kvguard.ledger import PageLedger
from kvguard.metrics import GuardMetrics
from kvguard.quarantine import Quarantine
from kvguard.ratelimit import RateLimitedLog
from kvguard.records import RowRecords
from kvguard.releases import Releases
from kvguard.step import ReadSums, StepView, WriteSums
from kvguard.transfers import TransferClaims
from kvguard.verdict import StepVerdict, Violation, guard_errors, step_violations

log = structlog.get_logger("kvguard")
__all__ = ["Guard", "PeerRanks", "clock"]


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
        """``peers``: verdicts are agreed with these ranks at resolve (tensor parallelism,
        ``kvguard.agreement``)."""
        self.config = config
        self.device = torch.device(device)
        k = kernels if kernels is not None and not isinstance(kernels, str) else None
        self.kernels: GuardKernels = k or select(
            self.device, kernels if isinstance(kernels, str) else None
        )
        self.ledger = PageLedger(num_slots, page_size, self.device, self.kernels)
        self.records = RowRecords(num_rows, self.device, self.kernels)
        self.checker = StepChecker(self.ledger, self.records, config, kv_buffers)
        buffers = self.checker.kv_buffers
        self.kernels.bind(self.ledger.pages, self.records.rows, buffers)
        self.metrics = metrics or GuardMetrics.default()
        self.cost = GuardCost(self.metrics)
        self.log = RateLimitedLog(self.metrics)
        self.healing = HealPolicy(config, self.metrics, read_path=lambda: self.read_path)
        self.actions = Actions(self.ledger, self.metrics, engine, self.log, self.healing)
        self.health = GuardHealth(config.quarantine_cap_pages(self.ledger.num_pages))
        self.health.listeners.append(self._health_changed)
        self.agreement = Agreement(
            peers, self.ledger, self.healing, lambda: self.read_path, self.internal_error
        )
        self.quarantine = Quarantine(
            self.ledger, buffers, self.metrics, self.health, self.actions, lambda: self.step
        )
        self.releases = Releases(self.ledger, self.records, self.quarantine, self.actions)
        digests = getattr(self.kernels, "token_digests", None) or token_digests_ref
        self.transfers = TransferClaims(self.ledger, self.records, buffers, digests)
        self.step = 0
        self.num_internal_errors = 0  # since start: a failed free may have leaked pages
        self._unresolved: StepVerdict | None = None  # the newest verdict not read yet
        self._buffer_index = {b.data_ptr(): i for i, b in enumerate(buffers)}
        # The adapter digests every KV store as it is handed its bytes (``after_forward``'s
        # ``written``): seals take the writer's digests, not a hash of what the pool holds.
        self.write_path = False
        self.host_reads_free = self.device.type == "cpu"
        self.metrics.state_bytes.set(self.state_bytes)
        self.metrics.quarantine_cap_pages.set(self.health.quarantine_cap_pages)
        self.metrics.healthy.set(1)

    # -- configuration --------------------------------------------------------------------------------
    def set_mode(self, mode: Mode | str, on_violation: OnViolation | str | None = None) -> None:
        """Switch mode (and what a violation does) at run time: benchmarks interleave modes in
        one server, tests switch one engine between healing and aborting. ``off`` here means
        installed but idle; a server started with mode off has no hooks at all."""
        changes: dict[str, object] = {"mode": mode}
        if on_violation is not None:
            changes["on_violation"] = on_violation
        self.config = self.config.with_(**changes)
        self.checker.config = self.healing.config = self.config

    @property
    def active(self) -> bool:
        return self.config.enabled

    @property
    def read_path(self) -> ReadPath:
        """How reads are verified now (decided by the checker when the mode or the hashing
        changes). Healing, the agreement, the hooks and the status all ask here."""
        return self.checker.read_path

    @property
    def verifies_reads(self) -> bool:
        """Attention hashes what it reads and ``after_forward`` judges it (the mode asks for it
        and the adapter hooked the attention backend's read)."""
        return self.checker.read_path is ReadPath.VERIFIED_IN_ATTENTION

    def enable_read_path(self) -> None:
        """The adapter hashes attention's reads (``after_forward`` gets ``read`` every step);
        without it, a mode that verifies reads checks every read before the forward instead."""
        self.checker.hashed_in_attention = True

    def enable_write_path(self) -> None:
        """The adapter digests every store of the forward (``after_forward`` gets ``written``)."""
        self.write_path = True

    @property
    def digests_writes(self) -> bool:
        """Seals take the writer's digests (checksum modes, stores digested by the adapter)."""
        return self.write_path and self.config.checksums

    def buffer_index(self, cache: torch.Tensor | KvBuffer) -> int | None:
        """Which guarded KV buffer attention reads or a store writes (None: not one of them)."""
        return self._buffer_index.get(cache.data_ptr())

    @property
    def state_bytes(self) -> int:
        """Bytes of the guard's own state: ledger, records, the kernel backend's workspaces."""
        return self.ledger.nbytes() + self.records.nbytes() + self.kernels.workspace_bytes()

    @property
    def flush_wanted(self) -> bool:
        """Drop the prefix cache when idle (``Quarantine``; the adapter clears it once done)."""
        return self.quarantine.flush_wanted

    @flush_wanted.setter
    def flush_wanted(self, wanted: bool) -> None:
        self.quarantine.flush_wanted = wanted

    @property
    def tree_suspect(self) -> bool:
        """A node of the prefix cache may hold a page a fault touched (``Quarantine``)."""
        return self.quarantine.tree_suspect

    # -- forward ----------------------------------------------------------------------------------------
    def before_forward(self, view: StepView, t0: float | None = None) -> StepVerdict:
        """Check the step, apply its claims. ``t0``: when the adapter started building the view
        (``clock()``), so that its time is counted without a second clock read."""
        if t0 is None:
            t0 = clock()
        self.step = view.step
        self.checker.escalated = self.quarantine.escalated(view.step)
        x = self.checker.inputs(view)
        check = self.checker.check(x, view.pad_slot)
        self.ledger.apply_step(self.records, x, check)
        verdict = StepVerdict(view=view, inputs=x, check=check)
        if self.host_reads_free:  # on a CPU the flags are known now
            flags = check.flags()
            if flags[1] or flags[2]:  # the check's own list of what it marked: no pool scan
                verdict.suspects = check.marked_pages()
            self.agreement.start(verdict, flags)  # last: nothing may fail after
        self._unresolved = verdict
        self.cost.add_step(t0, len(view.prefix_lens_host) + view.write_slots.numel())
        return verdict

    def after_forward(
        self, verdict: StepVerdict, read: ReadSums | None = None, written: WriteSums | None = None
    ) -> None:
        """Seal what the forward wrote (from the writer's digests ``written`` where
        ``digests_writes``), then judge what attention read (``read``) where reads are verified.
        A seal that hashes nothing (tags, on a CPU) is only queued: the next check applies it."""
        buffers = self.checker.kv_buffers
        if not self.config.checksums and self.ledger.queues:
            self.ledger.seal(verdict.inputs, verdict.check, buffers, False)
            return
        t0 = clock()
        try:
            sums = self.checker.writer_sums(verdict, written) if self.digests_writes else None
            self.ledger.seal(verdict.inputs, verdict.check, buffers, self.config.checksums, sums)
            if self.verifies_reads:
                try:
                    self.cost.hashed += self.checker.verify_reads(verdict, read)
                except Exception as exc:  # nothing unverified is served: the step fails closed
                    self.internal_error("verify", exc)
                    verdict.seal_failed = True
        finally:
            self.cost.add(t0)

    def resolve(self, verdict: StepVerdict | None, handles: list[object]) -> list[Violation]:
        """Read a step's verdict (the caller has synced), agree it with the peers
        (``kvguard.agreement``) and act on it. Returns the violations. ``verdict`` None: the step
        could not be checked (the adapter's check or seal failed): every request fails closed.
        A clean step on a single CPU rank returns at once, untimed: reading a thread-CPU clock
        in a cache-cold moment would cost more than the step's whole resolve."""
        if self._unresolved is verdict:
            self._unresolved = None
        B = len(handles)
        events = self.releases.pending
        t0 = None if self.host_reads_free else clock()  # a GPU's flag read is real work
        if (
            verdict is not None
            and verdict.seal_failed
            and (self.agreement.peers is None or verdict.agreement is None)
        ):
            # fail the step closed now; with peers it joins the agreement below with its failure
            # flag (an agreement already in flight cannot carry it: ``Agreement.agree``)
            verdict = None
        mine: torch.Tensor | None = None
        in_flight = verdict.agreement if verdict is not None else None  # waited below
        if verdict is not None:
            try:
                self.cost.hashed += verdict.check.tokens_hashed()
                if in_flight is None:
                    mine = self.agreement.mine(verdict, B, events)
                    if mine is None:  # a clean step on one rank: nothing to agree on or gather
                        if t0 is not None:
                            self.cost.add(t0)
                        self.health.step_succeeded()
                        self._flush_metrics()
                        return []
            except Exception as exc:
                self.internal_error("resolve", exc)
                verdict = None
        if t0 is None:
            t0 = clock()
        kinds, word = self.agreement.agree(mine, in_flight, B)
        # every rank acts on this step (agreed bits); a rank's own engine events alone act here
        acting_together = bool(word & ~BREAKER) or bool(kinds.any())
        if not (acting_together or events):  # agreed clean: nothing to do
            self.health.step_succeeded()
            self.cost.add(t0)
            self._flush_metrics()
            return []
        taint, reclaim = self.agreement.pages(verdict, word, self.host_reads_free)
        step = self.step if verdict is None else verdict.view.step
        violations: list[Violation] = []
        plan: ActionPlan | None = None
        try:
            self.releases.report(step)
            breaker = self.agreement.breaker_open(word)
            violations, plan = self.plan_actions(verdict, handles, kinds, breaker)
        except Exception as exc:
            self.internal_error("resolve", exc)
        # Every rank applies its plan, or every rank fails the batch closed: one rank healing a
        # request another aborts would split their batches (the next collective hangs). Only
        # where all ranks act (agreed bits), so the extra OR runs on flagged steps alone.
        planned = plan is not None
        if acting_together:
            planned = self.agreement.all_ranks_ok(planned)
        applied = False
        if planned and plan is not None:
            try:
                self.actions.apply(plan)
                self.quarantine.contain(verdict, kinds, taint, reclaim, step)
                applied = True
            except Exception as exc:
                self.internal_error("resolve", exc)
        if not applied:  # acting failed here or on a peer rank: fail the whole batch closed
            violations = self.fail_closed(handles)
            try:  # pages it would have quarantined may sit in the prefix cache
                self.quarantine.contain(verdict, kinds, taint, None, step)
            except Exception as exc2:
                self.internal_error("resolve", exc2)
        if verdict is not None and not word & FAILED:
            self.health.step_succeeded()
        self.cost.add(t0)
        self._flush_metrics()
        return violations

    def plan_actions(
        self,
        verdict: StepVerdict | None,
        handles: list[object],
        kinds: torch.Tensor,
        breaker_open: bool = False,
    ) -> tuple[list[Violation], ActionPlan]:
        """The step's violations and what to do with each flagged request (heal or abort),
        decided without touching the engine or the ledger."""
        step = self.step if verdict is None else verdict.view.step
        violations, bad = step_violations(verdict, handles, kinds, step, self.ledger, self.records)
        return violations, self.actions.plan(violations, bad, breaker_open)

    def fail_closed(self, handles: list[object]) -> list[Violation]:
        """Abort every request of a step the guard could not judge (GUARD_ERROR)."""
        violations = guard_errors(handles, self.step)
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

    def scrub(self, pages: torch.Tensor) -> torch.Tensor:
        """Quarantined pages nobody holds: back in service, scrubbed (``Quarantine.scrub``)."""
        return self.quarantine.scrub(pages)

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
        self.cost.add(t0)

    @property
    def release_row(self) -> int | None:
        """The row of the request being released (inside ``releasing``), else None."""
        return self.releases.row

    def releasing(self, row: int) -> AbstractContextManager[None]:
        """While the request on ``row`` is released: frees are attributed to it."""
        return self.releases.attributed_to(row)

    def attribute_free(self, pages: torch.Tensor) -> torch.Tensor:
        """Inside ``releasing(row)``: [n] bool, which of these pages the releasing request may
        free (not those someone else now holds: it is their stale holder)."""
        row = self.releases.row
        if row is None:
            return torch.ones(pages.shape, dtype=torch.bool, device=pages.device)
        t0 = clock()
        keep = self.releases.attribute(pages, row)
        self.cost.add(t0)
        return keep

    def on_release(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages go back to the engine's free list. Returns the pages that really may be reused:
        a double free is not pushed twice, a quarantined page goes back only scrubbed."""
        t0 = clock()
        out = self.releases.release(pages, self.step)
        self.cost.add(t0)
        return out

    def on_share(self, slots: torch.Tensor, row: int) -> None:
        """The prefix cache took row ``row``'s KV up to these slots: its own pages become shared."""
        t0 = clock()
        self.ledger.share(self.records, slots, row, self.step)
        self.cost.add(t0)

    def on_rebind(
        self, row: int, first_position: int, old_slots: torch.Tensor, new_slots: torch.Tensor
    ) -> None:
        """The prefix cache replaced the row's slots from ``first_position`` by its own copies."""
        t0 = clock()
        self.ledger.rebind(self.records, row, first_position, old_slots, new_slots, self.step)
        self.cost.add(t0)

    def on_rows_allocated(self, rows: torch.Tensor) -> None:
        """Rows handed to new requests: forget what their previous owners expected."""
        t0 = clock()
        self.records.reset_rows(rows)
        self.transfers.forget(rows)
        self.cost.add(t0)

    def reset(self) -> None:
        """The engine cleared its pool: every page free, no record, nothing quarantined (the
        quarantined pages' bytes scrubbed first: a flush returns them to service too)."""
        scrubbed = self.ledger.num_quarantined
        self.ledger.reset(self.checker.kv_buffers)
        self.quarantine.cleared(scrubbed)
        self.records.reset()
        self.releases.clear()
        self._flush_metrics(force=True)

    # -- transfers (KV written by another server: prefill/decode disaggregation) -------------------
    def on_transfer_issued(
        self, row: int, slots: torch.Tensor, tokens: torch.Tensor, seed: int = 0
    ) -> int:
        """A transfer of ``tokens``' KV into row ``row``'s positions [0, n) at ``slots`` was
        issued: its pages are claimed for the row, unsealed until it lands. Returns the claim's
        verdict bits (0: claimed); a failed claim is acted on when the transfer lands."""
        t0 = clock()
        try:
            return self.transfers.issue(row, slots, tokens, seed, self.step)
        finally:
            self.cost.add_transfer(t0)

    def on_transfer_sent(self, slots: torch.Tensor) -> int | None:
        """The seal of a request's positions [0, n) sent from ``slots`` [n], which travels with
        them; None where this server's ledger cannot vouch for them."""
        t0 = clock()
        try:
            return self.transfers.send_seal(slots, self.config.checksums)
        finally:
            self.cost.add_transfer(t0)

    def on_transfer_landed(
        self,
        row: int,
        handle: object,
        request_id: str | None = None,
        sent_seal: int | None = None,
        sent_tokens: int | None = None,
    ) -> Violation | None:
        """The transfer into row ``row`` (request ``handle``) landed: sealed if its claim is
        unchanged and its bytes match the sender's seal (``TransferClaims.land``); otherwise the
        request is aborted (nothing it could be recomputed from is on this server) and the
        violation returned."""
        t0 = clock()
        try:
            violation = self.transfers.land(
                row, self.step, self.config.checksums, request_id, sent_seal, sent_tokens
            )
            if violation is not None:
                self.actions.abort([violation], [handle])
            return violation
        finally:
            self.cost.add_transfer(t0)

    # -- questions the adapter may ask --------------------------------------------------------------------
    def unread_taint(self) -> bool:
        """Did the newest unread verdict find bad pages? (CPU only, like suspect_before_resolve.)"""
        v = self._unresolved
        return v is not None and self.host_reads_free and v.found_bad_pages()

    def suspect_before_resolve(
        self, request_id: str | None = None, slots: torch.Tensor | None = None
    ) -> bool:
        """Was this request flagged, or does one of these slots sit in a page found bad, by a step
        whose verdict is not read yet (an overlap scheduler prepares the next step first)? CPU
        only; elsewhere False: the verdict is then acted on one step later."""
        v = self._unresolved
        return (
            v is not None
            and self.host_reads_free
            and v.suspects_any(request_id, slots, self.ledger)
        )

    def in_unresolved_step(self, request_id: str) -> bool:
        """Was this request in the newest step whose verdict is not read yet? (Answered from the
        step's own request list: the same on every tensor-parallel rank.)"""
        v = self._unresolved
        return v is not None and request_id in (v.view.request_ids or ())

    def adoptable(self, slots: torch.Tensor, tokens: list[int], seed: int = 0) -> bool:
        """Would a reader with these prompt tokens (and chain seed) adopt these prefix-cache slots
        (whole pages, from position 0)? ``guard_ref.adoptable``, asked early so the engine can
        refuse the hit (the request prefills its own KV) instead of the guard aborting it."""
        t0 = clock()
        try:
            return self.ledger.adoptable(slots, tokens, seed)
        finally:
            self.cost.add(t0)

    def holds_quarantined(self, slots: torch.Tensor) -> bool:
        """Slow path (only while something is quarantined): does this slot list touch one?"""
        t0 = clock()
        out = self.quarantine.holds(slots)
        self.cost.add(t0)
        return out

    def private_pages(self, row: int) -> torch.Tensor:
        """Pages the ledger says this row's request owns privately (slow path: aborted requests)."""
        return self.ledger.private_pages(self.records, row)

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

    @property
    def contained_faults(self) -> int:
        """Violations and internal errors since start: after either, the engine's own memory
        self-checks may see their footprint (a leak, a page both free and cached)."""
        return self.actions.num_violations + self.num_internal_errors

    # -- the guard's own cost ---------------------------------------------------------------------------
    def charge(self, t0: float) -> None:
        """The adapter's own time for the guard since ``t0`` (``kvguard.guard.clock()``):
        building the step view, capturing rows around a prefix-cache insert."""
        self.cost.add(t0)

    def account_in_forward(self, seconds: float) -> None:
        """Time spent hashing inside the forward (``GuardCost.add_in_forward``)."""
        self.cost.add_in_forward(seconds)

    def flush_metrics(self) -> None:
        """When idle: send the counters, and let the recompute breaker close once its minute has
        passed (it is otherwise asked only when a step has something to heal)."""
        self._flush_metrics(force=True)
        self.healing.breaker_open()

    def _flush_metrics(self, force: bool = False) -> None:
        if self.cost.flush(force):
            self.healing.breaker_open()  # its gauge follows the trailing minute while serving

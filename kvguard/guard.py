"""The guard: one object per KV pool that engine adapters feed with events.

An adapter (``kvguard.patches`` for SGLang) calls, in engine order:
``before_forward(view)`` -> the forward runs -> ``after_forward(view)``; later, at the sync that
already follows the forward, ``resolve(verdict, handles)`` reads the verdict and acts. Pool events
arrive as ``on_release`` (pages back to the free list), ``on_share`` (prefix cache took slots) and
``on_rows_allocated`` (a page-table row handed to a new request).
"""

from __future__ import annotations

import time

import torch

from kvguard.actions import Actions, EngineControl
from kvguard.checker import StepChecker, StepVerdict
from kvguard.config import GuardConfig
from kvguard.ledger import PageLedger, PageState
from kvguard.metrics import GuardMetrics
from kvguard.records import RowRecords
from kvguard.step import StepView
from kvguard.verdict import Kind, Violation, new_violation_id


class Guard:
    def __init__(
        self,
        config: GuardConfig,
        *,
        num_slots: int,
        page_size: int,
        num_rows: int,
        max_len: int,
        kv_buffers: list[torch.Tensor],
        device,
        engine: EngineControl | None = None,
        metrics: GuardMetrics | None = None,
    ):
        self.config = config
        self.ledger = PageLedger(num_slots, page_size, device)
        self.records = RowRecords(num_rows, max_len, page_size, device)
        self.checker = StepChecker(self.ledger, self.records, config, kv_buffers)
        self.metrics = metrics or GuardMetrics.default()
        self.actions = Actions(self.ledger, self.metrics, engine)
        self.step = 0
        self.flush_wanted = (
            False  # a quarantine happened: the engine should drop its caches when idle
        )
        self.releasing_row: int | None = (
            None  # set by the adapter while it releases an aborted request
        )
        self._hashed_reported = 0
        self._pending_taint = torch.zeros(
            self.ledger.num_pages, dtype=torch.bool, device=self.ledger.device
        )
        self._double_freed = torch.zeros(
            self.ledger.num_pages, dtype=torch.bool, device=self.ledger.device
        )
        self._unresolved: StepVerdict | None = None  # the newest verdict not read yet

    def set_mode(self, mode) -> None:
        """Switch mode at run time (benchmarks interleave modes in one server). ``off`` here means
        installed but idle; a server started with mode off has no hooks at all."""
        self.config = self.config.with_(mode=mode)
        self.checker.config = self.config

    @property
    def active(self) -> bool:
        return self.config.enabled

    # -- forward ------------------------------------------------------------------------------------
    def before_forward(self, view: StepView) -> StepVerdict:
        t0 = time.perf_counter()
        self.step = view.step
        self.checker.escalated = (
            self.flush_wanted
        )  # a quarantine not yet flushed: verify every read
        # Pages found bad between forwards (allocation) count as found in this step.
        verdict = self.checker.before_forward(view, self._pending_taint)
        self._pending_taint = torch.zeros_like(self._pending_taint)
        self._unresolved = verdict
        self.metrics.steps_checked.inc()
        self.metrics.tokens_checked.inc(view.write_slots.numel())
        self._account(t0)
        return verdict

    def after_forward(self, view: StepView):
        t0 = time.perf_counter()
        self.checker.after_forward(view)
        self._account(t0)

    def resolve(self, verdict: StepVerdict, handles: list[object], agree=None) -> list[Violation]:
        """Read a step's verdict (the caller has synced) and act on it. Returns the violations.

        ``agree(tensor) -> tensor``: with tensor parallelism each rank hashes its own KV heads, so
        verdicts can differ; the adapter passes an all-reduce (bitwise OR) over the ranks so that
        every rank aborts and quarantines exactly the same things."""
        t0 = time.perf_counter()
        if self._unresolved is verdict:
            self._unresolved = None
        B = verdict.kinds.numel()
        if (
            agree is None
            and self.checker.host_reads_free
            and not (
                bool(verdict.kinds.any())
                or bool(verdict.taint.any())
                or bool(self._double_freed.any())
            )
        ):
            self._account(t0)
            return []  # CPU, one rank, a clean step: nothing to gather
        taint = verdict.taint
        if verdict.taint_epoch is not None:
            # The overlap scheduler reads a verdict a step late: a tainted page freed and handed
            # out again meanwhile (re-claimed: new epoch; or allocated, about to be rewritten)
            # belongs to a new owner and is not quarantined under it.
            L = self.ledger
            taint = taint & (L.epoch == verdict.taint_epoch) & (L.state != PageState.ALLOCATED)
        summary = torch.cat(
            (
                verdict.kinds,
                taint.to(torch.int64),
                self._double_freed.any().to(torch.int64).reshape(1),
            )
        )
        if agree is not None:
            summary = agree(summary)
        summary = summary.cpu()
        kinds, taint, any_double = summary[:B], summary[B:-1] > 0, bool(summary[-1])
        if any_double:
            self._report_double_free()
        if not bool(kinds.any()) and not bool(taint.any()):
            self._account(t0)
            return []
        bad_pages = torch.nonzero(taint).reshape(-1)
        violations, bad_handles = [], []
        for b in torch.nonzero(kinds).reshape(-1).tolist():
            violations.append(self._forensics(verdict.view, b, Kind(int(kinds[b]))))
            bad_handles.append(handles[b])
        self.actions.apply(violations, bad_handles, bad_pages, verdict.view.step)
        self.flush_wanted |= bad_pages.numel() > 0
        self._account(t0)
        return violations

    # -- pool events ----------------------------------------------------------------------------------
    def on_release(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages go back to the engine's free list. Returns the pages that may really be reused:
        a page already free is not pushed twice, a quarantined page is withheld, and while an
        aborted request is released (``releasing_row``) only pages it owns privately go back."""
        t0 = time.perf_counter()
        L = self.ledger
        pages = pages.to(torch.int64)
        st = L.state[pages]
        keep = (st != PageState.FREE) & (st != PageState.QUARANTINED)
        if self.releasing_row is not None:
            keep &= (st == PageState.OWNED) & (L.owner_row[pages] == self.releasing_row)
        self._double_freed.index_put_(
            (pages,), st == PageState.FREE, accumulate=True
        )  # read at resolve
        if (
            self.actions.num_quarantined_total
        ):  # host int: no sync while nothing was ever quarantined
            L.num_quarantined += int((st == PageState.QUARANTINED).sum())  # withheld from now on
        pages = pages[keep]  # a sync on GPU, like the torch.unique SGLang's free already does
        L.release(pages, self.step)
        self._account(t0)
        return pages

    def unread_taint(self) -> bool:
        """Did the newest unread verdict find bad pages? (CPU only, like suspect_before_resolve.)"""
        v = self._unresolved
        return v is not None and self.checker.host_reads_free and bool(v.taint.any())

    def suspect_before_resolve(self, request_id=None, slots: torch.Tensor | None = None) -> bool:
        """Was this request flagged, or does one of these slots sit in a page found bad, by a step
        whose verdict is not read yet? An overlap scheduler prepares the next step (prefix-cache
        inserts and hits) before it reads the last verdict. Answered where a host read is free
        (CPU); elsewhere False: the verdict is then acted on one step later."""
        v = self._unresolved
        if v is None or not self.checker.host_reads_free:
            return False
        if request_id is not None and v.view.request_ids and bool(v.kinds.any()):
            if request_id in {rid for rid, k in zip(v.view.request_ids, v.kinds.tolist()) if k}:
                return True
        if slots is not None and bool(v.taint.any()):
            pages = torch.div(slots.to(torch.int64), self.ledger.page_size, rounding_mode="floor")
            return bool(v.taint[pages.to(v.taint.device)].any())
        return False

    def holds_quarantined(self, slots: torch.Tensor) -> bool:
        """Slow path (only once something was quarantined): does this slot list touch one?"""
        pages = torch.div(slots.to(torch.int64), self.ledger.page_size, rounding_mode="floor")
        return bool(
            (self.ledger.state[pages.to(self.ledger.device)] == PageState.QUARANTINED).any()
        )

    def private_pages(self, row: int) -> torch.Tensor:
        """Pages the ledger says this row owns privately (slow path: aborted requests only)."""
        L = self.ledger
        return torch.nonzero((L.owner_row == row) & (L.state == PageState.OWNED)).reshape(-1)

    def on_alloc(self, slots: torch.Tensor):
        """The engine's allocator handed out slots. A page handed out while still held is
        tainted: its holders and its new owner are aborted at their next forward."""
        t0 = time.perf_counter()
        self._pending_taint |= self.ledger.allocate(slots, self.step)
        self._account(t0)

    def on_share(self, slots: torch.Tensor):
        self.ledger.share(slots, self.step)

    def on_rows_allocated(self, rows: torch.Tensor):
        """A row is reused by a new request: forget what its previous owner expected."""
        rows = rows.to(torch.int64)
        self.records.epoch[rows] = 0
        self.records.chain[rows] = 0
        self.records.sealed[rows] = False

    def reset(self):
        """The engine cleared its pool: every page free, no record, nothing quarantined."""
        self.ledger.reset()
        self.records.epoch.zero_()
        self.records.chain.zero_()
        self.records.sealed.zero_()
        self.actions.num_quarantined_total = 0

    @property
    def num_quarantined_slots(self) -> int:
        return self.ledger.num_quarantined * self.ledger.page_size

    def _report_double_free(self):
        pages = torch.nonzero(self._double_freed).reshape(-1)
        self._double_freed.zero_()
        self.actions.engine_event(
            Violation(
                new_violation_id(),
                Kind.DOUBLE_FREE,
                self.step,
                None,
                None,
                [self.ledger.describe(int(p)) for p in pages[:8].tolist()],
            )
        )

    # -- internals --------------------------------------------------------------------------------------
    def _account(self, t0: float):
        self.metrics.check_seconds.inc(time.perf_counter() - t0)
        hashed = self.checker.tokens_hashed
        if hashed != self._hashed_reported:
            self.metrics.tokens_checksummed.inc(hashed - self._hashed_reported)
            self._hashed_reported = hashed

    def _forensics(self, v: StepView, b: int, kinds: Kind) -> Violation:
        """Slow path: name the suspect pages of request b, with expected vs found tags/digests."""
        L, R, ps = self.ledger, self.records, self.ledger.page_size
        row = int(v.rows[b])
        n = int(v.prefix_lens[b])
        mine = v.write_batch == b
        slots = torch.cat(
            (v.page_table[row, :n].to(torch.int64), v.write_slots[mine].to(torch.int64))
        ).cpu()
        pos = torch.cat((torch.arange(n), v.write_pos[mine].to(torch.int64).cpu()))
        page = slots // ps
        found = torch.zeros_like(slots)
        if self.config.checksums and n:
            found[:n] = self.checker._digests(slots[:n].to(L.device), pos[:n].to(L.device)).cpu()
        exp_epoch = R.epoch[row, (pos // ps).to(L.device)].cpu()
        exp_digest = R.digest[row, pos.to(L.device)].cpu()
        reasons = {
            "epoch": L.epoch[page.to(L.device)].cpu() != exp_epoch,
            "state": ~torch.isin(
                L.state[page.to(L.device)].cpu(),
                torch.tensor(
                    [int(PageState.OWNED), int(PageState.SHARED), int(PageState.ALLOCATED)]
                ),
            ),
            "offset": (slots % ps) != (pos % ps),
            "digest": (torch.arange(slots.numel()) < n) & (found != exp_digest)
            if self.config.checksums
            else torch.zeros_like(slots, dtype=torch.bool),
            "quarantined": L.state[page.to(L.device)].cpu() == PageState.QUARANTINED,
        }
        write_kinds = (
            Kind.OVERWRITE | Kind.DOUBLE_ALLOCATION | Kind.WRITE_TO_SHARED | Kind.TABLE_MISMATCH
        )
        if kinds & write_kinds:  # the write targets themselves are the evidence
            reasons["write_target"] = torch.arange(slots.numel()) >= n
        suspect = torch.zeros_like(slots, dtype=torch.bool)
        for m in reasons.values():
            suspect |= m
        pages: dict[int, dict] = {}
        for i in torch.nonzero(suspect).reshape(-1).tolist():
            pg = int(page[i])
            if pg not in pages:
                if len(pages) >= 8:
                    break
                pages[pg] = {**L.describe(pg), "positions": []}
            entry = pages[pg]["positions"]
            if len(entry) < 8:
                entry.append(
                    {
                        "position": int(pos[i]),
                        "slot": int(slots[i]),
                        "write": i >= n,
                        "why": [k for k, m in reasons.items() if bool(m[i])],
                        "expected_epoch": int(exp_epoch[i]),
                        "expected_digest": int(exp_digest[i]),
                        "found_digest": int(found[i]),
                    }
                )
        rid = v.request_ids[b] if v.request_ids else None
        return Violation(new_violation_id(), kinds, v.step, rid, row, list(pages.values()))

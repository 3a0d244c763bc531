"""A synthetic paged KV pool driven the way an engine drives the guard, with no engine.

One helper for the guard's unit tests, the kernel-equivalence tests and ``bench.step``: an
allocator (a free list of pages), page-table rows, a prefix cache of shared pages, and a
"forward" that writes each token's KV bytes as a function of (token, position), so identical
prefixes hold identical bytes. Every engine event reaches the guard through its public interface
(``on_alloc``, ``before_forward``, ``after_forward``, ``resolve``, ``releasing``/``on_release``,
``on_share``, ``on_rows_allocated``), in the order SGLang makes them. Corruptions are made the
way engine bugs make them: through the page table, the allocator, the prefix cache or the bytes,
never through the guard's state. ``device`` puts the pool (and so the guard) on a GPU, for the
compiled Triton kernels. ``index_layers`` adds page-major buffers laid out as a DSA pool's index
keys; ``kv_buffers`` guards a real pool's buffers (``patches.adapter.guarded_kv_buffers``) instead.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from kvguard.config import GuardConfig
from kvguard.guard import Guard
from kvguard.kernels.backend import GuardKernels
from kvguard.kernels.kv_checksum_ref import KvBuffer, PageMajor, page_major, row_words
from kvguard.metrics import GuardMetrics
from kvguard.step import ReadSums, StepView, WriteSums
from kvguard.verdict import StepVerdict, Violation

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
_metrics: GuardMetrics | None = None


def _quiet_metrics() -> GuardMetrics:
    global _metrics
    if _metrics is None:
        from prometheus_client import CollectorRegistry

        _metrics = GuardMetrics(registry=CollectorRegistry())
    return _metrics


@dataclass
class Request:
    rid: str
    row: int
    tokens: list[int]  # prompt + generated so far (the KV of tokens[:length] is written)
    length: int = 0  # positions whose KV is in the pool
    pages: list[int] = field(default_factory=list)  # physical page per logical page
    aborted: bool = False
    tenant_seed: int = 0


class _Engine:
    """The synthetic engine's side of the guard's actions."""

    def __init__(self, pool: SyntheticPool):
        self.pool = pool

    def abort(self, request_handle: object, violation: Violation) -> bool:
        if isinstance(request_handle, Request):
            request_handle.aborted = True
        return True

    def recomputes(self, request_handle: object) -> int:
        return 0

    def emitted(self, request_handle: object) -> int:
        return 0  # no client: nothing was sent

    def recomputing(self, request_handle: object) -> bool:
        return False

    def recompute(self, request_handle: object, violation: Violation) -> bool:
        return False  # no scheduler to re-queue into: flagged requests are aborted

    def withhold_pages(self, pages: torch.Tensor) -> int:
        drop = set(pages.tolist())
        before = len(self.pool.free_pages)
        self.pool.free_pages = [p for p in self.pool.free_pages if p not in drop]
        return before - len(self.pool.free_pages)


class SyntheticPool:
    def __init__(
        self,
        *,
        page_size: int = 16,
        num_pages: int = 256,
        num_rows: int = 32,
        max_len: int = 512,
        mode: str = "paranoid",
        kernels: str | GuardKernels | None = None,
        layers: int = 2,
        row_bytes: int = 16,
        sweep_tokens_per_step: int = 512,
        seed: int = 0,
        device: str = "cpu",
        index_layers: int = 0,
        kv_buffers: Sequence[KvBuffer] | None = None,
        writer_digests: bool = True,
    ):
        self.ps = page_size
        self.device = dev = torch.device(device)
        self.num_pages = num_pages
        self.num_slots = num_pages * page_size
        self.bufs: list[KvBuffer] = (
            list(kv_buffers)
            if kv_buffers is not None
            else self._buffers(layers, row_bytes, index_layers, seed)
        )
        self.table = torch.zeros(num_rows, max_len, dtype=torch.int32, device=dev)
        config = GuardConfig(mode=mode, sweep_tokens_per_step=sweep_tokens_per_step)
        self.guard = Guard(
            config,
            num_slots=self.num_slots,
            page_size=page_size,
            num_rows=num_rows,
            kv_buffers=self.bufs,
            device=dev,
            metrics=_quiet_metrics(),
            kernels=kernels,
            engine=_Engine(self),
        )
        if writer_digests:  # seals take the writer's digests, as a CPU engine's do
            self.guard.enable_write_path()
        self.free_pages = list(range(1, num_pages))  # page 0: the engine's padding page
        self.free_rows = list(range(1, num_rows))  # row 0: padding
        self.step = 0
        self.next_alloc: list[int] = []  # pages a buggy allocator hands out next
        self.violations: list[Violation] = []
        self.trace: list[dict[str, torch.Tensor]] | None = None  # snapshots after each forward
        self._n = 0

    def _buffers(self, layers: int, row_bytes: int, index_layers: int, seed: int) -> list[KvBuffer]:
        g = torch.Generator().manual_seed(seed)
        n, ps, dev = self.num_slots, self.ps, self.device
        out: list[KvBuffer] = [
            torch.randint(0, 255, (n, 2, row_bytes // 2), dtype=torch.uint8, generator=g).to(dev)
            for _ in range(2 * layers)
        ]
        for _ in range(index_layers):  # per page: ps keys of 128 bytes, then their fp32 scales
            idx = torch.randint(0, 255, (n // ps, ps * 132), dtype=torch.uint8, generator=g)
            idx = idx.to(dev)
            out.append(page_major(idx, offset=0, slot_bytes=128, row_bytes=128, per_page=ps))
            out.append(page_major(idx, offset=ps * 128, slot_bytes=4, row_bytes=4, per_page=ps))
        return out

    # -- requests ---------------------------------------------------------------------------------------
    def admit(
        self,
        tokens: list[int],
        prefix: Request | None = None,
        prefix_pages: int = 0,
        tenant_seed: int = 0,
    ) -> Request:
        row = self.free_rows.pop(0)
        self._n += 1
        req = Request(rid=f"r{self._n}", row=row, tokens=list(tokens), tenant_seed=tenant_seed)
        self.guard.on_rows_allocated(torch.tensor([row], device=self.device))
        if prefix is not None and prefix_pages:  # a prefix-cache hit on prefix's shared pages
            req.pages = prefix.pages[:prefix_pages]
            n = prefix_pages * self.ps
            self.table[row, :n] = self.table[prefix.row, :n]
            req.length = n
        return req

    def _take_page(self) -> int:
        if self.next_alloc:
            return self.next_alloc.pop(0)
        return self.free_pages.pop(0)

    def forward(
        self,
        reqs: list[Request],
        new_tokens: int | list[int] = 1,
        prefix_hit: bool | None = None,
        redirect: dict[tuple[str, int], int] | None = None,
        before_resolve: Callable[[], None] | None = None,
        astray: dict[tuple[str, int], int] | None = None,
    ) -> StepVerdict:
        """One forward: each request writes its next ``new_tokens`` tokens (an extend step when
        more than one, or when a request's first forward, else decode). ``redirect`` maps
        (request id, position) to a slot the engine wrongly writes (and records in the table)
        instead of the one it allocated. ``before_resolve``: engine events between the forward and
        the reading of its verdict (an overlap scheduler checkpoints a chunk into the prefix
        cache then). ``astray`` maps (request id, position) to where that token's store really
        lands (-1: nowhere), the table and the write list still naming the allocated slot (a
        store that never lands, or lands elsewhere)."""
        ps = self.ps
        counts = [new_tokens] * len(reqs) if isinstance(new_tokens, int) else list(new_tokens)
        live = [(r, n) for r, n in zip(reqs, counts) if not r.aborted]  # aborted: out of the batch
        reqs, counts = [r for r, _ in live], [n for _, n in live]
        redirect = redirect or {}
        slots_all, pos_all, tok_all, batch_all, fresh = [], [], [], [], []
        for b, (r, n) in enumerate(zip(reqs, counts)):
            for p in range(r.length, r.length + n):
                if (r.rid, p) in redirect:
                    slot = redirect[(r.rid, p)]
                    if p % ps == 0:
                        r.pages.append(slot // ps)
                else:
                    if p % ps == 0:
                        page = self._take_page()
                        r.pages.append(page)
                        fresh.append(page * ps)
                    slot = r.pages[p // ps] * ps + p % ps
                self.table[r.row, p] = slot
                slots_all.append(slot)
                pos_all.append(p)
                tok_all.append(r.tokens[p])
                batch_all.append(b)
        self.step += 1
        dev = self.device
        if fresh:
            self.guard.on_alloc(torch.tensor(fresh, dtype=torch.int64, device=dev))
        extend = (
            prefix_hit
            if prefix_hit is not None
            else any(n > 1 or r.length == 0 for r, n in zip(reqs, counts))
        )
        prefix_tokens = None
        if extend:
            flat = [t for r in reqs for t in r.tokens[: r.length]]
            prefix_tokens = torch.tensor(flat, dtype=torch.int64, device=dev)
        view = StepView(
            step=self.step,
            rows=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev),
            prefix_lens_host=[r.length for r in reqs],
            write_slots=torch.tensor(slots_all, dtype=torch.int64, device=dev),
            write_batch=torch.tensor(batch_all, dtype=torch.int64, device=dev),
            write_pos=torch.tensor(pos_all, dtype=torch.int64, device=dev),
            write_tokens=torch.tensor(tok_all, dtype=torch.int64, device=dev),
            page_table=self.table,
            prefix_tokens=prefix_tokens,
            tenant_seeds=torch.tensor([r.tenant_seed for r in reqs], dtype=torch.int64, device=dev),
            request_ids=[r.rid for r in reqs],
        )
        verdict = self.guard.before_forward(view)
        landing = None
        if astray:
            landing = view.write_slots.clone()
            for j, key in enumerate((reqs[b].rid, p) for b, p in zip(batch_all, pos_all)):
                if key in astray:
                    landing[j] = astray[key]
        written = self.write_kv(  # after the firewall
            view.write_slots, view.write_tokens, view.write_pos, landing
        )
        read = self._attention_read(reqs, counts) if self.guard.verifies_reads else None
        self.guard.after_forward(verdict, read, written if self.guard.write_path else None)
        if self.trace is not None:
            self.trace.append(self.snapshot(verdict))
        if before_resolve is not None:
            before_resolve()
        violations = self.guard.resolve(verdict, handles=list(reqs))
        self.violations += violations
        for v in violations:
            for r in reqs:
                if r.rid == v.request:
                    r.aborted = True
        for r, n in zip(reqs, counts):
            r.length += n
        return verdict

    def _attention_read(self, reqs: list[Request], counts: list[int]) -> ReadSums:
        """Verified reads (``guard.enable_read_path()``): what attention reads, every position
        of each request this step's writes included, hashed as the gather hashes it (the
        reference kernel)."""
        from kvguard.kernels import read_verify_ref as ref

        lens = [r.length + n for r, n in zip(reqs, counts)]
        rows = torch.cat([self.table[r.row, :n].to(torch.int64) for r, n in zip(reqs, lens)])
        acc = torch.zeros(rows.numel(), dtype=torch.int64, device=self.device)
        hashed = []
        for i, b in enumerate(self.bufs):
            if isinstance(b, PageMajor):  # index keys: read by an indexer, not by attention
                continue
            row_bytes = b[0].numel() * b.element_size()
            ref.gather_rows(b, rows, None, ref.buffer_constants(i, row_bytes), acc)
            hashed.append(i)
        req_rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=self.device)
        return ReadSums(rows, lens, req_rows, acc, hashed)

    def write_kv(
        self,
        slots: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        landing: torch.Tensor | None = None,
    ) -> WriteSums:
        """The forward's KV writes: bytes a function of (token, position, buffer), and the
        writer's digests of them (``WriteSums``: what the guard seals where it takes writers'
        digests). ``landing`` [N]: where each store really lands (-1: it never lands), for the
        fault where a store goes astray; default ``slots``."""
        from kvguard.kernels import read_verify_ref as ref

        dest = slots if landing is None else landing
        keep = dest >= 0
        dest = dest[keep]
        acc = torch.zeros(slots.numel(), dtype=torch.int64, device=slots.device)
        for i, b in enumerate(self.bufs):
            val = ((tokens * 31 + positions * 7 + i * 13) % 251).to(torch.uint8)
            if isinstance(b, PageMajor) or b.dtype != torch.uint8:  # a real pool's: as bytes
                rows = row_words(b).view(torch.uint8)
                step = torch.arange(rows.shape[-1], dtype=torch.uint8, device=rows.device)
                meant = val[:, None] + step
                if rows.dim() == 2:
                    rows[dest] = meant[keep]
                else:  # page-major: slot s is row s % per_page of page s // per_page
                    rows[dest // rows.shape[1], dest % rows.shape[1]] = meant[keep]
            else:
                meant = val[:, None, None].expand(-1, b.shape[1], b.shape[2]) + torch.arange(
                    b.shape[2], dtype=torch.uint8, device=b.device
                )
                b[dest] = meant[keep]
            row_bytes = math.prod(meant.shape[1:])
            ref.hash_rows(meant, ref.buffer_constants(i, row_bytes).to(acc.device), acc)
        return WriteSums(acc, list(range(len(self.bufs))))

    def share(self, req: Request, num_pages: int | None = None) -> None:
        """The prefix cache takes the request's first (full) pages."""
        n = len(req.pages) if num_pages is None else num_pages
        n = min(n, req.length // self.ps)
        if n:
            self.guard.on_share(self.table[req.row, : n * self.ps].to(torch.int64), req.row)

    def release(self, req: Request, keep_pages: int = 0) -> list[int]:
        """The request finishes: its private pages (beyond the first ``keep_pages``, which the
        prefix cache holds) go back to the free list, attributed to its row."""
        pages = torch.tensor(req.pages[keep_pages:], dtype=torch.int64, device=self.device)
        with self.guard.releasing(req.row):
            pages = pages[self.guard.attribute_free(pages)]
            back = self.guard.on_release(pages).tolist()
        self.free_pages.extend(back)
        self.free_rows.append(req.row)
        return back

    def evict(self, pages: list[int]) -> list[int]:
        """The prefix cache (or a buggy free) returns pages with no request attributed."""
        back = self.guard.on_release(
            torch.tensor(pages, dtype=torch.int64, device=self.device)
        ).tolist()
        self.free_pages.extend(back)
        return back

    def snapshot(self, verdict: StepVerdict) -> dict[str, torch.Tensor]:
        """Everything a backend decides or changes in one step, for backend comparisons."""
        c = verdict.check
        out = {
            "kinds": c.kinds.clone(), "taint": c.taint.clone(), "reclaim": c.reclaim.clone(),
            "hashed": torch.tensor([c.tokens_hashed()]),
            "write_ok": c.write_ok.clone(), "firewalled": verdict.view.write_slots.clone(),
        }  # fmt: skip
        P, R = self.guard.ledger.pages, self.guard.records.rows
        for name, t in zip(
            (
                "state",
                "prior",
                "fill",
                "owner",
                "owner_gen",
                "lpage",
                "epoch",
                "chain",
                "digest",
                "history",
            ),
            P.tensors(),
        ):
            out["page." + name] = t.clone()
        for name, t in zip(("gen", "n_pages", "agg", "chain_len", "chain_tail"), R.tensors()):
            out["row." + name] = t.clone()
        out["kv"] = torch.stack(
            [(b.words if isinstance(b, PageMajor) else b).sum(dtype=torch.int64) for b in self.bufs]
        )
        return out

    def flagged(self) -> set[str]:
        return {v.request for v in self.violations if v.request is not None}

"""The compiled CPU backend: ``_guard_cpu`` (``csrc/guard_cpu.c``) behind the kernel interface.

The C kernels read and write the ledger's tensors in place by address, so the hot path
dispatches no torch operator: one C call each for the allocation event, the step check, its
transitions and the seal. Each step's outputs live in one of two reusable workspaces (the overlap
scheduler checks step N + 1 before it reads step N's verdict); ``StepCheck`` fields are torch
views of them, made only when something reads them (a violation, a test).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from . import _guard_cpu as C  # built by setup.sh / pip install (setuptools ext-modules)
from .guard_ref import CheckParams, StepCheck, StepInputs
from .guard_state import PageArrays, RowArrays
from .kv_checksum_ref import KvBuffer, _row_word_views, word_constants

_I64 = torch.int64


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _ok(t: torch.Tensor) -> bool:
    return t.dtype is _I64 and t.is_cpu and t.is_contiguous()  # (cheapest torch getters)


def _need(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    if not t.is_cpu:
        raise ValueError(f"{what} must be on the CPU for the compiled CPU kernels")
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


class _Context:
    """The addresses of one pool's ledger, rows and KV buffers, packed once for the C side."""

    def __init__(self, P: PageArrays, R: RowArrays, buffers: Sequence[KvBuffer]):
        self.P, self.R = P, R
        self.buffers = buffers
        views = _row_word_views(buffers) if buffers else []
        self.wmax = max((v.shape[-1] for v in views), default=0)
        consts = word_constants(len(views), max(self.wmax, 1))
        self.lo = (consts & 0xFFFFFFFF).to(torch.int64).to(torch.int32).contiguous()  # bits kept
        self.hi = ((consts >> 32) & 0xFFFFFFFF).to(torch.int64).to(torch.int32).contiguous()
        desc = []
        for v in views:  # (base, slot stride, page stride (0: slot-major), slots per page, words)
            if v.dim() == 2:
                desc += [v.data_ptr(), v.stride(0) * 4, 0, 1, v.shape[1]]
            else:
                desc += [v.data_ptr(), v.stride(1) * 4, v.stride(0) * 4, v.shape[1], v.shape[2]]
        self.desc = array("q", desc or [0])
        pa = [
            P.state,
            P.prior,
            P.fill,
            P.owner,
            P.owner_gen,
            P.lpage,
            P.epoch,
            P.chain,
            P.digest,
            P.history,
        ]
        ra = [R.gen, R.n_pages, R.agg, R.chain_len, R.chain_tail]
        for t in pa + ra:
            assert t.is_contiguous() and t.device.type == "cpu"
        addr = self.desc.buffer_info()[0]
        self.ctx = array(
            "q",
            [t.data_ptr() for t in pa]
            + [P.state.numel()]
            + [t.data_ptr() for t in ra]
            + [addr, len(views), self.lo.data_ptr(), self.hi.data_ptr(), self.wmax]
            + [R.gen.numel()],
        )
        self.addr = self.ctx.buffer_info()[0]

    def matches(self, P: PageArrays, R: RowArrays, buffers: Sequence[KvBuffer]) -> bool:
        return P is self.P and R is self.R and buffers is self.buffers


class _Workspace:
    """Reusable outputs of one step check, grown when a step is larger than any before."""

    def __init__(self, num_pages: int):
        self.taint = torch.zeros(num_pages, dtype=torch.bool)
        self.reclaim = torch.zeros(num_pages, dtype=torch.bool)
        self.marks = torch.zeros(1 + 1024, dtype=_I64)
        self.b = self.n = self.s = -1
        self._grow(64, 256, 1024)

    def _grow(self, b: int, n: int, s: int) -> None:
        if b > self.b:
            self.b = b
            self.kinds = torch.zeros(b, dtype=_I64)
            self.n_pages = torch.zeros(b, dtype=torch.int32)
            self.agg = torch.zeros(b, dtype=_I64)
            self.chain_len = torch.zeros(b, dtype=torch.int32)
            self.chain_tail = torch.zeros(b, dtype=_I64)
        if n > self.n:
            self.n = n
            self.targets = torch.zeros(n, dtype=_I64)
            self.write_ok = torch.zeros(n, dtype=torch.bool)
            self.claim = torch.zeros(n, dtype=torch.bool)
            self.write_chain = torch.zeros(n, dtype=_I64)
        if s > self.s:
            self.s = s
            self.scratch = torch.zeros(s, dtype=_I64)
        outs = [
            self.kinds,
            self.taint,
            self.reclaim,
            self.targets,
            self.write_ok,
            self.claim,
            self.write_chain,
            self.n_pages,
            self.agg,
            self.chain_len,
            self.chain_tail,
            self.marks,
        ]
        self.out = array(
            "q", [t.data_ptr() for t in outs] + [self.marks.numel() - 1, self.scratch.data_ptr()]
        )
        self.out_addr = self.out.buffer_info()[0]

    def nbytes(self) -> int:
        ts = [self.taint, self.reclaim, self.marks, self.kinds, self.n_pages, self.agg,
              self.chain_len, self.chain_tail, self.targets, self.write_ok, self.claim,
              self.write_chain, self.scratch]  # fmt: skip
        return sum(t.numel() * t.element_size() for t in ts)

    def fit(self, b: int, n: int, t: int) -> None:
        s = 2 * t + b + 1
        if b > self.b or n > self.n or s > self.s:
            self._grow(
                max(b, 2 * self.b) if b > self.b else self.b,
                max(n, 2 * self.n) if n > self.n else self.n,
                max(s, 2 * self.s) if s > self.s else self.s,
            )


class CpuStepCheck(StepCheck):
    """A ``StepCheck`` whose tensors are views of a workspace (valid until the workspace is
    reused two steps later) and whose flags came back from C as host values."""

    def __init__(self, ws: _Workspace, b: int, n: int, flags: tuple[int, int, int, int]):
        self.ws, self._b, self._n = ws, b, n
        self._keep: tuple[object, ...] = ()  # the step's input tensors, alive for apply and seal
        self._flags = (bool(flags[0]), bool(flags[1]), bool(flags[2]))
        self._hashed = int(flags[3])
        self.sealed_hashed = 0

    # the reference's fields, as views (slow path only)
    kinds = property(lambda s: s.ws.kinds[: s._b])
    taint = property(lambda s: s.ws.taint)
    reclaim = property(lambda s: s.ws.reclaim)
    targets = property(lambda s: s.ws.targets[: s._n])
    write_ok = property(lambda s: s.ws.write_ok[: s._n])
    claim = property(lambda s: s.ws.claim[: s._n])
    write_chain = property(lambda s: s.ws.write_chain[: s._n])
    n_pages = property(lambda s: s.ws.n_pages[: s._b])
    agg = property(lambda s: s.ws.agg[: s._b])
    chain_len = property(lambda s: s.ws.chain_len[: s._b])
    chain_tail = property(lambda s: s.ws.chain_tail[: s._b])
    hashed = property(lambda s: torch.tensor([s._hashed]))

    def flags(self) -> tuple[bool, bool, bool]:
        return self._flags

    def tokens_hashed(self) -> int:
        return self._hashed + self.sealed_hashed

    def marked_pages(self) -> torch.Tensor:
        marks = self.ws.marks
        n = int(marks[0])
        if n > marks.numel() - 1:  # more than the list holds: the reference's scan
            return super().marked_pages()
        pages = marks[1 : 1 + n]
        ws = self.ws
        return pages[ws.taint[pages] | ws.reclaim[pages]]


class CpuKernels:
    name = "cpu"

    def __init__(self) -> None:
        self._ctx: _Context | None = None
        self._ws: list[_Workspace] = []
        self._turn = 0

    def bind(self, P: PageArrays, R: RowArrays, buffers: Sequence[KvBuffer]) -> None:
        self._ctx = _Context(P, R, buffers)
        self._ws = [_Workspace(P.state.numel()), _Workspace(P.state.numel())]

    def workspace_bytes(self) -> int:
        """Host bytes of the two step workspaces (4 per page, plus per-step arrays)."""
        return sum(w.nbytes() for w in self._ws)

    def _context(self, P: PageArrays, R: RowArrays, buffers: Sequence[KvBuffer]) -> _Context:
        if self._ctx is None or not self._ctx.matches(P, R, buffers):
            self.bind(P, R, buffers)
        assert self._ctx is not None
        return self._ctx

    def check_step(
        self,
        P: PageArrays,
        R: RowArrays,
        x: StepInputs,
        cp: CheckParams,
        buffers: Sequence[KvBuffer],
    ) -> StepCheck:
        ctx = self._context(P, R, buffers)
        B, N, T = x.rows.numel(), x.write_slots.numel(), x.read_pages_total
        if N >= 1 << 24:
            raise ValueError("more than 2**24 - 1 KV writes in one step")
        ws = self._ws[self._turn]
        self._turn ^= 1
        ws.fit(max(B, 1), max(N, 1), T)
        rows, wpos, wtok = x.rows, x.write_pos, x.write_tokens
        if not (_ok(rows) and _ok(wpos) and _ok(wtok)):  # SGLang's own tensors pass as they are
            rows, wpos, wtok = (_need(t, _I64, "step inputs") for t in (rows, wpos, wtok))
        host_lens = array("q", x.prefix_lens_host)
        wslots = x.write_slots
        if not _ok(wslots):
            raise ValueError(
                "write slots must be a contiguous int64 CPU tensor (the firewall writes it)"
            )
        wb = None if x.write_batch is None else _need(x.write_batch, _I64, "write batch")
        pt = x.page_table
        if pt.dtype != torch.int32 or pt.stride(1) != 1:
            raise ValueError("page table must be int32 with contiguous rows")
        seeds = None if x.seeds is None else _need(x.seeds, _I64, "seeds")
        ptok = None if x.prefix_tokens is None else _need(x.prefix_tokens, _I64, "prefix tokens")
        flags = C.check_step(
            ctx.addr, x.step, B, rows.data_ptr(), host_lens.buffer_info()[0], N, wslots.data_ptr(),
            _ptr(wb), wpos.data_ptr(), wtok.data_ptr(), pt.data_ptr(), pt.stride(0), pt.shape[1],
            _ptr(seeds), 0 if ptok is None else (ptok.data_ptr() or 1), cp.page_size,
            int(cp.checksums), int(cp.verify_all), cp.window_start, cp.window_pages,
            cp.sweep_start, cp.sweep_pages, cp.pad_slot, ws.out_addr,
        )  # fmt: skip
        check = CpuStepCheck(ws, B, N, flags)
        check._keep = (rows, wb, wpos, wtok, seeds, ptok, host_lens)  # alive for apply and seal
        return check

    def apply_step(
        self, P: PageArrays, R: RowArrays, x: StepInputs, c: StepCheck, page_size: int
    ) -> None:
        assert isinstance(c, CpuStepCheck) and self._ctx is not None
        ctx = self._ctx
        rows, wb, wpos = c._keep[0], c._keep[1], c._keep[2]
        assert isinstance(rows, torch.Tensor) and isinstance(wpos, torch.Tensor)
        assert wb is None or isinstance(wb, torch.Tensor)
        C.apply_step(ctx.addr, x.step, c._b, rows.data_ptr(), c._n, _ptr(wb), wpos.data_ptr(),
                     page_size, c.ws.out_addr)  # fmt: skip

    def seal_step(
        self,
        P: PageArrays,
        x: StepInputs,
        c: StepCheck,
        buffers: Sequence[KvBuffer],
        page_size: int,
        checksums: bool,
        written: torch.Tensor | None = None,
    ) -> None:
        assert isinstance(c, CpuStepCheck)
        ctx = self._ctx
        assert ctx is not None
        wpos = c._keep[2]
        assert isinstance(wpos, torch.Tensor)
        w_addr = 0
        if written is not None and checksums:
            written = _need(written, _I64, "written")
            if written.numel() != c._n:
                raise ValueError(f"seal_step: {written.numel()} writer sums for {c._n} writes")
            w_addr = written.data_ptr()
        c.sealed_hashed = C.seal_step(
            ctx.addr, c._n, wpos.data_ptr(), page_size, int(checksums), c.ws.out_addr, w_addr
        )
        # the count is read through check.tokens_hashed()

    def alloc_pages(self, P: PageArrays, slots: torch.Tensor, page_size: int, step: int) -> None:
        ctx = self._ctx_for(P)
        s = _need(slots, _I64, "slots")
        C.alloc_pages(ctx.addr, s.data_ptr(), s.numel(), page_size, step)

    def release_pages(
        self, P: PageArrays, pages: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self._ctx_for(P)
        p = _need(pages, _I64, "pages")
        keep = torch.empty(p.numel(), dtype=torch.bool)
        double = torch.empty(p.numel(), dtype=torch.bool)
        C.release_pages(ctx.addr, p.data_ptr(), p.numel(), step, keep.data_ptr(), double.data_ptr())
        return keep, double

    # -- the per-request transitions (backend.PER_REQUEST) ---------------------------------------
    def share_pages(
        self, P: PageArrays, R: RowArrays, pages: torch.Tensor, row: int, step: int
    ) -> None:
        ctx = self._ctx_for(P)
        p = _need(pages, _I64, "pages")
        C.share_pages(ctx.addr, p.data_ptr(), p.numel(), row, step)

    def attribute_free(
        self, P: PageArrays, R: RowArrays, pages: torch.Tensor, row: int
    ) -> torch.Tensor:
        ctx = self._ctx_for(P)
        p = _need(pages, _I64, "pages")
        keep = torch.empty(p.numel(), dtype=torch.bool)
        C.attribute_free(ctx.addr, p.data_ptr(), p.numel(), row, keep.data_ptr())
        return keep

    def rebind_row(self, P: PageArrays, R: RowArrays, row: int, first_lpage: int,
                   old_pages: torch.Tensor, new_pages: torch.Tensor, page_size: int, step: int) -> None:  # fmt: skip
        ctx = self._ctx_for(P)
        o, n = _need(old_pages, _I64, "pages"), _need(new_pages, _I64, "pages")
        C.rebind_row(ctx.addr, row, first_lpage, o.data_ptr(), n.data_ptr(), min(o.numel(), n.numel()),
                     page_size, step)  # fmt: skip

    def reset_rows(self, R: RowArrays, rows: torch.Tensor) -> None:
        assert self._ctx is not None and self._ctx.R is R
        r = _need(rows, _I64, "rows")
        C.reset_rows(self._ctx.addr, r.data_ptr(), r.numel())

    def adoptable(self, P: PageArrays, heads: torch.Tensor, tokens: list[int], seed: int,
                  page_size: int) -> bool:  # fmt: skip
        ctx = self._ctx_for(P)
        h = _need(heads, _I64, "slots")
        t = array("q", tokens)
        return bool(
            C.adoptable(
                ctx.addr, h.data_ptr(), h.numel(), t.buffer_info()[0], len(t), seed, page_size
            )
        )

    def token_digests(
        self, buffers: Sequence[KvBuffer], slots: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The checksum alone (benchmarks and the equivalence test)."""
        ctx = _Context(PageArrays.empty(1, "cpu"), RowArrays.empty(1, "cpu"), buffers)
        s, p = _need(slots, _I64, "slots"), _need(positions, _I64, "positions")
        out = torch.empty(s.numel(), dtype=_I64)
        C.token_digests(ctx.addr, s.data_ptr(), p.data_ptr(), s.numel(), out.data_ptr())
        return out

    def _ctx_for(self, P: PageArrays) -> _Context:
        if self._ctx is None or self._ctx.P is not P:
            raise RuntimeError("CpuKernels.bind(pages, rows, buffers) must come first")
        return self._ctx

"""The Triton backend: the guard's step check, transitions and seal as a few fused GPU kernels,
bit-identical to the torch reference (``guard_ref``, the specification; every rule here is a
line there) and written so that no device value is read on the host before the verdict.

This module is the backend (``TritonKernels``): the workspaces, the verdict's host view and the
launches. The kernels live beside it, by concern (``docs/design.md``, "Which file computes what"):

* ``triton_step_check``: ``_prefix_kernel``, ``_read_kernel``, ``_write_kernel`` (``check_step``);
* ``triton_seal``: ``_hash_kernel``, ``_seal_kernel``, ``_finish_digests_kernel`` (the checksum,
  ``seal_step``, ``token_digests``) and ``_KvTables``, the pool's buffers laid out for them;
* ``triton_transitions``: ``_alloc_kernel``, ``_release_scatter_kernel``, ``_release_kernel``,
  ``_apply_kernel`` (``alloc_pages``, ``release_pages``, ``apply_step``);
* ``triton_common``: the metadata layout, constants and jitted helpers they all share.

Launches per step (each one grid; sizes come from host ints already in ``StepInputs``):

* ``on_alloc``: one (``_alloc_kernel``: the first arrival at a page in the call applies it, by
  an atomic exchange of a per-call stamp, so a page repeated in one call is handed out once).
* ``check_step``: one host-to-device copy of the step's small metadata (prefix lengths, entry and
  token offsets, zeroed accumulators), then
  - ``_prefix_kernel`` (extend steps only): each request's own token chain over its prefix, the
    expected chain of every page it would adopt;
  - ``_hash_kernel`` (checksum modes, when pages are hashed this step): partial KV sums of every
    hashed token, split over buffer groups for parallelism (wrapping sums, so the split is exact);
  - ``_read_kernel``: one program per block of read-page entries (the batch's entries laid end to
    end; a program finds its entries' requests by binary search over their offsets), plus the
    per-request row checks (decode), the claim scatter (first claim of a page: atomic min of the
    write index), the sweep's verdicts and the clearing of the workspace two steps old. Per-
    request sums (page tags) are reduced in the program and added at segment ends.
  - ``_write_kernel``: one program per request: its writes' checks, claims, chains and the
    firewall (in place on the engine's write slots), the row-tag comparison, then (rare paths)
    readers of pages found bad, taint of a flagged request's landed writes, reclaim.
* ``apply_step``: one (``_apply_kernel``: claims, the last landing write's page chain, rows).
* ``seal_step``: one in tags mode (``_seal_kernel``: fill), two with checksums (``_hash_kernel``
  over the landed writes, then ``_seal_kernel`` adds their digests).
* ``release_pages`` (not per step): two (the first occurrence of a page is its lowest index: an
  atomic min, then the transitions).

A decode step launches 4 kernels in tags mode and 6 with checksums (one more on a step that
allocates a page), plus the one copy of its metadata: with the guard's own operators around
them (its epoch snapshot: 8) that is 13-15 dispatches in tags and 15-17 in sampled and paranoid,
at any batch size and context (``tests/test_guard_triton.py``). The verdict's flags (any request
flagged, any page tainted, any to reclaim, refused, tokens hashed) are written by the kernels
straight into pinned host memory where the device can map it (checked once at bind; otherwise
one small copy when read), so ``StepCheck.flags()`` after the engine's own sync costs nothing.

State the backend keeps (``workspace_bytes``): 25 bytes per pool page, 4 int32 scratch words
(claim winner, last landing write, highest landed offset: back at rest after every step; the
stamp of the page's last hand-out call) and, in each of three step workspaces, 3 flag bytes
(taint, reclaim, read taint); plus per-step arrays (metadata, write outputs, hash scratch) grown
to the largest step seen. Three workspaces, not two: the overlap scheduler checks step N + 1
before it reads step N's verdict, and a workspace is cleared during the step before its next use,
inside the read kernel, where no launch is added.

Out-of-range input (a row outside the table, a page-table slot or write outside the pool, a
negative position, a write batch out of order): the reference refuses the step with ValueError
before reading anything. Here the read kernels find it (every load is masked, so nothing outside
the pool or table is read), the write kernel sends all the step's writes to the padding slot,
apply and seal change nothing, and the ValueError is raised when the verdict is read (on the CPU
in the check, as the reference; on a GPU at resolve, after the engine's sync).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .guard_ref import CheckParams, StepCheck, StepInputs
from .guard_state import PageArrays, RowArrays
from .kv_checksum_ref import KvBuffer
from .triton_common import _BIG32, _I32, _I64, HDR, MCAP, OREC, REC, _cdiv, _pow2, _probe_kernel
from .triton_common import _interpreting as _interpreting  # tests patch guard_triton._interpreting
from .triton_seal import _finish_digests_kernel, _hash_kernel, _seal_kernel
from .triton_seal import _KvTables as _KvTables
from .triton_step_check import _prefix_kernel, _read_kernel, _write_kernel
from .triton_transitions import (
    _alloc_kernel,
    _apply_kernel,
    _release_kernel,
    _release_scatter_kernel,
)


class _Workspace:
    """One step's outputs and inputs (reused three steps later)."""

    def __init__(self, num_pages: int, device: torch.device, zero_copy: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.taint = torch.zeros(num_pages, dtype=torch.bool, device=device)
        self.reclaim = torch.zeros(num_pages, dtype=torch.bool, device=device)
        self.taint_u8 = self.taint.view(torch.uint8)
        self.reclaim_u8 = self.reclaim.view(torch.uint8)
        self.rtaint = torch.zeros(num_pages, dtype=torch.uint8, device=device)
        self.marks = torch.zeros(1 + MCAP, dtype=_I64, device=device)
        self.zero_copy = zero_copy
        pin = self.cuda
        self.flags_host = torch.zeros(5, dtype=_I64, pin_memory=pin)
        self.flags_np = self.flags_host.numpy()
        self.event: Any = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]
        self.flags_event: Any = torch.cuda.Event() if self.cuda else None  # type: ignore[no-untyped-call]
        self.b = self.n = -1
        self._grow(64, 256)

    def _grow(self, b: int, n: int) -> None:
        if b > self.b:
            self.b = b
            words = HDR + (b + 1) * REC
            self.meta = torch.zeros(words, dtype=_I64, device=self.device)
            if self.cuda:
                self.meta_host = torch.zeros(words, dtype=_I64, pin_memory=True)
            else:
                self.meta_host = self.meta
            self.meta_np = self.meta_host.numpy()
            # copies of power-of-two prefixes, made once: the step's copy is one dispatch
            self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            size = 1
            while True:
                s = min(size, words)
                self.copies[s] = (self.meta[:s], self.meta_host[:s])
                if s == words:
                    break
                size *= 2
            self.mout = torch.zeros((b + 1) * OREC, dtype=_I64, device=self.device)
            self.hashed_view = self.meta[0:1]
            self.seal_view = self.meta[1:2]
            self.flags_dev = self.meta[8:13]
        if n > self.n:
            self.n = n
            self.targets = torch.zeros(n, dtype=_I64, device=self.device)
            self.wchain = torch.zeros(n, dtype=_I64, device=self.device)
            self.wflags = torch.zeros(n, dtype=torch.int8, device=self.device)

    def fit(self, b: int, n: int) -> None:
        if b > self.b or n > self.n:
            self._grow(max(b, 2 * self.b) if b > self.b else self.b,
                       max(n, 2 * self.n) if n > self.n else self.n)  # fmt: skip

    @property
    def flags_out(self) -> torch.Tensor:
        return self.flags_host if self.zero_copy else self.flags_dev

    def nbytes(self) -> int:
        ts = [self.taint, self.reclaim, self.rtaint, self.marks, self.meta, self.mout,
              self.targets, self.wchain, self.wflags]  # fmt: skip
        return sum(t.numel() * t.element_size() for t in ts)


class TritonStepCheck(StepCheck):
    """A ``StepCheck`` whose tensors live in a workspace (valid until it is reused three checks
    later) and whose flags the kernels wrote to host memory."""

    def __init__(self, ws: _Workspace, b: int, n: int):
        self.ws, self._b, self._n = ws, b, n
        self._host: tuple[bool, bool, bool, int] | None = None
        self.applied = False
        self.launch: Any = None  # what apply_step and seal_step need (set by check_step)

    # the reference's fields, as views (the verdict's slow path; taint and reclaim are whole)
    taint = property(lambda s: s.ws.taint)
    reclaim = property(lambda s: s.ws.reclaim)
    hashed = property(lambda s: s.ws.hashed_view)

    def _recs(self, col: int) -> torch.Tensor:
        return self.ws.meta[HDR : HDR + self._b * REC].view(self._b, REC)[:, col]

    def _outs(self, col: int) -> torch.Tensor:
        return self.ws.mout[: self._b * OREC].view(self._b, OREC)[:, col]

    kinds = property(lambda s: s._recs(3))
    targets = property(lambda s: s.ws.targets[: s._n])
    write_ok = property(lambda s: (s.ws.wflags[: s._n] & 1) != 0)
    claim = property(lambda s: (s.ws.wflags[: s._n] & 2) != 0)
    write_chain = property(lambda s: s.ws.wchain[: s._n])
    n_pages = property(lambda s: s._outs(0).to(_I32))
    chain_len = property(lambda s: s._outs(1).to(_I32))
    chain_tail = property(lambda s: s._outs(2))
    agg = property(lambda s: s._outs(5))

    def _read(self) -> tuple[bool, bool, bool, int]:
        if self._host is not None:
            return self._host
        ws = self.ws
        if ws.cuda:
            if self.applied:
                ws.flags_event.synchronize()
            else:
                torch.cuda.current_stream(ws.device).synchronize()
            if not ws.zero_copy:
                ws.flags_host.copy_(ws.flags_dev)
        f = ws.flags_np
        if f[4]:
            raise ValueError(
                "kvguard: a step index is out of range (a request's row, a slot its page table "
                "names outside the pool, or a write out of range): refused on the device, "
                "nothing outside the pool read or written, every write sent to the padding slot"
            )
        out = (bool(f[0]), bool(f[1]), bool(f[2]), int(f[3]))
        if self.applied:  # final: apply wrote the tokens hashed
            self._host = out
        return out

    def flags(self) -> tuple[bool, bool, bool]:
        """(any request flagged, any page tainted, any page to reclaim), after the engine's sync:
        host memory the kernels wrote (no dispatch), or one small copy where the device cannot
        write host memory. A step the kernels refused (an index outside the pool or the table)
        raises ValueError here, as the reference's check does before it reads anything."""
        f = self._read()
        return f[0], f[1], f[2]

    def tokens_hashed(self) -> int:
        return self._read()[3]


@dataclass(slots=True)
class _Step:
    """What check_step hands to apply_step and seal_step (kept alive until the seal)."""

    B: int
    N: int
    rows: torch.Tensor
    wbatch: torch.Tensor
    wpos: torch.Tensor
    has_wb: bool
    step: int


class TritonKernels:
    name = "triton"

    def __init__(
        self,
        buffer_groups: int | None = None,
        reverse_programs: bool = False,
        block_tokens: int = 32,
    ):
        """``buffer_groups``: split each token's KV sum over this many programs (default: enough
        programs to fill the device). ``block_tokens``: tokens per checksum program (a power of
        two; a tuning knob). ``reverse_programs``: run every grid's programs in reverse order
        (tests: the interpreter runs programs in order, so a result that depends on the order
        shows up as a difference between the two runs)."""
        if block_tokens < 1 or block_tokens & (block_tokens - 1):
            raise ValueError("block_tokens must be a power of two")
        self.buffer_groups = buffer_groups
        self.block_tokens = block_tokens
        self.rev = int(reverse_programs)
        self.launches = 0  # kernels enqueued since creation (bench.step counts dispatches)
        self._P: PageArrays | None = None
        self._R: RowArrays | None = None
        self._buffers: Sequence[KvBuffer] | None = None
        self._ws: list[_Workspace] = []
        self._turn = 0
        self._stamp = 0
        self._pending: TritonStepCheck | None = None
        self.zero_copy = False

    # -- pool ----------------------------------------------------------------------------------------
    def bind(self, P: PageArrays, R: RowArrays, buffers: Sequence[KvBuffer]) -> None:
        dev = P.state.device
        if dev.type == "cpu" and not _interpreting():
            raise ValueError("the Triton kernels need a CUDA pool (or TRITON_INTERPRET=1)")
        if P.state.numel() >= 1 << 31:
            raise ValueError("pools of 2**31 pages or more are not supported")
        for t in P.tensors() + R.tensors():
            if not t.is_contiguous() or t.device != dev:
                raise ValueError("ledger and row arrays must be contiguous on one device")
        self._P, self._R, self._buffers = P, R, buffers
        self.device = dev
        n = P.state.numel()
        self.winner = torch.full((n,), _BIG32, dtype=_I32, device=dev)
        self.last = torch.full((n,), -1, dtype=_I32, device=dev)
        self.top = torch.zeros(n, dtype=_I32, device=dev)
        self.stamps = torch.zeros(n, dtype=_I32, device=dev)
        self.inner = torch.zeros(1024, dtype=_I64, device=dev)
        self.expc = torch.zeros(1024, dtype=_I64, device=dev)
        self.kv = _KvTables(buffers, dev)
        # on the CPU (the interpreter) the kernels write host memory by construction
        self.zero_copy = dev.type != "cuda" or self._probe_zero_copy()
        self._ws = [_Workspace(n, dev, self.zero_copy) for _ in range(3)]
        self.dummy = torch.zeros(1, dtype=_I64, device=dev)
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            self.num_sms = int(props.multi_processor_count)
        else:
            self.num_sms = 1

    def _probe_zero_copy(self) -> bool:
        """Can kernels write pinned host memory directly (unified addressing)? Checked once."""
        if os.environ.get("KVGUARD_TRITON_ZERO_COPY", "1") == "0":
            return False
        try:
            probe = torch.zeros(1, dtype=_I64, pin_memory=True)
            _probe_kernel[(1,)](probe)
            torch.cuda.synchronize(self.device)
            return int(probe[0]) == 1
        except Exception:  # any refusal means: copy instead
            return False

    def workspace_bytes(self) -> int:
        """Device bytes besides the ledger and the records: 16 per page of scratch, 3 per page in
        each of three workspaces, and the per-step arrays."""
        if self._P is None:
            return 0
        ts = [self.winner, self.last, self.top, self.stamps, self.inner, self.expc]
        own = sum(t.numel() * t.element_size() for t in ts)
        return own + sum(w.nbytes() for w in self._ws)

    def _bound(
        self, P: PageArrays, R: RowArrays | None, buffers: Sequence[KvBuffer] | None
    ) -> None:
        if (
            self._P is not P
            or (R is not None and self._R is not R)
            or (buffers is not None and self._buffers is not buffers)
        ):
            if R is None or buffers is None:
                if self._P is not P:
                    raise RuntimeError("TritonKernels.bind(pages, rows, buffers) must come first")
                return
            self.bind(P, R, buffers)

    def _launch(self, kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
        kernel[grid](*args, **meta)
        self.launches += 1

    def _grow(self, name: str, n: int) -> torch.Tensor:
        t: torch.Tensor = getattr(self, name)
        if t.numel() < n:  # with headroom: the next steps (one token longer) do not grow it
            t = torch.zeros(max(2 * n, 2 * t.numel()), dtype=t.dtype, device=t.device)
            setattr(self, name, t)
        return t

    def _finish_pending(self) -> None:
        """A check whose apply or seal never came (the forward failed): put the per-page scratch
        back at rest so the next step starts clean (slow path)."""
        c = self._pending
        self._pending = None
        if c is None:
            return
        self.last.fill_(-1)
        self.top.zero_()
        self.winner.fill_(_BIG32)
        self.inner.zero_()

    # -- the step check -------------------------------------------------------------------------------
    def check_step(
        self,
        P: PageArrays,
        R: RowArrays,
        x: StepInputs,
        cp: CheckParams,
        buffers: Sequence[KvBuffer],
    ) -> StepCheck:
        self._bound(P, R, buffers)
        self._finish_pending()
        ps = cp.page_size
        B, N, T = x.rows.numel(), x.write_slots.numel(), x.read_pages_total
        num_pages = P.state.numel()
        if N >= 1 << 24:
            raise ValueError("more than 2**24 - 1 KV writes in one step")
        ws_ = x.write_slots
        if ws_.dim() != 1 or not ws_.is_contiguous() or ws_.dtype not in (_I64, _I32):
            raise ValueError(
                "write slots must be a contiguous int64 tensor (the firewall writes it)"
            )
        pt = x.page_table
        if pt.dim() != 2 or pt.stride(1) != 1 or pt.dtype not in (_I32, _I64):
            raise ValueError(
                "page table must be an int32 [rows, positions] tensor, rows contiguous"
            )
        # what the host knows is checked here; indices on the device are checked by the kernels
        if any(n < 0 or n > pt.shape[1] for n in x.prefix_lens_host):
            raise ValueError("kvguard: a request's prefix is out of range")
        if x.write_batch is None and N > B:
            raise ValueError("kvguard: a write is out of range (more writes than requests)")
        if x.prefix_tokens is not None and x.prefix_tokens.numel() < x.read_tokens_total:
            raise ValueError("kvguard: fewer prefix tokens than positions read")
        rows, wpos, wtok = (
            x.rows.contiguous(),
            x.write_pos.contiguous(),
            x.write_tokens.contiguous(),
        )
        has_wb = x.write_batch is not None
        wbatch = x.write_batch.contiguous() if x.write_batch is not None else self.dummy
        has_prefix = x.prefix_tokens is not None
        ptok = x.prefix_tokens.contiguous() if x.prefix_tokens is not None else self.dummy
        has_seeds = x.seeds is not None
        seeds = x.seeds.contiguous() if x.seeds is not None else self.dummy

        t = self._turn
        self._turn += 1
        ws = self._ws[t % 3]
        nxt = self._ws[(t + 1) % 3]
        ws.fit(B, max(N, 1))
        self._fill_meta(ws, x, ps, B, T, has_prefix)

        # what this step hashes (read entries, resting pages)
        verify_all, checksums = cp.verify_all, cp.checksums
        hash_all = verify_all or (checksums and has_prefix)
        window_n = min(cp.window_pages, T) if (cp.window_pages and T and not verify_all) else 0
        n_jobs_e = T if hash_all else window_n
        sweep_n = min(cp.sweep_pages, num_pages) if cp.sweep_pages else 0
        hashing = self.kv.nbuf > 0 and (n_jobs_e > 0 or sweep_n > 0)
        if not hashing:
            n_jobs_e = sweep_n = 0
        nsteps_b = max(1, (B + 1).bit_length())
        nsteps_n = max(1, (N + 1).bit_length())
        psb = min(_pow2(ps), 64)
        be = max(16, min(256, 4096 // psb))
        common = dict(PS=ps)
        rev = self.rev

        if has_prefix and B:
            expc = self._grow("expc", max(T, 1))
            self._launch(_prefix_kernel, (B,), ws.meta, ws.mout, rows, wbatch, R.n_pages,
                         R.chain_len, R.chain_tail, seeds, ptok, expc, B, N, R.gen.numel(), nsteps_n, rev,
                         HAS_WB=has_wb, HAS_SEEDS=has_seeds, BQ=256, **common)  # fmt: skip
        expc = self.expc
        if hashing:
            units = (n_jobs_e + sweep_n) * ps
            inner = self._grow("inner", units)
            bt = self.block_tokens
            nprog = _cdiv(units, bt)
            G = self._groups(nprog)
            self._launch(_hash_kernel, (nprog, G), self.kv.base, self.kv.tab, self.kv.consts,
                         self.kv.wmax, self.kv.nbuf, inner, units, G, rev, ws.meta, rows, pt,
                         pt.stride(0), R.n_pages, P.state, P.fill, B, max(T, 1), num_pages,
                         R.gen.numel(), cp.window_start, window_n, n_jobs_e, cp.sweep_start, nsteps_b,
                         ws.wflags, ws.targets, SEAL=False, HASH_ALL=hash_all,
                         HAS_PREFIX=has_prefix, CHECKSUMS=checksums, VERIFY_ALL=verify_all,
                         BT=bt, **self.kv.meta, **common)  # fmt: skip
        inner = self.inner
        bw, br, bs = 128, 128, 64
        n_entry = _cdiv(T, be)
        n_req = 0 if has_prefix else _cdiv(B, br)
        n_claim = _cdiv(N, bw)
        n_sweep = _cdiv(sweep_n, bs) if sweep_n else 0
        grid = n_entry + n_req + n_claim + n_sweep + 1
        self._launch(_read_kernel, (grid,), P.state, P.prior, P.fill, P.owner, P.owner_gen,
                     P.lpage, P.epoch, P.chain, P.digest, R.gen, R.n_pages, R.chain_len,
                     R.chain_tail, rows, ws_, wbatch, wpos, pt, pt.stride(0), seeds, ws.meta,
                     ws.mout, expc, inner, self.winner, ws.taint_u8, ws.rtaint, ws.marks,
                     ws.flags_out, nxt.taint_u8, nxt.reclaim_u8, nxt.rtaint, nxt.marks, B, N,
                     T, num_pages, R.gen.numel(), cp.window_start, window_n,
                     cp.sweep_start, sweep_n, n_jobs_e, nsteps_b, nsteps_n, n_entry, n_req,
                     n_claim, n_sweep, rev, PSB=psb, BE=be, BR=br, BW=bw, BS=bs, MCAP=MCAP,
                     HAS_WB=has_wb, HAS_PREFIX=has_prefix, HAS_SEEDS=has_seeds, HASH=hashing,
                     HASH_ALL=hash_all, CHECKSUMS=checksums, VERIFY_ALL=verify_all,
                     **common)  # fmt: skip
        if B or N:  # with writes and no request the step is refused: one program firewalls them
            self._launch(_write_kernel, (max(B, 1),), P.state, P.prior, P.fill, P.owner, P.owner_gen,
                         P.lpage, R.gen, R.agg, rows, ws_, wbatch, wpos, wtok, pt, pt.stride(0),
                         pt.shape[1], seeds, ws.meta, ws.mout, self.winner, self.last, self.top,
                         ws.targets, ws.wchain, ws.wflags, ws.taint_u8, ws.reclaim_u8,
                         ws.rtaint, ws.marks, ws.flags_out, B, N, num_pages, cp.pad_slot, rev,
                         BE=be, BW=bw, MCAP=MCAP, HAS_WB=has_wb, HAS_SEEDS=has_seeds,
                         CHECKSUMS=checksums, **common)  # fmt: skip
        check = TritonStepCheck(ws, B, N)
        check.launch = _Step(B, N, rows, wbatch, wpos, has_wb, x.step)
        self._pending = check
        return check

    def _groups(self, nprog: int) -> int:
        if self.buffer_groups is not None:
            return max(1, min(self.buffer_groups, max(self.kv.nbuf, 1)))
        want = 4 * self.num_sms  # enough programs for every multiprocessor
        return max(1, min(self.kv.nbuf, _cdiv(want, max(nprog, 1))))

    def _fill_meta(self, ws: _Workspace, x: StepInputs, ps: int, B: int, T: int,
                   has_prefix: bool) -> None:  # fmt: skip
        """The step's host-side inputs and zeroed accumulators, in one copy to the device."""
        if ws.cuda and not ws.event.query():  # its copy three steps ago still running
            ws.event.synchronize()
        lens = np.asarray(x.prefix_lens_host, dtype=np.int64)
        if lens.shape != (B,):
            raise ValueError("prefix_lens_host must list one length per request")
        m = ws.meta_np
        m[:HDR] = 0
        recs = m[HDR : HDR + (B + 1) * REC].reshape(B + 1, REC)
        recs[:B, 0] = lens
        recs[B, 0] = 0
        recs[0, 1] = 0
        np.cumsum((lens + ps - 1) // ps, out=recs[1:, 1])
        if int(recs[B, 1]) != T:
            raise ValueError(f"read_pages_total {T} != sum of ceil(prefix_len / page size)")
        if has_prefix:
            recs[0, 2] = 0
            np.cumsum(lens[:-1], out=recs[1:B, 2])
        recs[:, 3:] = 0
        ws.flags_np[:] = 0
        if ws.cuda:
            used = HDR + (B + 1) * REC
            size = min(_pow2(used), HDR + (ws.b + 1) * REC)
            dst, src = ws.copies[size]
            dst.copy_(src, non_blocking=True)
            ws.event.record()

    # -- transitions ----------------------------------------------------------------------------------
    def apply_step(
        self, P: PageArrays, R: RowArrays, x: StepInputs, c: StepCheck, page_size: int
    ) -> None:
        assert isinstance(c, TritonStepCheck) and c.launch is not None
        s: _Step = c.launch
        ws = c.ws
        bw = 128
        n_wprog = _cdiv(s.N, bw)
        grid = max(1, n_wprog + s.B)
        self._launch(_apply_kernel, (grid,), P.state, P.prior, P.fill, P.owner, P.owner_gen,
                     P.lpage, P.epoch, P.chain, P.digest, P.history, R.gen, R.n_pages, R.agg,
                     R.chain_len, R.chain_tail, s.rows, s.wbatch, s.wpos, ws.meta, ws.mout,
                     self.winner, self.last, ws.targets, ws.wchain, ws.wflags, ws.flags_out,
                     s.B, s.N, s.step, n_wprog, self.rev, PS=page_size, BW=bw,
                     HAS_WB=s.has_wb)  # fmt: skip
        c.applied = True
        if ws.cuda:
            ws.flags_event.record()

    def seal_step(
        self,
        P: PageArrays,
        x: StepInputs,
        c: StepCheck,
        buffers: Sequence[KvBuffer],
        page_size: int,
        checksums: bool,
        written: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert isinstance(c, TritonStepCheck) and c.launch is not None
        s: _Step = c.launch
        ws = c.ws
        N = s.N
        if self._pending is c:
            self._pending = None
        if N == 0:
            return ws.seal_view
        checksums = checksums and self.kv.nbuf > 0
        if checksums and written is not None:  # the writer's sums: nothing read from the pool
            self._grow("inner", N)[:N].copy_(written)
        elif checksums:
            inner = self._grow("inner", N)
            bt = self.block_tokens
            nprog = _cdiv(N, bt)
            G = self._groups(nprog)
            self._launch(_hash_kernel, (nprog, G), self.kv.base, self.kv.tab, self.kv.consts,
                         self.kv.wmax, self.kv.nbuf, inner, N, G, self.rev, ws.meta, s.rows,
                         self.dummy, 0, self.dummy, P.state, P.fill, s.B, 1, P.state.numel(), 1,
                         0, 0, 0, 0, 1, ws.wflags, ws.targets, SEAL=True, HASH_ALL=False,
                         HAS_PREFIX=False, CHECKSUMS=True, VERIFY_ALL=False, BT=bt,
                         PS=page_size, **self.kv.meta)  # fmt: skip
        bw = 128
        self._launch(_seal_kernel, (_cdiv(N, bw),), P.fill, P.digest, s.wpos, self.inner,
                     self.top, ws.targets, ws.wflags, N, self.rev, PS=page_size, BW=bw,
                     CHECKSUMS=checksums)  # fmt: skip
        return ws.seal_view

    def alloc_pages(self, P: PageArrays, slots: torch.Tensor, page_size: int, step: int) -> None:
        self._bound(P, None, None)
        n = slots.numel()
        if n == 0:
            return
        self._stamp += 1
        if self._stamp >= _BIG32:  # a stamp must never repeat while a page holds it
            self.stamps.zero_()
            self._stamp = 1
        s = slots if slots.dim() == 1 and slots.is_contiguous() else slots.reshape(-1).contiguous()
        block = 256
        self._launch(_alloc_kernel, (_cdiv(n, block),), s, n, self.stamps, self._stamp,
                     P.state, P.prior, P.history, P.state.numel(), step, PS=page_size,
                     BLOCK=block)  # fmt: skip

    def release_pages(
        self, P: PageArrays, pages: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._bound(P, None, None)
        n = pages.numel()
        keep = torch.zeros(n, dtype=torch.bool, device=P.state.device)
        double = torch.zeros(n, dtype=torch.bool, device=P.state.device)
        if n == 0:
            return keep, double
        p = pages if pages.dim() == 1 and pages.is_contiguous() else pages.reshape(-1).contiguous()
        block = 256
        grid = (_cdiv(n, block),)
        num_pages = P.state.numel()
        self._launch(_release_scatter_kernel, grid, p, n, self.winner, num_pages, BLOCK=block)
        self._launch(_release_kernel, grid, p, n, self.winner, keep.view(torch.int8),
                     double.view(torch.int8), P.state, P.prior, P.history, num_pages, step,
                     BLOCK=block)  # fmt: skip
        return keep, double

    def token_digests(
        self, buffers: Sequence[KvBuffer], slots: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The checksum alone, as the seal computes it (benchmarks and tests)."""
        dev = slots.device
        kv = _KvTables(buffers, dev)
        n = slots.numel()
        out = torch.empty(n, dtype=_I64, device=dev)
        if n == 0:
            return out
        inner = torch.zeros(n, dtype=_I64, device=dev)
        flags = torch.ones(n, dtype=torch.int8, device=dev)
        targets = slots.to(_I64).contiguous()
        z = torch.zeros(1, dtype=_I64, device=dev)
        bt = self.block_tokens
        nprog = _cdiv(n, bt)
        sms = (
            torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        )
        G = self.buffer_groups or max(1, min(kv.nbuf, _cdiv(4 * sms, nprog)))
        G = max(1, min(G, max(kv.nbuf, 1)))
        _hash_kernel[(nprog, G)](kv.base, kv.tab, kv.consts, kv.wmax, kv.nbuf, inner, n, G, 0,
                                 z, z, z, 0, z, z, z, 0, 1, 1, 1, 0, 0, 0, 0, 1, flags, targets,
                                 SEAL=True, HASH_ALL=False, HAS_PREFIX=False, CHECKSUMS=True,
                                 VERIFY_ALL=False, BT=bt, PS=1, **kv.meta)  # fmt: skip
        _finish_digests_kernel[(_cdiv(n, 256),)](inner, positions.contiguous(), out, n, BLOCK=256)
        return out

"""The Triton kernels reach the reference's verdicts and leave its state, bit for bit.

Under Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``; it must be set before triton is
imported, so the interpreted cases run in one subprocess of this file and each case reports its
result): a subset of the scenario library that makes every violation kind at page sizes 1 and 16
(plus two engine bugs the library does not make: a write the page table contradicts, a token
written over its own sealed slot), decode steps as ``bench.step`` makes them (no write batch, no
seeds), hand-outs and frees with repeats, and cases run with every grid's programs in reverse
order and the KV sums split over buffer groups (the interpreter runs programs in order: a result
that depends on the order shows up as a difference). After every forward the verdicts, the
firewalled write slots, every ledger and row array, the KV bytes and the tokens hashed must equal
the torch reference's, exactly as ``test_guard_kernels.py`` compares the compiled CPU kernels;
and out-of-range steps are refused as the reference refuses them.

Without a GPU, in this process: the decode kernels compile for sm_90 (Triton lowers them to
a cubin offline), and a decode step on a GPU pool dispatches few operations, flat in batch and
context (launches counted, not run). On a machine with a GPU (``@pytest.mark.gpu``): the full
matrix compiled on CUDA pools (also reversed and split), out-of-range steps, the fused checksum.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# (scenario, mode, page size): every violation kind at page sizes 1 and 16, the clean path with the
# rolling window and sweep, hand-off and verify-all checksums, reclaim, taint of readers
_SUBSET = [
    (scenario, mode, ps)
    for ps in (1, 16)
    for scenario, mode in (
        ("clean", "sampled"),  # window and sweep on a clean pool
        ("table_swap", "tags"),  # MISPLACED_SLOT
        ("premature_free_reused", "tags"),  # WRONG_OWNER (stale holder), stale free kept
        ("premature_free_not_reused", "tags"),  # reclaim
        ("double_claim_same_step", "tags"),  # DOUBLE_ALLOCATION, first claim wins
        ("shared_write", "tags"),  # WRITE_TO_SHARED, firewall
        ("cross_tenant", "tags"),  # PREFIX_MISMATCH, tenant seeds
        ("never_written", "tags"),  # READ_UNWRITTEN
        ("position_gap", "tags"),  # ROW_MISMATCH
        ("rebind", "tags"),
        ("bit_flip_shared", "sampled"),  # CHECKSUM_MISMATCH, QUARANTINED_PAGE, readers tainted
        ("read_before_ready", "paranoid"),  # hand-off checksum, verify-all
        ("table_mismatch", "tags"),  # TABLE_MISMATCH (local scenario)
    )
] + [
    ("overwrite_sealed", "tags", 16),  # OVERWRITE (local; at page size 1 every write claims)
    ("write_unallocated", "tags", 16),
]
_ORDER_CASES = [  # programs in reverse order, KV sums over 3 buffer groups
    ("bit_flip_shared", "paranoid", 16),
    ("clean", "sampled", 1),
    ("double_claim_same_step", "tags", 16),
]
_DECODE_CASES = [("tags", 16), ("sampled", 1), ("paranoid", 16)]
# DSA pools: page-major index keys and scales beside the slot-major rows
_INDEX_CASES = [("clean", "sampled", 16), ("bit_flip_shared", "paranoid", 16)]


def _case_ids() -> list[str]:
    ids = [f"{s}-{m}-ps{p}" for s, m, p in _SUBSET]
    ids += [f"reversed-{s}-{m}-ps{p}" for s, m, p in _ORDER_CASES]
    ids += [f"decode-{m}-ps{p}" for m, p in _DECODE_CASES]
    ids += [f"index-{s}-{m}-ps{p}" for s, m, p in _INDEX_CASES]
    return ids + ["alloc-release", "out-of-range", "checksum"]


# -- scenarios the library does not make ---------------------------------------------------------
def table_mismatch(pool: Any) -> set[str]:
    """a's next token goes to the slot it was allocated, but its page table names another slot at
    that position (attention would read other KV there later): the write is refused."""
    from guard_scenarios import _decode, _two

    a, b = _two(pool)
    honest = pool.guard.before_forward

    def lying(view: Any) -> Any:
        pos = a.length
        kept = pool.table[a.row, pos].clone()
        pool.table[a.row, pos] = pool.table[b.row, 0]
        try:
            return honest(view)
        finally:
            pool.table[a.row, pos] = kept

    pool.guard.before_forward = lying
    _decode(pool, [a, b], steps=1)
    pool.guard.before_forward = honest
    _decode(pool, [b])
    return {a.rid}


def overwrite_sealed(pool: Any) -> set[str]:
    """a's forward runs again over its last position (a replayed step): its token lands on its
    own sealed slot."""
    from guard_scenarios import _decode, _two

    a, b = _two(pool)
    while (a.length - 1) % pool.ps == 0:
        _decode(pool, [a, b], steps=1)
    a.length -= 1
    pool.forward([a, b], 1)
    _decode(pool, [b])
    return {a.rid}


_LOCAL = {"table_mismatch": table_mismatch, "overwrite_sealed": overwrite_sealed}


# -- the comparison (runs in the interpreter subprocess, and compiled on CUDA) --------------------
def _trace(kernels: Any, scenario: str, mode: str, ps: int, device: str = "cpu",
           index_layers: int = 0) -> Any:  # fmt: skip
    from guard_scenarios import SCENARIOS
    from synthetic_pool import SyntheticPool

    pool = SyntheticPool(page_size=ps, num_pages=4096 // ps + 16, mode=mode, max_len=512,
                         kernels=kernels, sweep_tokens_per_step=64, device=device,
                         index_layers=index_layers)  # fmt: skip
    pool.trace = []
    snapshot = pool.snapshot

    def with_hashed(verdict: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = snapshot(verdict)
        # tokens hashed by the step: its check and its seal (every backend counts both)
        out["tokens_hashed"] = torch.tensor([verdict.check.tokens_hashed()])
        return out

    pool.snapshot = with_hashed
    (SCENARIOS.get(scenario) or _LOCAL[scenario])(pool)
    return pool


def _differences(ref: Any, got: Any, what: str) -> str | None:
    if len(ref.trace) != len(got.trace) or not ref.trace:
        return f"{what}: {len(ref.trace)} steps in the reference, {len(got.trace)} here"
    for step, (r, c) in enumerate(zip(ref.trace, got.trace)):
        for key in r:
            if not torch.equal(r[key], c[key].cpu()):
                return f"{what}: step {step} {key} differs"
    if [v.kinds for v in ref.violations] != [v.kinds for v in got.violations]:
        return f"{what}: violations differ"
    if ref.free_pages != got.free_pages:
        return f"{what}: free lists differ"
    return None


_REFERENCE: dict[tuple[str, str, int, int], Any] = {}  # reference traces, once per case


def _compare(scenario: str, mode: str, ps: int, device: str = "cpu", index_layers: int = 0,
             **kw: Any) -> str | None:  # fmt: skip
    from kvguard.kernels.guard_triton import TritonKernels

    key = (scenario, mode, ps, index_layers)
    if key not in _REFERENCE:
        _REFERENCE[key] = _trace("torch", scenario, mode, ps, index_layers=index_layers)
    ref = _REFERENCE[key]
    got = _trace(TritonKernels(**kw), scenario, mode, ps, device, index_layers)
    return _differences(ref, got, f"{scenario} {mode} ps{ps}")


def _decode_compare(mode: str, ps: int) -> str | None:
    """bench.step's decode steps: no write batch, no seeds, private pages in random order."""
    from kvguard.bench.step import DecodeBench
    from kvguard.kernels.guard_triton import TritonKernels

    traces = []
    for kernels in ("torch", TritonKernels()):
        bench = DecodeBench(mode, 3, 2 * ps + 3, 5, ps, kernels=kernels,  # type: ignore[arg-type]
                            row_bytes=16, buffers=4)  # fmt: skip
        g = bench.guard
        g.reset()
        g.on_rows_allocated(bench.rows)
        snaps = []
        for start, n in [(0, bench.prompt)] + [(bench.prompt + i, 1) for i in range(bench.new)]:
            bench.forward(start, n)  # raises on any violation: the pool is clean
            snaps.append([t.clone() for t in g.ledger.pages.tensors() + g.records.rows.tensors()])
        traces.append(snaps)
    for step, (r, c) in enumerate(zip(*traces)):
        for i, (a, b) in enumerate(zip(r, c)):
            if not torch.equal(a, b):
                return f"decode {mode} ps{ps}: step {step} array {i} differs"
    return None


def _alloc_release_compare() -> str | None:
    """Hand-outs and frees with pages repeated in one call, and indices outside the pool."""
    from kvguard.kernels import guard_ref
    from kvguard.kernels.guard_state import PageArrays, RowArrays
    from kvguard.kernels.guard_triton import TritonKernels

    g = torch.Generator().manual_seed(3)
    for ps in (1, 16):
        num_pages = 64
        P_ref, P_got = PageArrays.empty(num_pages, "cpu"), PageArrays.empty(num_pages, "cpu")
        k = TritonKernels()
        k.bind(P_got, RowArrays.empty(4, "cpu"), [])
        for step in range(1, 40):
            pages = torch.randint(-2, num_pages + 2, (24,), generator=g)  # a few outside the pool
            if step % 2:
                slots = pages * ps + (torch.randint(0, 3, (24,), generator=g) == 0) * (ps > 1)
                guard_ref.alloc_pages(P_ref, slots, ps, step)
                k.alloc_pages(P_got, slots, ps, step)
            else:
                want = guard_ref.release_pages(P_ref, pages, step)
                got = k.release_pages(P_got, pages, step)
                if not all(torch.equal(a, b) for a, b in zip(want, got)):
                    return f"release ps{ps} step {step}: keep/double differ"
            for a, b in zip(P_ref.tensors(), P_got.tensors()):
                if not torch.equal(a, b):
                    return f"alloc/release ps{ps} step {step}: ledger differs"
    return None


def _out_of_range_compare(device: str = "cpu") -> str | None:
    """A page table or write target outside the pool: the step is refused (ValueError when its
    verdict is read: in the check on the CPU, at resolve on a GPU), nothing outside the pool is
    read, no transition is applied, every write goes to the padding slot, and the steps after
    it match the reference's."""
    from guard_scenarios import _decode, _two
    from synthetic_pool import SyntheticPool

    from kvguard.kernels.guard_triton import TritonKernels

    for corrupt in ("table", "write", "negative"):
        pools = []
        for kernels, dev in (("torch", "cpu"), (TritonKernels(), device)):
            pool = SyntheticPool(page_size=16, num_pages=64, mode="paranoid", kernels=kernels,
                                 device=dev)  # fmt: skip
            a, b = _two(pool)
            pool.trace = []
            before = [t.clone() for t in pool.guard.ledger.pages.tensors()]
            kv = [buf[1:].clone() for buf in pool.bufs]  # slot 0 is the padding slot
            views = []
            honest = pool.guard.before_forward

            def capture(view: Any, honest: Any = honest, views: list[Any] = views) -> Any:
                views.append(view)
                return honest(view)

            pool.guard.before_forward = capture
            kept = pool.table[a.row, 3].clone(), pool.table[b.row, 0].clone()
            try:
                if corrupt == "table":
                    pool.table[a.row, 3] = 10**6
                    pool.forward([a, b], 1)
                elif corrupt == "write":
                    pool.forward([a, b], 1, redirect={(a.rid, a.length): 10**7})
                else:
                    pool.table[b.row, 0] = -5
                    pool.forward([a, b], 1)
            except ValueError as exc:
                if "out of range" not in str(exc) and "outside the pool" not in str(exc):
                    return f"{corrupt}: {exc}"
            else:
                return f"{corrupt} ({kernels}): the step was not refused"
            pool.guard.before_forward = honest
            pool.table[a.row, 3], pool.table[b.row, 0] = kept
            del pool.trace[:]  # a GPU pool recorded the refused step before its verdict was read
            for t, was in zip(pool.guard.ledger.pages.tensors(), before):
                if not torch.equal(t.cpu(), was.cpu()):
                    return f"{corrupt} ({kernels}): the refused step changed the ledger"
            for buf, was in zip(pool.bufs, kv):
                if not torch.equal(buf[1:].cpu(), was.cpu()):
                    return f"{corrupt} ({kernels}): KV outside the padding slot changed"
            if kernels != "torch" and bool((views[-1].write_slots != 0).any()):
                return f"{corrupt}: a write of the refused step was not sent to the padding slot"
            _decode(pool, [b], steps=3)
            pools.append(pool)
        for p in pools:  # the padding slot's bytes are no one's
            for t in p.trace:
                t.pop("kv")
        problem = _differences(pools[0], pools[1], f"after a refused step ({corrupt})")
        if problem:
            return problem
    return None


def _checksum_compare() -> str | None:
    """The fused checksum (every buffer in one launch) against kv_checksum_ref: rows of one width
    (whole tiles: FP8 MHA heads, an MLA latent row) and of mixed widths, dtypes and strides."""
    from kvguard.kernels.guard_triton import TritonKernels, _KvTables
    from kvguard.kernels.kv_checksum_ref import page_major, token_digests_ref

    g = torch.Generator().manual_seed(7)
    n = 40
    wide = torch.randn(n, 4, 8, generator=g).to(torch.bfloat16)
    # DSA index pages of 8 slots: 8 keys of 128 bytes, then their 8 fp32 scales
    raw = [torch.randint(0, 255, (n // 8, 8 * 132), dtype=torch.uint8, generator=g)
           for _ in range(2)]  # fmt: skip
    keys = [page_major(r, offset=0, slot_bytes=128, row_bytes=128, per_page=8) for r in raw]
    scales = [page_major(r, offset=8 * 128, slot_bytes=4, row_bytes=4, per_page=8) for r in raw]
    pools = {
        "fp8 heads": [torch.randint(0, 255, (n, 2, 32), dtype=torch.uint8, generator=g)
                      for _ in range(4)],
        "mla latent": [torch.randn(n, 1, 576, generator=g).to(torch.bfloat16)],
        "mixed": [torch.randn(n, 2, 8, generator=g).to(torch.bfloat16),
                  torch.randn(n, 3, 4, generator=g).to(torch.float16),
                  torch.randint(0, 255, (n, 2, 6), dtype=torch.uint8, generator=g),
                  wide[:, :2],  # a strided view: slot stride larger than the row
                  torch.randn(n, 1, 5, generator=g)],
        "index keys": keys,
        "dsa": [torch.randn(n, 1, 192, generator=g).to(torch.bfloat16), keys[0], scales[0],
                keys[1], scales[1]],
    }  # fmt: skip
    slots = torch.randint(0, n, (45,), generator=g)
    pos = torch.randint(0, 2**31 - 1, (45,), generator=g)
    for name, bufs in pools.items():
        want = token_digests_ref(bufs, slots, pos)
        kv = _KvTables(bufs, torch.device("cpu"))
        if (kv.wconst > 0) != (name not in ("mixed", "dsa")):
            return f"{name}: row tiles {kv.meta}"
        for groups in (1, 3):
            got = TritonKernels(buffer_groups=groups).token_digests(bufs, slots, pos)
            if not torch.equal(got, want):
                return f"checksum {name}, {groups} buffer groups: digests differ"
    return None


def _run_interpreted() -> None:
    """The subprocess: each case, one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    sys.path.insert(0, str(HERE))
    torch.set_num_threads(1)
    jobs: list[tuple[str, Any]] = []
    for s, m, p in _SUBSET:
        jobs.append((f"{s}-{m}-ps{p}", lambda s=s, m=m, p=p: _compare(s, m, p)))
    for s, m, p in _ORDER_CASES:
        jobs.append((f"reversed-{s}-{m}-ps{p}",
                     lambda s=s, m=m, p=p: _compare(s, m, p, reverse_programs=True,
                                                    buffer_groups=3)))  # fmt: skip
    for m, p in _DECODE_CASES:
        jobs.append((f"decode-{m}-ps{p}", lambda m=m, p=p: _decode_compare(m, p)))
    for s, m, p in _INDEX_CASES:
        jobs.append((f"index-{s}-{m}-ps{p}",
                     lambda s=s, m=m, p=p: _compare(s, m, p, index_layers=1)))  # fmt: skip
    jobs.append(("alloc-release", _alloc_release_compare))
    jobs.append(("out-of-range", _out_of_range_compare))
    jobs.append(("checksum", _checksum_compare))
    for name, job in jobs:
        try:
            problem = job()
        except Exception as exc:  # a crash is a failed case, reported with its cause
            problem = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"case": name, "problem": problem}), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, str(Path(__file__)), "--interpreted"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    results = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["case"]] = row["problem"]
    if r.returncode != 0 and not results:
        pytest.fail(f"interpreter subprocess failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return results


@pytest.mark.parametrize("case", _case_ids())
def test_interpreted_kernels_match_the_reference(interpreted: dict[str, str | None], case: str):
    assert case in interpreted, f"{case}: no result (the subprocess stopped early)"
    assert interpreted[case] is None, interpreted[case]


def test_local_scenarios_make_their_violation():
    """The two scenarios added here make the kinds they are here for, and flag exactly their
    victims (on the reference)."""
    sys.path.insert(0, str(HERE))
    from synthetic_pool import SyntheticPool

    from kvguard.kernels.guard_ref import OVERWRITE, TABLE_MISMATCH

    for scenario, ps, bit in (("table_mismatch", 1, TABLE_MISMATCH),
                              ("table_mismatch", 16, TABLE_MISMATCH),
                              ("overwrite_sealed", 16, OVERWRITE)):  # fmt: skip
        pool = SyntheticPool(page_size=ps, num_pages=4096 // ps + 16, mode="tags", max_len=512,
                             kernels="torch", sweep_tokens_per_step=64)  # fmt: skip
        pool.trace = []
        victims = _LOCAL[scenario](pool)
        kinds = 0
        for t in pool.trace:
            for k in t["kinds"].tolist():
                kinds |= k
        assert kinds & bit, (scenario, ps, kinds)
        assert pool.flagged() == victims, (scenario, ps)


def test_decode_kernels_compile_for_hopper(monkeypatch: pytest.MonkeyPatch):
    """Without a GPU: every kernel a decode step launches (tags, sampled, paranoid; no write
    batch, as bench.step and SGLang's decode) compiles for sm_90, as the GPU would compile it.
    The interpreter checks what the kernels compute; this checks that they compile."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from kvguard.bench.step import DecodeBench
    from kvguard.kernels import guard_triton

    if guard_triton._interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    variants: dict[tuple[Any, ...], tuple[Any, dict[str, Any], dict[str, Any]]] = {}

    def record(self: Any, kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
        vals = dict(zip(kernel.arg_names, args), **meta)
        sig, consts = {}, {}
        for i, name in enumerate(kernel.arg_names):
            if i in kernel.constexprs:
                sig[name], consts[name] = "constexpr", vals[name]
            else:
                sig[name] = mangle_type(vals[name])
        key = (kernel.fn.__name__, tuple(sig.values()), tuple(sorted(consts.items())))
        variants.setdefault(key, (kernel, sig, consts))

    monkeypatch.setattr(guard_triton, "_interpreting", lambda: True)  # bind a CPU pool
    monkeypatch.setattr(guard_triton.TritonKernels, "_launch", record)
    for mode in ("tags", "sampled", "paranoid"):
        bench = DecodeBench(mode, 2, 20, 20, 16, kernels=guard_triton.TritonKernels(),  # type: ignore[arg-type]
                            row_bytes=128, buffers=4)  # fmt: skip
        bench.guard.on_rows_allocated(bench.rows)
        for pos in (31, 32):  # 32 starts a page: an allocation event
            bench.forward(pos, 1)  # the kernels do not run: nothing is found
    names = {k[0] for k in variants}
    assert {"_read_kernel", "_write_kernel", "_apply_kernel", "_seal_kernel", "_alloc_kernel",
            "_hash_kernel"} <= names, names  # fmt: skip
    target = GPUTarget("cuda", 90, 32)
    for (name, _, consts), (kernel, sig, c) in variants.items():
        compiled = triton.compile(ASTSource(kernel, sig, c), target=target)
        assert compiled.asm.get("cubin"), (name, consts)


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("mode", ["tags", "sampled", "paranoid"])
def test_decode_dispatches_are_few_and_flat(monkeypatch: pytest.MonkeyPatch, mode: str, ps: int):
    """A decode step on a GPU pool dispatches at most 16 (tags) or 24 (sampled, paranoid)
    kernels and torch operators, the same number at any batch size and context: the launches
    (counted, not run) plus the aten operators the guard and the backend run around them (the
    profiler, with the guard's GPU-pool path) plus the one host-to-device copy of the step's
    metadata, which only a CUDA pool makes."""
    from torch.profiler import ProfilerActivity, profile

    from kvguard.bench.step import DecodeBench
    from kvguard.kernels import guard_triton

    if guard_triton._interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")

    def count(self: Any, kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
        self.launches += 1

    monkeypatch.setattr(guard_triton, "_interpreting", lambda: True)  # bind a CPU pool
    monkeypatch.setattr(guard_triton.TritonKernels, "_launch", count)
    seen = set()
    for batch, prompt in ((2, 8 * ps), (24, 300)):
        bench = DecodeBench(mode, batch, prompt, 64, ps, kernels=guard_triton.TritonKernels())  # type: ignore[arg-type]
        bench.guard.host_reads_free = False  # as on a GPU pool
        bench.guard.on_rows_allocated(bench.rows)
        pos = prompt + (ps - prompt % ps) % ps  # starts a page: this step allocates
        bench.forward(pos - 1, 1)
        for p in (pos, pos + 1):
            l0 = bench.guard.kernels.launches
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                bench.forward_timed_only(p)
            events = prof.events()
            step = next(e for e in events if e.name == "guard_step").time_range
            aten = sum(
                1
                for e in events
                if e.name.startswith("aten::") and step.start <= e.time_range.start <= step.end
            )
            seen.add((p == pos, bench.guard.kernels.launches - l0 + aten + 1))
    by_alloc = {alloc for alloc, _ in seen}
    assert len(seen) == len(by_alloc), seen  # flat: one count per kind of step
    assert max(n for _, n in seen) <= (16 if mode == "tags" else 24), seen


@pytest.mark.gpu
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("mode", ["tags", "sampled", "paranoid"])
def test_compiled_kernels_match_the_reference_on_cuda(mode: str, ps: int):
    """Every scenario, compiled for the GPU: the pool and the guard on CUDA, the reference on
    the CPU; then the same with programs reversed and KV sums split over buffer groups."""
    sys.path.insert(0, str(HERE))
    from guard_scenarios import SCENARIOS

    for scenario in sorted(SCENARIOS) + sorted(_LOCAL):
        if scenario == "overwrite_sealed" and ps == 1:
            continue
        for kw in ({}, {"reverse_programs": True, "buffer_groups": 3}):
            problem = _compare(scenario, mode, ps, device="cuda", **kw)
            assert problem is None, f"{problem} ({kw or 'default launch'})"


@pytest.mark.gpu
def test_compiled_kernels_refuse_out_of_range_steps_on_cuda():
    sys.path.insert(0, str(HERE))
    assert _out_of_range_compare("cuda") is None


@pytest.mark.gpu
def test_compiled_checksum_matches_the_reference_on_cuda():
    """The guard's fused checksum (every buffer in one launch, split over buffer groups) on KV
    shaped like the targets: FP8 MHA rows and an MLA latent row."""
    from kvguard.kernels.guard_triton import TritonKernels
    from kvguard.kernels.kv_checksum_ref import token_digests_ref

    g = torch.Generator().manual_seed(1)
    bufs = [torch.randn(4096, 1, 576, generator=g).to(torch.bfloat16)]
    bufs += [
        torch.randint(0, 255, (4096, 8, 128), dtype=torch.uint8, generator=g) for _ in range(6)
    ]
    slots = torch.randperm(4096, generator=g)[:3000]
    pos = torch.randint(0, 1 << 20, (3000,), generator=g)
    want = token_digests_ref(bufs, slots, pos)
    for groups in (None, 1, 7):
        got = TritonKernels(buffer_groups=groups).token_digests(
            [b.cuda() for b in bufs], slots.cuda(), pos.cuda()
        )
        assert torch.equal(got.cpu(), want), groups


if __name__ == "__main__" and "--interpreted" in sys.argv:
    _run_interpreted()

"""Guard cost per decode step in isolation: the guard's hooks on a synthetic pool, no engine.

    python -m kvguard.bench.step [--batch 16] [--prompt 40] [--new 64] [--reps 20] [--count-ops]
    python -m kvguard.bench.step --curve            # microseconds per step vs context read

A pool shaped like the embedded model's FP8 KV (4 layers x K,V x [slots, 2 heads, 64] bytes);
``--batch`` requests prefill ``--prompt`` tokens, then decode ``--new`` tokens each. Each decode
step runs what the SGLang adapter runs (allocation event, check before the forward, seal after
it, verdict read) and is timed on the host; the forward itself is not run. ``--count-ops``
counts the dispatches of one decode step: aten operators (the torch profiler) plus calls into the
compiled kernels (for the Triton kernels: their GPU launches); the count is flat in batch and
context (``tests/test_bench_step.py``). ``--kernels torch`` runs the reference instead of the
compiled kernels. ``--device cuda`` puts the pool and the guard on the GPU (the Triton kernels);
each step then ends with a device sync, so its time includes the guard's GPU work.
"""

from __future__ import annotations

import argparse
import logging
import time

import structlog
import torch

from kvguard.config import GuardConfig
from kvguard.guard import Guard
from kvguard.metrics import GuardMetrics
from kvguard.step import StepView


class DecodeBench:
    """``batch`` requests on private pages in random physical order, prefilled, then decoded."""

    def __init__(self, mode: str, batch: int, prompt: int, new: int, page_size: int,
                 kernels: str | None = None, sweep_tokens_per_step: int | None = None,
                 row_bytes: int = 128, buffers: int = 8, seed: int = 0,
                 device: str = "cpu"):  # fmt: skip
        from prometheus_client import CollectorRegistry

        dev = self.device = torch.device(device)
        self.sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        self.batch, self.prompt, self.new, self.ps = batch, prompt, new, page_size
        width = -(-(prompt + new) // page_size) * page_size  # whole pages per request
        pages_per_req = width // page_size
        num_pages = 1 + batch * pages_per_req + 1
        self.num_slots = num_pages * page_size
        g = torch.Generator().manual_seed(seed)
        self.bufs = [
            torch.randint(
                0, 255, (self.num_slots, 2, row_bytes // 2), dtype=torch.uint8, generator=g
            ).to(dev)
            for _ in range(buffers)
        ]
        perm = torch.randperm(num_pages - 2, generator=g) + 1
        self.pages = perm[: batch * pages_per_req].view(batch, pages_per_req)
        self.table = torch.zeros(batch + 1, width, dtype=torch.int32)
        pos = torch.arange(width)
        slots = self.pages[:, pos // page_size] * page_size + pos % page_size
        self.table[1:] = slots.to(torch.int32)
        self.table = self.table.to(dev)
        self.rows = torch.arange(1, batch + 1, device=dev)
        self.tokens = torch.randint(0, 4096, (batch, width), generator=g).to(dev)
        config = GuardConfig(mode=mode)
        if sweep_tokens_per_step is not None:
            config = config.with_(sweep_tokens_per_step=sweep_tokens_per_step)
        self.guard = Guard(
            config, num_slots=self.num_slots, page_size=page_size, num_rows=batch + 1,
            kv_buffers=self.bufs, device=dev, metrics=GuardMetrics(registry=CollectorRegistry()),
            kernels=kernels,
        )  # fmt: skip
        self.step = 0
        self._count_calls()

    def _count_calls(self) -> None:
        """Count calls into the compiled kernels (the profiler sees only aten operators); a
        backend that counts its own launches (the Triton kernels) is read instead."""
        self.kernel_calls = 0
        k = self.guard.kernels
        if k.name == "torch" or hasattr(k, "launches"):
            return
        for name in ("check_step", "apply_step", "seal_step", "alloc_pages", "release_pages"):
            fn = getattr(k, name)

            def counted(*a, _fn=fn, **kw):  # type: ignore[no-untyped-def]
                self.kernel_calls += 1
                return _fn(*a, **kw)

            setattr(k, name, counted)

    def dispatches(self) -> int:
        """Kernel dispatches so far that the profiler does not see."""
        return int(getattr(self.guard.kernels, "launches", self.kernel_calls))

    def forward(self, start: int, n: int) -> float:
        """All requests write positions [start, start + n): one guarded step; host seconds."""
        B, dev = self.batch, self.device
        pos = torch.arange(start, start + n, device=dev).repeat(B)
        wb = None if n == 1 else torch.arange(B, device=dev).repeat_interleave(n)
        slots = self.table[self.rows.repeat_interleave(n), pos].to(torch.int64)
        fresh = slots[(pos % self.ps) == 0]
        tokens = self.tokens[torch.arange(B, device=dev).repeat_interleave(n), pos]
        prefix_tokens = None
        if n > 1:
            prefix_tokens = self.tokens[:, :start].reshape(-1).contiguous()
        self.step += 1
        view = StepView(
            step=self.step, rows=self.rows, prefix_lens_host=[start] * B, write_slots=slots,
            write_batch=wb, write_pos=pos, write_tokens=tokens, page_table=self.table,
            prefix_tokens=prefix_tokens,
        )  # fmt: skip
        self.sync()
        t0 = time.perf_counter()
        if fresh.numel():
            self.guard.on_alloc(fresh)
        verdict = self.guard.before_forward(view)
        self.guard.after_forward(verdict)
        violations = self.guard.resolve(verdict, [None] * B)
        self.sync()  # on a GPU: the guard's device work is part of its cost
        elapsed = time.perf_counter() - t0
        if violations:  # a clean pool must stay clean
            raise RuntimeError(
                f"{len(violations)} violations on a clean pool: {violations[0].message}"
            )
        return elapsed

    def lifetime(self) -> list[float]:
        """Reset, prefill, decode: the decode steps' host seconds."""
        self.guard.reset()
        self.guard.on_rows_allocated(self.rows)
        self.forward(0, self.prompt)
        return [self.forward(self.prompt + i, 1) for i in range(self.new)]

    def lifetime_prefix(self) -> None:
        self.guard.reset()
        self.guard.on_rows_allocated(self.rows)
        self.forward(0, self.prompt)
        for i in range(self.new - 1):
            self.forward(self.prompt + i, 1)

    def forward_timed_only(self, start: int) -> None:
        """One decode step where only the guard's hooks run inside the profiled region."""
        B = self.batch
        pos = torch.full((B,), start, dtype=torch.int64, device=self.device)
        slots = self.table[self.rows, pos].to(torch.int64)
        fresh = slots[(pos % self.ps) == 0]
        tokens = self.tokens[:, start].contiguous()
        self.step += 1
        view = StepView(
            step=self.step, rows=self.rows, prefix_lens_host=[start] * B, write_slots=slots,
            write_batch=None, write_pos=pos, write_tokens=tokens, page_table=self.table,
        )  # fmt: skip
        from torch.profiler import record_function

        with record_function("guard_step"):
            if fresh.numel():
                self.guard.on_alloc(fresh)
            verdict = self.guard.before_forward(view)
            self.guard.after_forward(verdict)
            self.guard.resolve(verdict, [None] * B)


def _profile_ops(bench: DecodeBench) -> int:
    from torch.profiler import ProfilerActivity, profile

    bench.lifetime_prefix()
    calls0 = bench.dispatches()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bench.forward_timed_only(bench.prompt + bench.new - 1)
    # only the operators inside the guard's hooks (the harness builds its view outside)
    events = prof.events()
    guard = [e for e in events if e.name == "guard_step"]
    if not guard:
        return -1
    lo, hi = guard[0].time_range.start, guard[0].time_range.end
    aten = sum(1 for e in events if e.name.startswith("aten::") and lo <= e.time_range.start <= hi)
    return aten + bench.dispatches() - calls0


def run(mode: str, batch: int, prompt: int, new: int, reps: int, page_size: int,
        count_ops: bool = False, sweep_tokens_per_step: int | None = None,
        kernels: str | None = None, device: str = "cpu") -> tuple[list[float], int | None]:  # fmt: skip
    """Sorted decode-step host seconds over ``reps`` lifetimes, and the dispatches of one decode
    step (aten operators + compiled kernel calls) when ``count_ops``."""
    bench = DecodeBench(mode, batch, prompt, new, page_size, kernels, sweep_tokens_per_step,
                        device=device)  # fmt: skip
    if bench.device.type == "cuda":
        bench.lifetime()  # warm-up: kernel compilation and first launches stay out of the times
    times: list[float] = []
    for _ in range(reps):
        times += bench.lifetime()
    ops = _profile_ops(bench) if count_ops else None
    return sorted(times), ops


def curve(mode: str, page_size: int, kernels: str | None, reps: int,
          device: str = "cpu") -> list[tuple[int, float]]:  # fmt: skip
    """Guard microseconds per decode step (p50) against total context read, 1k..256k positions:
    16 requests, context split evenly."""
    out = []
    for total in (1024, 4096, 16384, 65536, 262144):
        per = total // 16
        bench = DecodeBench(mode, 16, per - 4, 4, page_size, kernels, device=device)
        if bench.device.type == "cuda":
            bench.lifetime()  # warm-up (compilation)
        t: list[float] = []
        for _ in range(reps):
            t += bench.lifetime()
        t.sort()
        out.append((total, 1e6 * t[len(t) // 2]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--modes", default="tags,sampled,paranoid")
    ap.add_argument(
        "--kernels", default=None, help="torch | cpu | triton (default: the fastest available)"
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the pool's and guard's device)")
    ap.add_argument("--count-ops", action="store_true", help="dispatches per decode step")
    ap.add_argument("--curve", action="store_true", help="us per step vs context read (1k..256k)")
    ap.add_argument(
        "--sweep-tokens-per-step",
        type=int,
        default=None,
        help="sampled mode's per-step checksum budget (as KVGUARD_SWEEP_TOKENS_PER_STEP)",
    )
    a = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    torch.set_num_threads(1)
    if a.curve:
        print(
            f"guard us per decode step (p50) vs context read, 16 requests, page size {a.page_size}"
            f", device {a.device}"
        )
        print(
            "| mode | "
            + " | ".join(f"{n // 1024}k" for n in (1024, 4096, 16384, 65536, 262144))
            + " |"
        )
        print("|---" * 6 + "|")
        for mode in a.modes.split(","):
            pts = curve(mode, a.page_size, a.kernels, max(1, a.reps // 10), a.device)
            print(f"| {mode} | " + " | ".join(f"{us:.0f}" for _, us in pts) + " |", flush=True)
        return 0
    print(f"{a.batch} requests x ({a.prompt} prompt + {a.new} decode) tokens, page size {a.page_size}, "
          f"{a.reps} reps, kernels {a.kernels or 'auto'}, device {a.device}")  # fmt: skip
    print(
        "| mode | decode step p10 us | p50 us | p90 us | dispatches per step |\n|---|---|---|---|---|"
    )
    for mode in a.modes.split(","):
        t, ops = run(mode, a.batch, a.prompt, a.new, a.reps, a.page_size, a.count_ops,
                     a.sweep_tokens_per_step, a.kernels, a.device)  # fmt: skip
        q = lambda f, t=t: 1e6 * t[min(len(t) - 1, int(f * len(t)))]
        print(f"| {mode} | {q(0.1):.1f} | {q(0.5):.1f} | {q(0.9):.1f} | "
              f"{ops if ops is not None else '-'} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

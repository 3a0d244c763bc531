"""Guard cost per decode step in isolation: the guard's hooks on a synthetic pool, no engine.

    python -m kvguard.bench.step [--batch 16] [--prompt 40] [--new 64] [--reps 20]

A pool shaped like the embedded model's FP8 KV (4 layers x K,V x [slots, 2 heads, 64] bytes);
``--batch`` requests prefill ``--prompt`` tokens, then decode ``--new`` tokens each, ``--reps``
times over. Each decode step runs what the engine adapter runs (allocation event, checks before
the forward, seal after it, verdict read) and is timed on the host; the forward itself is not
run. This is the floor of what the guard adds to a step on this machine, free of the serving
stack's noise; ``bench_guard`` measures it inside kvguard-serve. ``--count-ops`` also counts the
aten calls per step (averaged over a request's lifetime, prefill included): the same at any batch
and context size, because the hot path has no Python loop over pages or tokens. The one loop is
the CPU checksum's over chunks of ~2,000 tokens, so paranoid's count grows past such read sets.
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


def run(
    mode: str,
    batch: int,
    prompt: int,
    new: int,
    reps: int,
    page_size: int,
    count_ops: bool = False,
    sweep_tokens_per_step: int = GuardConfig().sweep_tokens_per_step,
):
    width = -(-(prompt + new) // page_size) * page_size  # whole pages per request
    num_slots = page_size + batch * width + page_size
    g = torch.Generator().manual_seed(0)
    bufs = [
        torch.randint(0, 255, (num_slots, 2, 64), dtype=torch.uint8, generator=g) for _ in range(8)
    ]
    table = torch.zeros(batch + 1, width, dtype=torch.int32)
    rows = torch.arange(1, batch + 1)
    table[1:] = torch.arange(page_size, page_size + batch * width, dtype=torch.int32).view(
        batch, width
    )
    tokens = torch.randint(0, 4096, (batch, width), generator=g)
    config = GuardConfig(mode=mode, sweep_tokens_per_step=sweep_tokens_per_step)
    guard = Guard(
        config,
        num_slots=num_slots,
        page_size=page_size,
        num_rows=batch + 1,
        max_len=width,
        kv_buffers=bufs,
        device="cpu",
        metrics=GuardMetrics.default(),
    )
    step, times = 0, []

    def forward(start: int, n: int) -> float:
        nonlocal step
        pos = torch.arange(start, start + n).repeat(batch)
        wb = torch.arange(batch).repeat_interleave(n)
        slots = table[rows[wb], pos].to(torch.int64)
        step += 1
        t0 = time.perf_counter()
        guard.on_alloc(slots)
        view = StepView(
            step=step,
            rows=rows,
            prefix_lens=torch.full((batch,), start),
            max_prefix_len=start,
            write_slots=slots,
            write_batch=wb,
            write_pos=pos,
            write_tokens=tokens[wb, pos],
            page_table=table,
        )
        verdict = guard.before_forward(view)
        guard.after_forward(view)
        violations = guard.resolve(verdict, [None] * batch)
        elapsed = time.perf_counter() - t0
        if violations:  # a clean pool must stay clean
            raise RuntimeError(
                f"{len(violations)} violations on a clean pool, first: {violations[0].message}"
            )
        return elapsed

    def one_request_lifetime():
        guard.reset()
        guard.on_rows_allocated(rows)
        forward(0, prompt)
        return [forward(prompt + i, 1) for i in range(new)]

    for _ in range(reps):
        times += one_request_lifetime()
    ops = None
    if (
        count_ops
    ):  # every aten op one lifetime dispatches (the harness's own included), per decode step
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_request_lifetime()
        ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) // (new + 1)
    return sorted(times), ops


def main(argv=None):
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
        "--count-ops", action="store_true", help="also count aten calls per step (lifetime average)"
    )
    ap.add_argument(
        "--sweep-tokens-per-step",
        type=int,
        default=GuardConfig().sweep_tokens_per_step,
        help="sampled mode's per-step checksum budget (as KVGUARD_SWEEP_TOKENS_PER_STEP)",
    )
    a = ap.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    print(
        f"{a.batch} requests x ({a.prompt} prompt + {a.new} decode) tokens, page size {a.page_size}, "
        f"sampled budget {a.sweep_tokens_per_step}, {a.reps} reps, torch threads {torch.get_num_threads()}"
    )
    print(
        "| mode | decode step p10 ms | p50 ms | p90 ms | aten calls per step |\n|---|---|---|---|---|"
    )
    for mode in a.modes.split(","):
        t, ops = run(
            mode,
            a.batch,
            a.prompt,
            a.new,
            a.reps,
            a.page_size,
            a.count_ops,
            a.sweep_tokens_per_step,
        )
        q = lambda f: 1e3 * t[min(len(t) - 1, int(f * len(t)))]
        print(
            f"| {mode} | {q(0.1):.3f} | {q(0.5):.3f} | {q(0.9):.3f} | {ops if ops is not None else '-'} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

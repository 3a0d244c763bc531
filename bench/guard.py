"""Guard overhead benchmark: tokens/s and inter-token latency, guard off vs each mode, in one run.

One guarded kvguard-serve whose mode is switched between rounds through ``KVGUARD_MODE_FILE``
(``off`` there: the hooks stay installed but do nothing). Each round runs every mode once, in an
order rotated from round to round, so drift on a shared machine and position in the round hit all
modes alike. A run of one mode flushes the prefix cache (which also resets the guard's ledger),
then streams the same greedy workload (concurrent requests) and records every token's arrival
time. Ratios are paired: each mode against ``off`` in the same round, then the median over
rounds, with the lowest and highest round shown. A single run of a few seconds on a shared
2-core machine varies by 5-20%, so run 10 rounds or more and read the paired median. Before
that, a server started with ``--kvguard-mode off`` (no hooks at all) runs the same rounds alone,
to show what the idle hooks cost. Servers never run side by side: an idle SGLang scheduler
busy-polls a core.

    python -m kvguard.bench.guard [--rounds 10] [--concurrency 16] [--max-new-tokens 64]
        [--prompt-tokens 1700] [--modes off,verified] [--plain] [--out results.json]
        [-- kvguard-serve args]

The pool defaults to page size 16 and twice the workload's tokens; ``--page-size`` and
``--max-total-tokens`` after ``--`` replace them (e.g. ``-- --tp 2 --page-size 1
--max-total-tokens 1000000``: tensor parallelism over a million-token pool).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvguard.bench.rounds import NO_HOOKS, interleaved_rounds, server_args
from kvguard.serve.child import ServeProcess

MODES = ["off", "tags", "sampled", "verified", "paranoid"]


def start_server(mode: str, args: list[str], workdir: Path, mode_file: Path | None) -> ServeProcess:
    """A healthy kvguard-serve started in ``mode``; with ``mode_file``, its mode follows that
    file's content between rounds (``KVGUARD_MODE_FILE``)."""
    env = {"KVGUARD_MODE_FILE": str(mode_file)} if mode_file is not None else {}
    srv = ServeProcess(["--kvguard-mode", mode, *args], workdir / f"server-{mode}.log", env)
    srv.start(timeout_s=600)
    return srv


def guard_counters(srv: ServeProcess) -> tuple[float, float]:
    """(kvguard_check_seconds_total, kvguard_steps_checked_total) summed over schedulers."""
    totals = srv.metric_totals()
    return (
        totals.get("kvguard_check_seconds_total", 0.0),
        totals.get("kvguard_steps_checked_total", 0.0),
    )


def settled_counters(srv: ServeProcess, timeout_s: float = 5.0) -> tuple[float, float]:
    """The guard counters once the scheduler has flushed them: it sends them at most every
    0.5 s while serving and at once when idle, so read until two readings agree (else a
    round's tail would be counted in the next round)."""
    last, deadline = guard_counters(srv), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = guard_counters(srv)
        if now == last:
            return now
        last = now
    return last


async def stream_tokens(session, url, prompt, max_new_tokens):
    body = {
        **({"input_ids": prompt} if isinstance(prompt, list) else {"text": prompt}),
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    times, n_prev = [], 0
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            n = json.loads(line[5:])["meta_info"]["completion_tokens"]
            now = time.perf_counter()
            times.extend([now] * (n - n_prev))
            n_prev = n
    return times


async def _plain(session, url, prompt, max_new_tokens):
    """One non-streamed request: the client that keeps a server nearest its top speed. Its
    tokens all arrive at the end (no inter-token latency)."""
    body = {
        **({"input_ids": prompt} if isinstance(prompt, list) else {"text": prompt}),
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        n = (await resp.json())["meta_info"]["completion_tokens"]
    return [time.perf_counter()] * n


async def run_round(url, prompts, max_new_tokens, plain=False):
    one = _plain if plain else stream_tokens
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*[one(session, url, p, max_new_tokens) for p in prompts])
        wall = time.perf_counter() - t0
    tokens = sum(len(s) for s in streams)
    itl = [] if plain else [b - a for s in streams for a, b in itertools.pairwise(s)]
    latency = [s[-1] - t0 for s in streams if s]  # each request's, to its last token
    return {"tokens": tokens, "seconds": wall, "itl": itl, "latency": latency}


def server_cpu_seconds(srv: ServeProcess) -> float:
    """User + system CPU seconds of the server's whole process tree (HTTP process, schedulers,
    detokenizer) so far: steadier than wall time on a shared machine."""
    import psutil

    assert srv.proc is not None
    root = psutil.Process(srv.proc.pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def workload(n: int, prompt_tokens: int | None = None) -> list:
    """``n`` prompts: short code-like texts (about 40 tokens), or with ``prompt_tokens`` that
    many token ids each (seeded random ids of the embedded model's vocabulary: a long prefill
    costs the same whatever the tokens say)."""
    import random

    rng = random.Random(0)
    if prompt_tokens:
        return [[rng.randrange(3, 4096) for _ in range(prompt_tokens)] for _ in range(n)]
    heads = ["def parse(self, text):\n", "import os\nimport sys\n\n", "class Cache(object):\n    "]
    return [
        rng.choice(heads)
        + f"# request {i}: "
        + " ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(8, 64)))
        for i in range(n)
    ]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompts of this many token ids (default: short texts of about 40 tokens)",
    )
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help="guard modes to interleave (comma list; off is always among them)",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="non-streamed clients (tok/s nearest the server's top speed; no ITL figures)",
    )
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument(
        "server_args", nargs=argparse.REMAINDER, help="passed to kvguard-serve after --"
    )
    a = ap.parse_args(argv)
    extra = [x for x in a.server_args if x != "--"]
    if a.model_path:
        extra += ["--model-path", a.model_path]
    extra = server_args(extra, a.concurrency * ((a.prompt_tokens or 64) + a.max_new_tokens))
    modes = ["off"] + [m for m in a.modes.split(",") if m in MODES and m != "off"]

    work = Path(tempfile.mkdtemp(prefix="kvguard-bench-"))
    prompts = workload(a.concurrency, a.prompt_tokens)
    results: dict[str, list] = {m: [] for m in [NO_HOOKS, *modes]}

    def measure(srv, mode, r):
        srv.flush_cache()  # every round starts from an empty prefix cache (and a reset ledger)
        before, cpu0 = guard_counters(srv), server_cpu_seconds(srv)
        res = asyncio.run(run_round(srv.url, prompts, a.max_new_tokens, a.plain))
        res["cpu_per_token"] = (server_cpu_seconds(srv) - cpu0) / max(res["tokens"], 1)
        after = settled_counters(srv)
        # Host time inside guard hooks during this round, as a share of the round's wall time:
        # the scheduler is one thread, so this is what the guard adds to its steps.
        res["guard_seconds"], res["guard_steps"] = after[0] - before[0], after[1] - before[1]
        results[mode].append(res)
        print(
            f"round {r + 1} {mode:9s} {res['tokens'] / res['seconds']:8.1f} tok/s  "
            f"p50 ITL {1000 * pct(res['itl'], 0.5):6.2f} ms  p99 {1000 * pct(res['itl'], 0.99):6.2f} ms  "
            f"p95 request {pct(res['latency'], 0.95):6.2f} s  "
            f"CPU {1000 * res['cpu_per_token']:6.2f} ms/token  "
            f"guard {100 * res['guard_seconds'] / res['seconds']:5.2f}% of wall "
            f"({1000 * res['guard_seconds'] / max(res['guard_steps'], 1):.3f} ms/step)",
            flush=True,
        )

    interleaved_rounds(
        lambda mode, mode_file: start_server(mode, extra, work, mode_file),
        modes,
        a.rounds,
        measure,
        lambda srv: asyncio.run(run_round(srv.url, prompts[:4], 8)),  # first-touch costs out
        work,
        guarded_mode="sampled",
    )

    summary = {}
    for mode in results:
        rs = results[mode]
        tps = statistics.median(r["tokens"] / r["seconds"] for r in rs)
        itl = [x for r in rs for x in r["itl"]]
        gs = sum(r["guard_seconds"] for r in rs)
        summary[mode] = {
            "tok_s": tps,
            "itl_p50_ms": 1000 * pct(itl, 0.5),
            "itl_p99_ms": 1000 * pct(itl, 0.99),
            "guard_share_of_wall": gs / sum(r["seconds"] for r in rs),
            "guard_ms_per_step": 1000 * gs / max(sum(r["guard_steps"] for r in rs), 1),
            "latency_p95_s": statistics.median(pct(r["latency"], 0.95) for r in rs),
            "cpu_ms_per_token": 1000 * statistics.median(r["cpu_per_token"] for r in rs),
        }
    off = summary["off"]
    for mode in modes:  # paired: this mode's round r against off's round r
        pairs = [
            (m["tokens"] / m["seconds"]) / (o["tokens"] / o["seconds"])
            for m, o in zip(results[mode], results["off"])
        ]
        itl = [
            pct(m["itl"], 0.5) / pct(o["itl"], 0.5) for m, o in zip(results[mode], results["off"])
        ]
        itl99 = [
            pct(m["itl"], 0.99) / pct(o["itl"], 0.99) for m, o in zip(results[mode], results["off"])
        ]
        p95 = [
            pct(m["latency"], 0.95) / pct(o["latency"], 0.95)
            for m, o in zip(results[mode], results["off"])
        ]
        cpu = [
            m["cpu_per_token"] / o["cpu_per_token"] for m, o in zip(results[mode], results["off"])
        ]
        summary[mode].update(
            paired_latency_p95=statistics.median(p95),
            paired_cpu_per_token=statistics.median(cpu),
            paired_tok_s=statistics.median(pairs),
            paired_tok_s_range=[min(pairs), max(pairs)],
            paired_itl_p50=statistics.median(itl),
            paired_itl_p99=statistics.median(itl99),
        )
    print(
        "\n| mode | tok/s (median of rounds) | tok/s vs off, paired median [lowest, highest round] | ITL p50 ms | vs off (paired) | ITL p99 ms | vs off | p95 request s | vs off | server CPU ms/token | vs off | guard host time, share of wall | guard ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode, s in summary.items():
        paired = (
            f"{s['paired_tok_s']:.3f} [{s['paired_tok_s_range'][0]:.3f}, {s['paired_tok_s_range'][1]:.3f}]"
            if "paired_tok_s" in s
            else f"{s['tok_s'] / off['tok_s']:.3f} (unpaired)"
        )
        itl_ratio = s.get("paired_itl_p50", s["itl_p50_ms"] / off["itl_p50_ms"])
        print(
            f"| {mode} | {s['tok_s']:.1f} | {paired} | {s['itl_p50_ms']:.2f} | "
            f"{itl_ratio:.3f} | {s['itl_p99_ms']:.2f} | "
            f"{s.get('paired_itl_p99', s['itl_p99_ms'] / off['itl_p99_ms']):.3f} | "
            f"{s['latency_p95_s']:.2f} | "
            f"{s.get('paired_latency_p95', s['latency_p95_s'] / off['latency_p95_s']):.3f} | "
            f"{s['cpu_ms_per_token']:.2f} | "
            f"{s.get('paired_cpu_per_token', s['cpu_ms_per_token'] / off['cpu_ms_per_token']):.3f} | "
            f"{100 * s['guard_share_of_wall']:.2f}% | {s['guard_ms_per_step']:.3f} |"
        )
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "args": vars(a)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

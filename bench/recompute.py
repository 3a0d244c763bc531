"""What healing costs: a recompute's latency, per event and per token re-prefilled, and what it
adds to a healed request's end-to-end time.

One kvguard-serve (default mode and action: verified, recompute) with the fault-injection plugin.
Each round sends the same greedy workload twice, concurrently, the prefix cache flushed before
each pass: a clean pass, then a pass during which ``--flips`` bit flips are injected into running
requests' KV (the plugin picks the moments). Every healed request's output must equal its clean
output (the benchmark fails otherwise). Reported: the guard's own counters
(``kvguard_recompute_seconds_total`` over ``kvguard_requests_recomputed_total``: from the
decision to the request's first token after its re-prefill; over
``kvguard_tokens_recomputed_total``: per token re-prefilled), and, paired by request, the healed
requests' latency in the faulted pass minus their latency in the clean pass.

    python -m kvguard.bench.recompute [--rounds 3] [--requests 16] [--flips 6]
        [--prompt-tokens 400] [--max-new-tokens 64] [--out results.json] [-- kvguard-serve args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvguard.bench.guard import workload
from kvguard.serve.child import ServeProcess

COUNTERS = (
    "kvguard_requests_recomputed_total",
    "kvguard_recompute_seconds_total",
    "kvguard_tokens_recomputed_total",
    "kvguard_requests_aborted_total",
)


async def _one(session, url, prompt, rid, max_new):
    body = {
        "rid": rid,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
        **({"input_ids": prompt} if isinstance(prompt, list) else {"text": prompt}),
    }
    t0 = time.monotonic()
    async with session.post(f"{url}/generate", json=body) as r:
        out = await r.json()
    dt = time.monotonic() - t0
    if r.status != 200 or "output_ids" not in out:
        return {"rid": rid, "error": str(out)[:300], "seconds": dt}
    return {
        "rid": rid,
        "seconds": dt,
        "output_ids": out["output_ids"],
        "retractions": out["meta_info"].get("num_retractions", 0),
    }


def run_pass(srv, prompts, tag, max_new):
    async def go():
        timeout = aiohttp.ClientTimeout(total=900)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            return await asyncio.gather(
                *[_one(s, srv.url, p, f"{tag}-{i}", max_new) for i, p in enumerate(prompts)]
            )

    return asyncio.run(go())


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m kvguard.bench.recompute")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--flips", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    prompts = workload(a.requests, a.prompt_tokens)
    work = Path(tempfile.mkdtemp(prefix="kvguard-recompute-"))
    control = work / "control.json"
    control.write_text(json.dumps({"plan": []}))
    pool = 2 * a.requests * (a.prompt_tokens + a.max_new_tokens)
    args = ["--page-size", "16", "--max-total-tokens", str(pool), "--log-format", "json", *extra]
    env = {"KVGUARD_FUZZ_CONTROL": str(control), "KVGUARD_FUZZ_LOG": str(work / "fuzz.jsonl")}
    srv = ServeProcess(args, work / "server.log", env)
    srv.start(timeout_s=600)
    plan: list[dict] = []
    rounds = []
    try:
        run_pass(srv, prompts[:2], "warmup", 4)
        for rnd in range(a.rounds):
            srv.flush_cache()
            clean = run_pass(srv, prompts, f"clean{rnd}", a.max_new_tokens)
            before = {k: srv.metric_totals().get(k, 0.0) for k in COUNTERS}
            srv.flush_cache()
            for i in range(a.flips):
                plan.append(
                    {"id": len(plan) + 1, "cls": "bit_flip", "seed": 100 * rnd + i, "max_tries": 40}
                )
            tmp = control.with_suffix(".tmp")
            tmp.write_text(json.dumps({"plan": plan}))
            tmp.replace(control)
            faulted = run_pass(srv, prompts, f"flip{rnd}", a.max_new_tokens)
            srv.wait_idle()
            time.sleep(1.0)  # the guard flushes its counters when idle
            after = {k: srv.metric_totals().get(k, 0.0) for k in COUNTERS}
            d = {k: after[k] - before[k] for k in COUNTERS}
            healed = [(c, f) for c, f in zip(clean, faulted) if f.get("retractions")]
            errors = [f for f in faulted if "error" in f]
            wrong = [
                f["rid"]
                for c, f in zip(clean, faulted)
                if f.get("output_ids") != c.get("output_ids")
            ]
            if errors or wrong:
                raise SystemExit(f"round {rnd}: errors {errors} / outputs differing {wrong}")
            n = d["kvguard_requests_recomputed_total"]
            rounds.append(
                {
                    "round": rnd,
                    "recomputes": n,
                    "aborts": d["kvguard_requests_aborted_total"],
                    "tokens_recomputed": d["kvguard_tokens_recomputed_total"],
                    "recompute_seconds": d["kvguard_recompute_seconds_total"],
                    "seconds_per_recompute": d["kvguard_recompute_seconds_total"] / n
                    if n
                    else None,
                    "ms_per_token": 1e3
                    * d["kvguard_recompute_seconds_total"]
                    / d["kvguard_tokens_recomputed_total"]
                    if d["kvguard_tokens_recomputed_total"]
                    else None,
                    "healed_requests": len(healed),
                    "healed_added_seconds": [
                        round(f["seconds"] - c["seconds"], 3) for c, f in healed
                    ],
                    "clean_request_seconds_median": statistics.median(c["seconds"] for c in clean),
                }
            )
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        srv.stop()
    total = {
        k: sum(r[k] for r in rounds)
        for k in ("recomputes", "tokens_recomputed", "recompute_seconds")
    }
    added = [x for r in rounds for x in r["healed_added_seconds"]]
    summary = {
        "args": vars(a) | {"out": str(a.out) if a.out else None, "server": args},
        "rounds": rounds,
        "recomputes": total["recomputes"],
        "seconds_per_recompute": total["recompute_seconds"] / total["recomputes"]
        if total["recomputes"]
        else None,
        "ms_per_token_recomputed": 1e3 * total["recompute_seconds"] / total["tokens_recomputed"]
        if total["tokens_recomputed"]
        else None,
        "healed_added_seconds_median": statistics.median(added) if added else None,
        "clean_request_seconds_median": statistics.median(
            r["clean_request_seconds_median"] for r in rounds
        ),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

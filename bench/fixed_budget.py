"""FP8 KV at a fixed memory budget (issue 32, item 1): the same KV bytes as a BF16 pool and as an
FP8 pool, long-context requests at rising concurrency, guard off and on, in one run.

The budget is what a BF16 pool of ``--bf16-tokens`` tokens takes; the FP8 pool gets the tokens
the same bytes hold, from the pool layouts (``kv_bytes_per_token``: MHA K+V; an MLA latent row;
a DSA latent row in SGLang's FP8 scaled layout plus the index keys every DSA pool keeps in FP8;
they equal what bench/quant*.py measure on SGLang's own pools: 2.000x, 2.000x, 1.316x for the
embedded models). On CPU ``kvguard-serve`` sizes the pool by ``--max-total-tokens``; SGLang's
GPU sizing divides a byte budget by the same bytes per token. Each dtype gets one server; the
guard's mode is switched between rounds (``KVGUARD_MODE_FILE``: ``off`` vs the default
``verified``), so both modes see the same server. A round sends ``c`` streamed requests at once
and records, per request, the time to its first token (queueing included) and to its last, and
SGLang's retraction count; during the round ``sglang:num_running_reqs`` is sampled for the peak
admitted concurrency.

    python -m kvguard.bench.fixed_budget [--embedded-model default|kimi|glm]
        [--bf16-tokens 18432] [--prompt-tokens 512] [--max-new-tokens 64]
        [--concurrency 16,32,64] [--rounds 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import aiohttp

from kvguard.bench.guard import pct, start_server, workload

DSA_INDEX_BYTES = 128 + 4  # per indexer layer and token: FP8 key + fp32 scale, in every pool
FP8_BLOCK = 128  # SGLang's FP8 DSA row: one fp32 scale per 128 latent values


def kv_bytes_per_token(config: dict, dtype: str) -> int:
    """KV bytes one token takes over all layers in a ``dtype`` ("bf16" / "fp8") pool."""
    layers = int(config["num_hidden_layers"])
    if config.get("kv_lora_rank"):
        latent, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
        if config.get("index_topk"):  # DSA: SGLang's FP8 row keeps the rope part in bf16
            row = (
                (latent + rope) * 2
                if dtype == "bf16"
                else latent + latent // FP8_BLOCK * 4 + rope * 2
            )
            return layers * (row + DSA_INDEX_BYTES)
        return layers * (latent + rope) * (2 if dtype == "bf16" else 1)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return layers * 2 * kv_heads * head_dim * (2 if dtype == "bf16" else 1)


async def _stream(session, url, prompt, max_new_tokens, t0):
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    first = last = None
    meta: dict = {}
    async with session.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            meta = json.loads(line[5:])["meta_info"]
            now = time.perf_counter() - t0
            first = now if first is None else first
            last = now
    return {
        "ttft": first,
        "latency": last,
        "tokens": meta.get("completion_tokens", 0),
        "retractions": meta.get("num_retractions", 0) or 0,
    }


def _peak_running(srv, stop: threading.Event, peak: list[float]) -> None:
    while not stop.is_set():
        try:
            running = srv.metric_totals().get("sglang:num_running_reqs", 0.0)
            peak[0] = max(peak[0], running)
        except Exception:
            pass
        stop.wait(0.2)


def run_round(srv, prompts, max_new_tokens) -> dict:
    peak, stop = [0.0], threading.Event()
    sampler = threading.Thread(target=_peak_running, args=(srv, stop, peak), daemon=True)
    sampler.start()

    async def go():
        timeout = aiohttp.ClientTimeout(total=1800)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            t0 = time.perf_counter()
            reqs = [_stream(session, srv.url, p, max_new_tokens, t0) for p in prompts]
            out = await asyncio.gather(*reqs)
            return out, time.perf_counter() - t0

    try:
        out, wall = asyncio.run(go())
    finally:
        stop.set()
        sampler.join()
    ttft = [o["ttft"] for o in out]
    latency = [o["latency"] for o in out]
    return {
        "tok_s": sum(o["tokens"] for o in out) / wall,
        "seconds": wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p95": pct(ttft, 0.95),
        "latency_p95": pct(latency, 0.95),
        "retractions": sum(o["retractions"] for o in out),
        "peak_running": peak[0],
    }


def _median(rounds: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--embedded-model", default="default", choices=["default", "kimi", "glm"])
    ap.add_argument("--bf16-tokens", type=int, default=18432)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="16,32,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="off,verified")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from kvguard.serve.cli import _embedded_model

    model = _embedded_model(a.embedded_model)
    config = json.loads((model / "config.json").read_text())
    per_token = {d: kv_bytes_per_token(config, d) for d in ("bf16", "fp8")}
    budget = a.bf16_tokens * per_token["bf16"]
    levels = [int(c) for c in a.concurrency.split(",")]
    modes = a.modes.split(",")
    page = 64 if config.get("index_topk") else 16
    prompts_all = workload(max(levels), a.prompt_tokens)
    results: dict = {
        "model": a.embedded_model,
        "budget_bytes": budget,
        "bytes_per_token": per_token,
        "prompt_tokens": a.prompt_tokens,
        "max_new_tokens": a.max_new_tokens,
        "cells": [],
    }
    work = Path(tempfile.mkdtemp(prefix="kvguard-fixed-budget-"))
    for dtype in ("bf16", "fp8"):
        tokens = budget // per_token[dtype] // page * page
        mode_file = work / f"mode-{dtype}"
        mode_file.write_text(modes[0])
        args = [
            "--embedded-model", a.embedded_model, "--kv-cache-dtype",
            "bfloat16" if dtype == "bf16" else "fp8_e4m3", "--max-total-tokens", str(tokens),
            "--page-size", str(page),
        ]  # fmt: skip
        srv = start_server("verified", args, work, mode_file)
        try:
            for c in levels:
                rounds: dict[str, list[dict]] = {m: [] for m in modes}
                for r in range(a.rounds):
                    for m in modes if r % 2 == 0 else modes[::-1]:
                        mode_file.write_text(m)  # read by the scheduler at the flush below
                        assert srv.flush_cache()  # and every round starts from an empty cache
                        rounds[m].append(run_round(srv, prompts_all[:c], a.max_new_tokens))
                for m in modes:
                    cell = {"dtype": dtype, "pool_tokens": tokens, "concurrency": c, "mode": m}
                    cell.update(_median(rounds[m]))
                    results["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
        finally:
            srv.stop()
    if a.out:
        a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


def table(results: dict) -> str:
    rows = [
        "| KV | pool tokens | concurrency | guard | peak running | retractions | tok/s | "
        "TTFT p50 / p95 s | latency p95 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cells"]:
        rows.append(
            f"| {c['dtype']} | {c['pool_tokens']} | {c['concurrency']} | {c['mode']} | "
            f"{c['peak_running']:.0f} | {c['retractions']:.0f} | {c['tok_s']:.1f} | "
            f"{c['ttft_p50']:.2f} / {c['ttft_p95']:.2f} | {c['latency_p95']:.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())

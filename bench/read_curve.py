"""Verified reads over context length: the guard's cost per decode step against attention's own.

For a batch of requests each reading ``L`` tokens (1k to 32k), on the embedded default model's
KV geometry (4 layers, K and V of 2 heads x 64 FP8 bytes per token and layer) in a pool of
random slots, one decode step's attention is timed as ``torch_native`` runs it under kvguard:
per layer, the compact gather of K and V (FP8 -> BF16 table) and SGLang's SDPA per request.
Beside it:

* ``verified``: the same gathers with the checksum folded in, plus the read check after the
  last layer; the guard's cost is the difference, its share is against attention's own time;
* ``pre-forward full hash``: what a full check of every read token before the forward costs
  (the compiled token digest over the same rows, ``paranoid``'s read verification).

    python -m kvguard.bench.read_curve [--batch 16] [--contexts 1024,2048,...] [--reps 5]
        [--out bench/results/read-curve.json]

Median of ``reps`` timings each; one thread (a scheduler's share of these cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvguard.kernels import read_verify
from kvguard.kernels.guard_cpu import CpuKernels
from kvguard.kernels.guard_ref import page_tag
from kvguard.patches.cpu_fp8_kv import dequant_tables

LAYERS, KV_HEADS, HEAD_DIM, Q_HEADS = 4, 2, 64, 4


def _median_s(fn, reps: int) -> float:
    fn()  # first touch out
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def point(batch: int, context: int, reps: int, page_size: int = 16) -> dict:
    slots = batch * context + page_size
    g = torch.Generator().manual_seed(context)
    buffers = [
        torch.randint(0, 120, (slots, KV_HEADS, HEAD_DIM), dtype=torch.uint8, generator=g)
        for _ in range(2 * LAYERS)
    ]
    # each request's pages, scattered over the pool as an allocator leaves them
    pages = torch.randperm(slots // page_size, generator=g)[: batch * context // page_size]
    rows = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1).contiguous()
    lens = [context] * batch
    table = dequant_tables(1.0, 1.0, torch.bfloat16)[0]
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16, generator=g)

    def attention(hash_acc: torch.Tensor | None) -> None:
        for layer in range(LAYERS):
            kv = []
            for b in (2 * layer, 2 * layer + 1):
                kv.append(read_verify.gather_rows(buffers[b], rows, table, b, hash_acc))
            k, v = kv
            for r in range(batch):
                kr = k[r * context : (r + 1) * context].movedim(0, 1).unsqueeze(0)
                vr = v[r * context : (r + 1) * context].movedim(0, 1).unsqueeze(0)
                torch.nn.functional.scaled_dot_product_attention(
                    q[r : r + 1], kr, vr, enable_gqa=True
                )

    # the ledger arrays the read check reads (their values only decide the verdict, not its cost)
    num_pages = slots // page_size + 1
    digest = torch.zeros(num_pages, dtype=torch.int64)
    fill = torch.full((num_pages,), page_size, dtype=torch.int16)
    epoch = torch.arange(num_pages, dtype=torch.int64)
    per_req = pages.view(batch, -1)
    agg = torch.stack(
        [page_tag(epoch[p], torch.arange(p.numel())).sum() for p in per_req]
    ).contiguous()
    req_rows = torch.arange(batch, dtype=torch.int64)

    def verified() -> None:
        acc = torch.zeros(rows.numel(), dtype=torch.int64)
        attention(acc)
        read_verify.verify_reads(
            acc, rows, lens, req_rows, page_size, slots, digest, fill, epoch, agg
        )

    cpu = CpuKernels()
    positions = torch.arange(context, dtype=torch.int64).repeat(batch)

    def full_hash() -> None:
        cpu.token_digests(buffers, rows, positions)

    plain_s = _median_s(lambda: attention(None), reps)
    verified_s = _median_s(verified, reps)
    hash_s = _median_s(full_hash, reps)
    guard_s = max(0.0, verified_s - plain_s)
    return {
        "context": context,
        "batch": batch,
        "kv_bytes_read_per_step": rows.numel() * 2 * LAYERS * KV_HEADS * HEAD_DIM,
        "attention_ms": 1e3 * plain_s,
        "verified_attention_ms": 1e3 * verified_s,
        "verified_guard_ms": 1e3 * guard_s,
        "verified_share_of_attention": guard_s / plain_s,
        "pre_forward_full_hash_ms": 1e3 * hash_s,
        "full_hash_share_of_attention": hash_s / plain_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    points = []
    print(
        "| context per request | KV read per step | attention ms | verified: guard ms | share of "
        "attention | pre-forward full hash ms | share of attention |"
    )
    print("|---|---|---|---|---|---|---|")
    for ctx in (int(x) for x in a.contexts.split(",")):
        p = point(a.batch, ctx, a.reps)
        points.append(p)
        print(
            f"| {ctx} | {p['kv_bytes_read_per_step'] / 2**20:.0f} MiB | {p['attention_ms']:.2f} | "
            f"{p['verified_guard_ms']:.2f} | {100 * p['verified_share_of_attention']:.1f}% | "
            f"{p['pre_forward_full_hash_ms']:.2f} | {100 * p['full_hash_share_of_attention']:.1f}% |",
            flush=True,
        )
    if a.out:
        Path(a.out).write_text(json.dumps({"points": points, "args": vars(a)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Microbenchmark: KV token checksum throughput vs plain copies of the same bytes.

    python -m kvguard.bench.checksum [--layers 4] [--slots 65536]
        [--heads 2] [--head-dim 64] [--tokens N] [--repeats 5] [--threads T]

Pool: layers x (K, V) x [slots, heads, head_dim] bf16. Tokens: a random
permutation of ``--tokens`` slots (default: all of them), positions 0..N-1.
GB/s counts the KV bytes read (N x sum of row bytes). Baselines:
  gather  = index_select of the same rows into a preallocated buffer,
  copy_   = torch.Tensor.copy_ of an already-gathered contiguous tensor.
On CPU: the compiled C kernel (the guard's CPU path) and the torch reference;
on CUDA (if present) the Triton kernel.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvguard.kernels.kv_checksum import HAVE_TRITON, token_digests
from kvguard.kernels.kv_checksum_ref import token_digests_ref


def _time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run(
    device: str, layers: int, slots_n: int, heads: int, head_dim: int, tokens: int, repeats: int
):
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    bufs = [
        torch.randn(slots_n, heads, head_dim, generator=g).to(torch.bfloat16).to(dev)
        for _ in range(2 * layers)
    ]
    slots = torch.randperm(slots_n, generator=g)[:tokens].to(dev)
    pos = torch.arange(tokens, device=dev)
    nbytes = tokens * sum(b[0].numel() * b.element_size() for b in bufs)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    digests = []
    if dev.type == "cuda":
        digests.append(("token_digests (triton)", lambda: token_digests(bufs, slots, pos)))
    else:
        try:
            from kvguard.kernels.guard_cpu import CpuKernels

            cpu = CpuKernels()
            digests.append(
                ("token_digests (compiled C)", lambda: cpu.token_digests(bufs, slots, pos))
            )
        except ImportError:
            pass
        digests.append(("token_digests_ref (torch)", lambda: token_digests_ref(bufs, slots, pos)))

    gathered = [
        torch.empty((tokens,) + tuple(b.shape[1:]), dtype=b.dtype, device=dev) for b in bufs
    ]

    def gather():
        for b, o in zip(bufs, gathered):
            torch.index_select(b, 0, slots, out=o)

    gather()
    dst = [torch.empty_like(x) for x in gathered]

    def copy():
        for s, d in zip(gathered, dst):
            d.copy_(s)

    res = {}
    for label, fn in [
        *digests,
        ("gather (index_select)", gather),
        ("copy_ (contiguous)", copy),
    ]:
        t = _time(fn, repeats, sync)
        res[label] = nbytes / t / 1e9
    print(
        f"[{device}] pool {layers} layers x K,V x [{slots_n}, {heads}, {head_dim}] bf16, "
        f"{tokens} tokens, {nbytes / 2**20:.1f} MiB read, threads={torch.get_num_threads()}"
    )
    for label, gbs in res.items():
        print(f"  {label:28s} {gbs:8.2f} GB/s")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tokens = a.tokens or a.slots
    run("cpu", a.layers, a.slots, a.heads, a.head_dim, tokens, a.repeats)
    if torch.cuda.is_available() and HAVE_TRITON:
        run("cuda", a.layers, a.slots, a.heads, a.head_dim, tokens, max(a.repeats, 20))


if __name__ == "__main__":
    main()

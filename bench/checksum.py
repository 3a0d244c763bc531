"""Microbenchmark: KV token checksum throughput vs plain copies of the same bytes.

    python -m kvguard.bench.checksum [--layers 4] [--slots 65536]
        [--heads 2] [--head-dim 64] [--tokens N] [--repeats 5] [--threads T]
        [--device all|cpu|cuda] [--sweep]

Pool: layers x (K, V) x [slots, heads, head_dim] bf16. Tokens: a random
permutation of ``--tokens`` slots (default: all of them), positions 0..N-1.
GB/s counts the KV bytes read (N x sum of row bytes). Baselines:
  gather  = index_select of the same rows into a preallocated buffer,
  copy_   = torch.Tensor.copy_ of an already-gathered contiguous tensor.
On CPU: the compiled C kernel (the guard's CPU path) and the torch reference;
on CUDA (if present): the guard's fused Triton checksum (every layer in one launch, as the seal
and the read checks hash; ``--sweep`` also times other tokens-per-program and buffer-group
settings), the per-buffer Triton kernel, and the copy bandwidth counted both ways: bytes read
(comparable with a gather) and bytes read + written (the device's copy bandwidth, the issue's
yardstick for a checksum that only reads). ``--device`` picks one (default: both, as before).
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
    device: str,
    layers: int,
    slots_n: int,
    heads: int,
    head_dim: int,
    tokens: int,
    repeats: int,
    sweep: bool = False,
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
        from kvguard.kernels.guard_triton import TritonKernels

        fused = TritonKernels()
        digests.append(("guard checksum (fused)", lambda: fused.token_digests(bufs, slots, pos)))
        for bt, groups in [(16, None), (64, None), (32, 2), (32, 8)] if sweep else []:
            k = TritonKernels(buffer_groups=groups, block_tokens=bt)
            digests.append((f"  fused, {bt} tok/prog, groups {groups or 'auto'}",
                            lambda k=k: k.token_digests(bufs, slots, pos)))  # fmt: skip
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

    if dev.type == "cuda":  # the fused checksum must equal the reference (one check, untimed)
        want = token_digests_ref([b[: min(slots_n, 4096)].cpu() for b in bufs],
                                 slots[:2048].cpu() % min(slots_n, 4096), pos[:2048].cpu())  # fmt: skip
        got = fused.token_digests(bufs, slots[:2048] % min(slots_n, 4096), pos[:2048])
        if not torch.equal(got.cpu(), want):
            raise SystemExit("the fused Triton checksum differs from the reference")
    res = {}
    for label, fn in [
        *digests,
        ("gather (index_select)", gather),
        ("copy_ (contiguous)", copy),
    ]:
        t = _time(fn, repeats, sync)
        res[label] = nbytes / t / 1e9
        if label.startswith("copy_") and dev.type == "cuda":
            res["copy_ (read + written)"] = 2 * nbytes / t / 1e9
    print(
        f"[{device}] pool {layers} layers x K,V x [{slots_n}, {heads}, {head_dim}] bf16, "
        f"{tokens} tokens, {nbytes / 2**20:.1f} MiB read, threads={torch.get_num_threads()}"
    )
    width = 36 if dev.type == "cuda" else 28
    for label, gbs in res.items():
        print(f"  {label:{width}s} {gbs:8.2f} GB/s")
    if dev.type == "cuda":
        best = max(v for k, v in res.items() if "fused" in k)
        print(
            f"  fused checksum / copy (read + written): {best / res['copy_ (read + written)']:.2f}"
        )
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
    ap.add_argument("--device", choices=("all", "cpu", "cuda"), default="all")
    ap.add_argument("--sweep", action="store_true", help="CUDA: other fused-kernel settings too")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tokens = a.tokens or a.slots
    if a.device in ("all", "cpu"):
        run("cpu", a.layers, a.slots, a.heads, a.head_dim, tokens, a.repeats)
    if a.device == "cuda" and not (torch.cuda.is_available() and HAVE_TRITON):
        raise SystemExit("--device cuda: no CUDA device (or no triton)")
    if a.device in ("all", "cuda") and torch.cuda.is_available() and HAVE_TRITON:
        run("cuda", a.layers, a.slots, a.heads, a.head_dim, tokens, max(a.repeats, 20), a.sweep)


if __name__ == "__main__":
    main()

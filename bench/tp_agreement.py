"""What one step's TP agreement costs: the guard's verdict words OR-reduced over a gloo group of
two processes (as SGLang's CPU group between two tensor-parallel schedulers), through the
adapter's own ``SchedulerPeers``. CPU time of the calling thread and wall time per agreement.

    python -m kvguard.bench.tp_agreement [--batch 16] [--iters 1000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvguard.patches.peers import SchedulerPeers


def _rank(rank: int, port: int, batch: int, iters: int) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peers = SchedulerPeers(dist.group.WORLD)
    words = torch.zeros(batch + 1, dtype=torch.int64)
    for _ in range(50):
        peers.or_words(words)
    c0, w0 = time.thread_time(), time.perf_counter()
    for _ in range(iters):
        peers.or_words(words)
    c1, w1 = time.thread_time(), time.perf_counter()
    if rank == 0:
        print(
            f"agreement of {batch + 1} words over 2 ranks: "
            f"{1e6 * (c1 - c0) / iters:.1f} us CPU, {1e6 * (w1 - w0) / iters:.1f} us wall",
            flush=True,
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--iters", type=int, default=1000)
    a = ap.parse_args(argv)
    from kvguard.serve.child import free_port

    mp.spawn(_rank, args=(free_port(), a.batch, a.iters), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

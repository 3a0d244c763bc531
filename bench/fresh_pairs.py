"""Fresh servers, alternating: ``kvguard-serve --kvguard-mode off`` (started off: none of the
guard's hooks) against the default mode, same arguments; per server a warm-up, then ``rounds``
rounds of 16 streamed requests (about 40 tokens in, 64 out): tok/s, p95 request latency and the
server process tree's CPU ms per token. Pairs alternate which server starts first.

    python -m kvguard.bench.fresh_pairs [--pairs 2] [--rounds 3] [--out F] [-- kvguard-serve args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from kvguard.bench.guard import pct, run_round, server_cpu_seconds, workload
from kvguard.serve.child import ServeProcess

MODES = ("off", "verified")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="write every round as JSON here")
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="for kvguard-serve, after --")
    a = ap.parse_args(argv)
    extra = [x for x in a.server_args if x != "--"]
    work = Path(tempfile.mkdtemp(prefix="kvguard-pairs-"))
    prompts = workload(16)
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    for p in range(a.pairs):
        for mode in MODES if p % 2 == 0 else MODES[::-1]:
            srv = ServeProcess(["--kvguard-mode", mode, *extra], work / f"server-{mode}.log")
            srv.start(timeout_s=900)
            try:
                asyncio.run(run_round(srv.url, prompts[:4], 8))  # first-touch costs out
                asyncio.run(run_round(srv.url, prompts, 16))
                for _ in range(a.rounds):
                    cpu0 = server_cpu_seconds(srv)
                    res = asyncio.run(run_round(srv.url, prompts, 64))
                    row = {
                        "pair": p,
                        "tok_s": res["tokens"] / res["seconds"],
                        "p95_s": pct(res["latency"], 0.95),
                        "cpu_ms_per_token": 1000
                        * (server_cpu_seconds(srv) - cpu0)
                        / max(res["tokens"], 1),
                    }
                    rounds[mode].append(row)
                    print(mode, json.dumps(row), flush=True)
            finally:
                srv.stop()

    def med(mode: str, key: str, pair: int | None = None) -> float:
        return statistics.median(r[key] for r in rounds[mode] if pair is None or r["pair"] == pair)

    for key in ("tok_s", "p95_s", "cpu_ms_per_token"):
        off, on = med("off", key), med("verified", key)
        print(f"{key}: off {off:.2f}, verified {on:.2f}, ratio {on / off:.3f}")
    per_pair = [med("verified", "tok_s", p) / med("off", "tok_s", p) for p in range(a.pairs)]
    print("tok/s ratio per pair:", [round(x, 3) for x in per_pair])
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What guarding a prefill/decode pair costs: TTFT, inter-token latency and tokens/s through the
router, guard off vs on, in one run; and the hand-off checks' own time per transfer.

One pair (``kvguard-serve --disaggregation-mode prefill`` and ``decode``, SGLang's router in
front) whose guard mode both servers read from one ``KVGUARD_MODE_FILE`` between rounds (``off``
there: the hooks stay installed and do nothing). Each round runs every mode once, in an order
rotated from round to round; a mode's run flushes both servers' caches (which resets their
ledgers and switches the mode), then streams the same greedy workload through the router and
records, per request, when it was sent and when each token arrived. Ratios are paired (a mode's
round against ``off``'s round), then the median over rounds. Before that, a pair started with
``--kvguard-mode off`` (no hooks at all) runs the same rounds alone: what the idle hooks cost.

The guard's time is read from each server's ``kvguard_check_seconds_total`` (all of its hooks)
and ``kvguard_transfer_check_seconds_total`` over ``kvguard_transfers_checked_total`` (the
hand-off checks: on the prefill, sealing what it sends; on the decode, claiming the slots and
checking what landed).

    python -m kvguard.bench.pd_cost [--rounds 6] [--concurrency 8] [--prompt-tokens 512]
        [--max-new-tokens 32] [--modes off,verified] [--out results.json] [-- kvguard-serve args]

A shared 2-core machine runs two schedulers that each busy-poll a core when idle: read the
paired medians, not single rounds.
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

from kvguard.bench.guard import MODES, pct, stream_tokens, workload
from kvguard.bench.rounds import NO_HOOKS, interleaved_rounds, server_args
from kvguard.serve.pd import PrefillDecodePair

COUNTERS = (
    "kvguard_check_seconds_total",
    "kvguard_transfer_check_seconds_total",
    "kvguard_transfers_checked_total",
    "kvguard_steps_checked_total",
)


class Pair(PrefillDecodePair):
    """Prefill, decode and router (``kvguard.serve.pd``), started; ``mode_file``: both servers
    follow its mode between rounds (None: a pair started with ``mode`` and no switch)."""

    def __init__(self, mode: str, args: list[str], work: Path, mode_file: Path | None):
        env = {"KVGUARD_MODE_FILE": str(mode_file)} if mode_file is not None else {}
        tag = "-nohooks" if mode_file is None else "-guarded"
        super().__init__(work, mode, args, env=env, tag=tag)
        self.start()

    def counters(self) -> dict[str, tuple[float, ...]]:
        out = {}
        for name, srv in (("prefill", self.prefill), ("decode", self.decode)):
            totals = srv.metric_totals()
            out[name] = tuple(totals.get(c, 0.0) for c in COUNTERS)
        return out

    def settled_counters(self, timeout_s: float = 5.0) -> dict[str, tuple[float, ...]]:
        """Read until two readings agree: schedulers flush their counters at most every 0.5 s."""
        last, deadline = self.counters(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = self.counters()
            if now == last:
                return now
            last = now
        return last


async def _stream(session, url, prompt, max_new_tokens):
    """One streamed greedy request (``bench.guard``'s): (sent at, [arrival time of each token])."""
    sent = time.perf_counter()
    times = await stream_tokens(session, url, prompt, max_new_tokens)
    assert len(times) == max_new_tokens, (len(times), max_new_tokens)
    return sent, times


async def run_round(url, prompts, max_new_tokens):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        t0 = time.perf_counter()
        got = await asyncio.gather(*[_stream(session, url, p, max_new_tokens) for p in prompts])
        wall = time.perf_counter() - t0
    return {
        "tokens": sum(len(times) for _, times in got),
        "seconds": wall,
        "ttft": [times[0] - sent for sent, times in got],
        "itl": [b - a for _, times in got for a, b in itertools.pairwise(times)],
    }


def summarize(results: dict[str, list], modes: list[str]) -> dict[str, dict]:
    summary: dict[str, dict] = {}
    for mode, rs in results.items():
        ttft = [x for r in rs for x in r["ttft"]]
        itl = [x for r in rs for x in r["itl"]]
        wall = sum(r["seconds"] for r in rs)
        s = {
            "tok_s": statistics.median(r["tokens"] / r["seconds"] for r in rs),
            "ttft_p50_ms": 1000 * pct(ttft, 0.5),
            "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "itl_p50_ms": 1000 * pct(itl, 0.5),
            "itl_p99_ms": 1000 * pct(itl, 0.99),
        }
        for side in ("prefill", "decode"):
            check, xfer_s, xfers, _steps = (sum(r[side][i] for r in rs) for i in range(4))
            s[side] = {
                "guard_share_of_wall": check / wall,
                "transfers_checked": xfers,
                "hand_off_ms_per_transfer": 1000 * xfer_s / xfers if xfers else None,
            }
        summary[mode] = s
    for mode in modes[1:]:  # off's own pairing is 1 by definition
        pairs = list(zip(results[mode], results["off"]))
        summary[mode]["paired"] = {
            "tok_s": statistics.median(
                (m["tokens"] / m["seconds"]) / (o["tokens"] / o["seconds"]) for m, o in pairs
            ),
            "tok_s_range": [
                min((m["tokens"] / m["seconds"]) / (o["tokens"] / o["seconds"]) for m, o in pairs),
                max((m["tokens"] / m["seconds"]) / (o["tokens"] / o["seconds"]) for m, o in pairs),
            ],
            "ttft_p50": statistics.median(
                pct(m["ttft"], 0.5) / pct(o["ttft"], 0.5) for m, o in pairs
            ),
            "ttft_p99": statistics.median(
                pct(m["ttft"], 0.99) / pct(o["ttft"], 0.99) for m, o in pairs
            ),
            "itl_p50": statistics.median(pct(m["itl"], 0.5) / pct(o["itl"], 0.5) for m, o in pairs),
            "itl_p99": statistics.median(
                pct(m["itl"], 0.99) / pct(o["itl"], 0.99) for m, o in pairs
            ),
        }
    return summary


def table(summary: dict[str, dict]) -> str:
    rows = [
        "| mode | tok/s | vs off (paired) [range] | TTFT p50 ms | vs off | TTFT p99 ms | vs off | "
        "ITL p50 ms | vs off | ITL p99 ms | vs off | guard share of wall, prefill / decode | "
        "hand-off check ms per transfer, prefill (seal) / decode (claim + landing) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for mode, s in summary.items():
        p = s.get("paired", {})
        ratio = {k: f"{v:.3f}" for k, v in p.items() if k != "tok_s_range"}
        tok = (
            f"{p['tok_s']:.3f} [{p['tok_s_range'][0]:.3f}, {p['tok_s_range'][1]:.3f}]" if p else ""
        )
        hand_off = {
            side: "-"
            if s[side]["hand_off_ms_per_transfer"] is None
            else f"{s[side]['hand_off_ms_per_transfer']:.3f} ({int(s[side]['transfers_checked'])})"
            for side in ("prefill", "decode")
        }
        rows.append(
            f"| {mode} | {s['tok_s']:.1f} | {tok} | {s['ttft_p50_ms']:.1f} | "
            f"{ratio.get('ttft_p50', '')} | {s['ttft_p99_ms']:.1f} | {ratio.get('ttft_p99', '')} | "
            f"{s['itl_p50_ms']:.2f} | {ratio.get('itl_p50', '')} | {s['itl_p99_ms']:.2f} | "
            f"{ratio.get('itl_p99', '')} | {100 * s['prefill']['guard_share_of_wall']:.2f}% / "
            f"{100 * s['decode']['guard_share_of_wall']:.2f}% | "
            f"{hand_off['prefill']} / {hand_off['decode']} |"
        )
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--modes", default="off,verified", help="guard modes to interleave")
    ap.add_argument("--no-baseline", action="store_true", help="skip the pair without hooks")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="kvguard-serve args after --")
    a = ap.parse_args(argv)
    extra = [x for x in a.server_args if x != "--"]
    extra = server_args(extra, a.concurrency * (a.prompt_tokens + a.max_new_tokens))
    modes = ["off"] + [m for m in a.modes.split(",") if m in MODES and m != "off"]
    work = Path(tempfile.mkdtemp(prefix="kvguard-pd-bench-"))
    prompts = workload(a.concurrency, a.prompt_tokens)
    results: dict[str, list] = {m: [] for m in ([] if a.no_baseline else [NO_HOOKS]) + modes}

    def measure(pair: Pair, mode: str, r: int) -> None:
        for srv in pair.servers:
            srv.flush_cache()  # an empty prefix cache and a reset ledger; the mode switches here
        before = pair.counters()
        res = asyncio.run(run_round(pair.router.url, prompts, a.max_new_tokens))
        after = pair.settled_counters()
        for side in ("prefill", "decode"):
            res[side] = tuple(y - x for x, y in zip(before[side], after[side]))
        results[mode].append(res)
        print(
            f"round {r + 1} {mode:9s} {res['tokens'] / res['seconds']:7.1f} tok/s  "
            f"TTFT p50 {1000 * pct(res['ttft'], 0.5):7.1f} ms  ITL p50 {1000 * pct(res['itl'], 0.5):6.2f} ms  "
            f"guard {100 * res['prefill'][0] / res['seconds']:.2f}% / {100 * res['decode'][0] / res['seconds']:.2f}% of wall  "
            f"transfers checked {int(res['prefill'][2])} / {int(res['decode'][2])}",
            flush=True,
        )

    interleaved_rounds(
        lambda mode, mode_file: Pair(mode, extra, work, mode_file),
        modes,
        a.rounds,
        measure,
        # first-touch costs out
        lambda pair: asyncio.run(run_round(pair.router.url, prompts[:2], 4)),
        work,
        guarded_mode="verified",
        baseline=not a.no_baseline,
    )
    summary = summarize(results, modes)
    print("\n" + table(summary))
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "args": vars(a)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

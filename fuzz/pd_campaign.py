"""A fault-injection campaign on a prefill/decode pair: the hand-off faults of ``pd_faults`` made
by SGLang's real transfer path, each arm a fresh pair on loopback, the same workload and schedule.

Arms (both servers alike):

- ``verified``: kvguard on both servers in its default mode (the hand-off seal compared on
  landing, every read verified);
- ``sglang-checksum``: kvguard off, SGLang's own ``--disaggregation-enable-kv-checksum`` on (an
  Adler-32 of each request's transferred pages, compared once as the request is admitted to
  decode; kvguard's host build of its digest on CPU, ``patches/pd_cpu.py``);
- ``off``: neither: what the faults do when nothing checks (the campaign's sensitivity).

Each arm runs the workload twice through the pair, routed by hand (the bootstrap fields posted
to both servers, as SGLang's router does, so that each request's room is known): clean (the
reference), then with the injection plan fed to the decode server's control file wave by wave.
Requests within a wave are sent in pairs, the two of a pair 20 ms apart (the second's transfer
is issued while the first's is in flight: ``transfer_wrong_room`` needs one) and the pairs
``stagger_s`` apart (later transfers are issued while earlier requests decode:
``transfer_into_reused`` needs a running request to reach).

Who a fault harmed (from the decode server's injection log): the request whose transfer it
changed is a **victim** (a page of its KV is not its KV: it must not be served); the other
request whose pages the transfer reached (``transfer_into_reused``: a running request;
``transfer_wrong_room``: one whose own transfer was in flight) is its **holder**: its KV was
overwritten if the transfer's bytes landed while it held those pages and after its own, so an
abort of it is no false abort and its served output is scored like any other. Per arm:

- **escapes**: answers (or streamed tokens before an abort) whose tokens differ from the clean
  run's; for a request no fault touched, a difference at a near tie of the clean run's two best
  tokens is not counted (numerical noise of another batch);
- **changed answers served**: answers (or streamed tokens) whose log-probabilities moved from
  the clean run's by more than ``LOGPROB_TOL``: wrong KV that reached a client even where the
  tiny model's greedy tokens survived it (the embedded model on CPU is bit-exact across batch
  compositions: untouched requests move by 0);
- **victims served**: victims answered in full (from wrong KV, whatever their tokens);
- **false aborts**: aborted requests that no fault touched (clean pass included);
- **servers alive** at the end.

    python -m kvguard.fuzz.pd_campaign --out runs/pd [--requests 48] [--injections 12]
        [--arms verified,sglang-checksum,off] [--classes ...] [--seed 0] [-- kvguard-serve args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from kvguard.fuzz.client import REQUEST_TIMEOUT_S, Response, one_request, request_body
from kvguard.fuzz.oracle import TIE_MARGIN, compare, compare_stream, read_jsonl
from kvguard.fuzz.pd_faults import PD_CLASSES
from kvguard.fuzz.workload import RequestSpec, Wave, build_workload
from kvguard.serve.child import ServerDied
from kvguard.serve.pd import PrefillDecodePair

# arm -> (kvguard mode of both servers, more arguments of both)
ARMS = {
    "verified": ("verified", []),
    "sglang-checksum": ("off", ["--disaggregation-enable-kv-checksum"]),
    "off": ("off", []),
}
SERVER_ARGS = ["--page-size", "16", "--max-total-tokens", "4096", "--log-format", "json"]
ROOMS = {"c": 1_000_000_000, "i": 2_000_000_000}  # a pass's bootstrap rooms: base + request index
LOGPROB_TOL = 1e-3  # nats: a served answer that moved more read something else


@dataclass(frozen=True, slots=True)
class Settings:
    out: Path
    seed: int = 0
    num_requests: int = 48
    num_injections: int = 12
    classes: tuple[str, ...] = PD_CLASSES
    arms: tuple[str, ...] = tuple(ARMS)
    wave_size: int = 8
    stream_fraction: float = 0.5
    stagger_s: float = 0.4  # between two pairs of requests of a wave
    server_args: tuple[str, ...] = ()


class Pair(PrefillDecodePair):
    """A prefill and a decode kvguard-serve of one arm (``kvguard.serve.pd``), routed by hand;
    the decode server carries the fuzz plugin (``control``: its plan file, ``log``: what it
    injected)."""

    def __init__(self, s: Settings, arm: str, work: Path):
        mode, extra = ARMS[arm]
        self.control, self.log = work / "control.json", work / "injections.jsonl"
        self.control.write_text(json.dumps({"plan": []}))
        self.log.unlink(missing_ok=True)
        super().__init__(
            work,
            mode,
            SERVER_ARGS + extra + list(s.server_args),
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            decode_env={
                "KVGUARD_FUZZ_CONTROL": str(self.control),
                "KVGUARD_FUZZ_LOG": str(self.log),
            },
            router=False,
        )

    def bootstrap(self, prefix: str, index: int) -> dict:
        return {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": ROOMS[prefix] + index,
        }


async def _pd_request(session, pair: Pair, spec: RequestSpec, prefix: str, index: int, delay):
    """One request routed by hand: its body, with the bootstrap fields, posted to the prefill
    (its answer only says the prefill ran) and to the decode server (the completion)."""
    await asyncio.sleep(delay)
    extra = pair.bootstrap(prefix, index)
    body = request_body(spec, f"{prefix}-{spec.key}", False, extra)  # as the decode's, unstreamed
    pre = asyncio.ensure_future(session.post(f"{pair.prefill.url}/generate", json=body))
    got = await one_request(session, pair.decode.url, spec, prefix, extra)
    try:
        async with await pre as r:
            await r.read()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        pass  # the decode server's answer is the request's outcome
    return got


async def _wave(pair: Pair, specs: list[tuple[int, RequestSpec]], prefix: str, stagger: float):
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        jobs = [
            _pd_request(s, pair, spec, prefix, i, (j // 2) * stagger + (j % 2) * 0.02)
            for j, (i, spec) in enumerate(specs)
        ]
        return list(await asyncio.gather(*jobs))


def workload(s: Settings) -> list[Wave]:
    """The fuzz workload (multi-turn conversations share prefixes: the prefill's prefix cache
    serves them), its client drops removed (a dropped stream has no outcome to score), and the
    injection plan: ``num_injections`` entries of ``classes`` in turn, spread over the waves."""
    waves = build_workload(s.seed, s.num_requests, s.wave_size, stream_fraction=s.stream_fraction)
    for w in waves:
        w.requests = [replace(spec, cancel_after_chunks=None) for spec in w.requests]
    rng = random.Random(f"kvguard-pd-campaign-{s.seed}")
    for k in range(s.num_injections):
        wave = waves[rng.randrange(len(waves))]
        wave.injections.append({"id": k + 1, "cls": s.classes[k % len(s.classes)]})
    return waves


def run_arm(s: Settings, arm: str, waves: list[Wave]) -> dict:
    work = s.out / arm
    work.mkdir(parents=True, exist_ok=True)
    pair = Pair(s, arm, work)
    res: dict = {"arm": arm, "mode": ARMS[arm][0], "extra_args": ARMS[arm][1]}
    index = {spec.key: i for i, spec in enumerate(r for w in waves for r in w.requests)}
    passes: dict[str, list[Response]] = {}
    try:
        pair.start()
        plan: list[dict] = []
        for prefix in ("c", "i"):
            got: list[Response] = []
            t0 = time.monotonic()
            for w in waves:
                if prefix == "i" and w.injections:
                    plan += w.injections
                    pair.control.write_text(json.dumps({"plan": plan}))
                specs = [(index[spec.key], spec) for spec in w.requests]
                got += asyncio.run(_wave(pair, specs, prefix, s.stagger_s))
                if not pair.alive():
                    raise ServerDied(f"{arm}: a server died in wave {w.index}")
            seconds = time.monotonic() - t0
            tokens = sum(r.completion_tokens or 0 for r in got if r.status == 200)
            res[f"{prefix}_seconds"] = round(seconds, 1)
            res[f"{prefix}_tokens_per_s"] = round(tokens / seconds, 2)
            passes[prefix] = got
            (work / f"{prefix}.jsonl").write_text(
                "".join(json.dumps(r.as_dict()) + "\n" for r in got)
            )
        res["alive"] = pair.alive()
    except ServerDied as e:
        res["error"], res["alive"] = str(e)[-2000:], False
    finally:
        pair.stop()
    if len(passes) == 2:
        res.update(judge(passes["c"], passes["i"], read_jsonl(pair.log)))
    return res


def _aborted(r: Response) -> bool:
    return r.status != 200 or r.finish_reason == "abort" or r.stream_end in ("abort", "error")


def _detector(r: Response) -> str:
    text = r.error or ""
    if r.violation:
        return "kvguard"
    if "KV checksum mismatch" in text:
        return "sglang-checksum"
    return "other"


def _moved(ref_top2: list, top2: list) -> float:
    """The most the best token's log-probability moved at a position both were sent (inf where
    the best token differs)."""
    moved = 0.0
    for a, b in zip(ref_top2, top2):
        if bool(a) != bool(b):  # one of them NaN (logits from garbage KV)
            return float("inf")
        if a and b:
            moved = max(moved, abs(a[0] - b[0]) if a[1] == b[1] else float("inf"))
    return moved


def judge(clean: list[Response], injected: list[Response], events: list[dict]) -> dict:
    """Score the injected pass against the clean one (module docstring)."""
    reference = {r.key: (r.output_ids, r.top2) for r in clean if not _aborted(r)}
    landed = [e for e in events if e.get("event") == "injected"]
    victims = {e["detail"]["rid"]: e["cls"] for e in landed}
    # the other request a transfer reached, unless a fault of its own made it a victim already
    holders = {e["detail"]["holder_rid"] for e in landed if "holder_rid" in e["detail"]}
    holders -= victims.keys()
    out: dict = {
        "injections_landed": len(landed),
        "landed_by_class": dict(Counter(e["cls"] for e in landed)),
        "injector_errors": sum(1 for e in events if e.get("event") == "injector_error"),
        "clean_aborts": sorted(r.rid for r in clean if _aborted(r)),
        "victims": len(victims),
        "victims_aborted": 0,
        "victims_served": [],
        "holders": len(holders),
        "holders_aborted": 0,
        "false_aborts": [],
        "escapes": [],
        "changed_served": [],
        "near_ties": [],
        "aborted_by": Counter(),
    }
    for r in injected:
        role = "victim" if r.rid in victims else "holder" if r.rid in holders else "bystander"
        aborted = _aborted(r)
        if aborted:
            out["aborted_by"][_detector(r)] += 1
            if role == "victim":
                out["victims_aborted"] += 1
            elif role == "holder":
                out["holders_aborted"] += 1
            else:
                out["false_aborts"].append(r.rid)
        elif role == "victim":
            out["victims_served"].append(r.rid)
        ref = reference.get(r.key)
        if ref is None or (aborted and not r.streamed):
            continue  # no reference, or nothing reached the client
        if r.streamed:
            sent = (r.stream_ids or [], r.stream_top2 or [])
            verdict, where = compare_stream(ref, sent, True, r.stream_rewrites, TIE_MARGIN)
        else:
            sent = (r.output_ids or [], r.top2 or [])
            verdict, where = compare(ref, sent, TIE_MARGIN)
        if verdict == "escaped" or (verdict == "near_tie" and role != "bystander"):
            out["escapes"].append({"rid": r.rid, "role": role, **where})
        elif verdict == "near_tie":
            out["near_ties"].append(r.rid)
        moved = _moved(ref[1] or [], sent[1])
        if moved > LOGPROB_TOL:
            nats = round(moved, 4) if moved != float("inf") else "best token differs"
            out["changed_served"].append({"rid": r.rid, "role": role, "nats": nats})
    out["aborted_by"] = dict(out["aborted_by"])
    return out


def _changed(r: dict) -> str:
    roles = Counter(c["role"] for c in r.get("changed_served", []))
    return f"{len(r.get('changed_served', []))} ({roles['victim']}, {roles['holder']}, {roles['bystander']})"


def report_md(s: Settings, results: list[dict]) -> str:
    cols = [
        ("injections landed", lambda r: r.get("injections_landed")),
        ("victims", lambda r: r.get("victims")),
        ("victims aborted", lambda r: r.get("victims_aborted")),
        ("victims served (wrong KV)", lambda r: len(r.get("victims_served", []))),
        ("holders (aborted)", lambda r: f"{r.get('holders')} ({r.get('holders_aborted')})"),
        ("escapes (wrong tokens to a client)", lambda r: len(r.get("escapes", []))),
        ("changed answers served (victims, holders, others)", _changed),
        (
            "false aborts (clean pass)",
            lambda r: f"{len(r.get('false_aborts', []))} ({len(r.get('clean_aborts', []))})",
        ),
        ("servers alive", lambda r: r.get("alive")),
        (
            "tok/s, clean / injected pass (aborted requests add none)",
            lambda r: f"{r.get('c_tokens_per_s')} / {r.get('i_tokens_per_s')}",
        ),
    ]
    lines = [
        "# PD campaign",
        "",
        f"`python -m kvguard.fuzz.pd_campaign --out {s.out} --seed {s.seed} --requests "
        f"{s.num_requests} --injections {s.num_injections} --classes {','.join(s.classes)} --arms "
        f"{','.join(s.arms)}`",
        "",
        "| | " + " | ".join(r["arm"] for r in results) + " |",
        "| --- |" + " --- |" * len(results),
    ]
    for name, get in cols:
        lines.append(f"| {name} | " + " | ".join(str(get(r)) for r in results) + " |")
    lines.append("")
    for r in results:
        if r.get("error"):
            lines.append(f"- {r['arm']}: {r['error'].splitlines()[0]}")
        lines.append(
            f"- {r['arm']}: landed by class {r.get('landed_by_class')}, aborted by {r.get('aborted_by')}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        prog="python -m kvguard.fuzz.pd_campaign", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--injections", type=int, default=12)
    p.add_argument("--classes", default=",".join(PD_CLASSES))
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--wave-size", type=int, default=8)
    a = p.parse_args(argv)
    classes = tuple(c for c in a.classes.split(",") if c)
    arms = tuple(x for x in a.arms.split(",") if x)
    bad = [c for c in classes if c not in PD_CLASSES] + [x for x in arms if x not in ARMS]
    if bad:
        p.error(f"unknown class or arm: {bad} (classes: {PD_CLASSES}; arms: {tuple(ARMS)})")
    s = Settings(
        a.out,
        a.seed,
        a.requests,
        a.injections,
        classes,
        arms,
        a.wave_size,
        server_args=tuple(serve_args),
    )
    s.out.mkdir(parents=True, exist_ok=True)
    results = []
    for arm in arms:
        results.append(run_arm(s, arm, workload(s)))
        print(
            json.dumps(
                {k: v for k, v in results[-1].items() if k not in ("escapes",)}, default=str
            ),
            flush=True,
        )
    (s.out / "report.json").write_text(json.dumps(results, indent=1, default=str))
    (s.out / "report.md").write_text(report_md(s, results))
    print(report_md(s, results))
    guarded = [r for r in results if r["arm"] != "off"]
    return 0 if all(r.get("alive") for r in guarded) else 1


if __name__ == "__main__":
    sys.exit(main())

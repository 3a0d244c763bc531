"""``kvguard-fuzz`` / ``python -m kvguard.fuzz``: run a fault-injection campaign against
kvguard-serve and write report.json, report.md and report.png.

Example (a few minutes)::

    kvguard-fuzz --seed 1 --guard-mode paranoid --page-size 16 --requests 100 --injections 10 \\
        --out runs/fuzz-1

A streaming campaign with bit flips before and inside the forward, the guard-off arm beside
the default mode, and read sets past the sampled budget::

    kvguard-fuzz --seed 1 --guard-mode default --off-arm --stream --large-reads \\
        --classes exponent_flip,in_forward_flip,bit_flip --requests 100 --injections 16

Guarded servers heal a request whose KV went bad (``--on-violation recompute``, the default:
modes verified and paranoid) or abort it (``--on-violation abort``).
"""

from __future__ import annotations

import argparse
import platform
import shlex
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from kvguard.fuzz.campaign import MODES, ON_VIOLATION, Runner, Settings
from kvguard.fuzz.injectors import INJECTORS, POOL_CLASSES
from kvguard.fuzz.oracle import TIE_MARGIN, UNGUARDED, compare
from kvguard.fuzz.report import write_all
from kvguard.fuzz.workload import TENANT_CLASSES, build_workload, schedule_injections


def _list(values: list[str] | None, cast=str) -> list:
    out = []
    for v in values or []:
        out += [cast(x.strip()) for x in v.split(",") if x.strip()]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvguard-fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="workload and injection schedule seed")
    p.add_argument(
        "--classes",
        action="append",
        help="bug classes to inject, comma list (default: all the model's pool can take; "
        + ", ".join(POOL_CLASSES)
        + " on DSA models only): "
        + ", ".join(INJECTORS),
    )
    p.add_argument("--requests", type=int, default=200, help="requests per pass per configuration")
    p.add_argument("--injections", type=int, default=20, help="injections per configuration")
    p.add_argument(
        "--guard-mode",
        action="append",
        help=f"{'|'.join(MODES)}, each at every --page-size, or MODE@PS at one; repeat or comma "
        "list (default: paranoid)",
    )
    p.add_argument(
        "--page-size",
        action="append",
        help="SGLang page sizes, e.g. 1, 16, 64; repeat or comma list (default 16)",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="output directory (default runs/fuzz-<seed>)"
    )
    p.add_argument("--model-path", help="model directory (default: kvguard-serve's embedded model)")
    p.add_argument(
        "--wave-size", type=int, default=24, help="concurrent requests per wave (~2/3..4/3 of it)"
    )
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size (default 2048, small: eviction, retraction; 65536 with --large-reads)",
    )
    p.add_argument(
        "--chunked-prefill-size", type=int, default=None, help="default 64 (512 with --large-reads)"
    )
    p.add_argument(
        "--canary-sweep-interval",
        type=int,
        default=8,
        help="--kv-canary-sweep-interval (mode canary)",
    )
    p.add_argument(
        "--max-tries",
        type=int,
        default=80,
        help="scheduler steps an injection waits for a fitting moment",
    )
    p.add_argument(
        "--max-deaths", type=int, default=3, help="server deaths after which a configuration stops"
    )
    p.add_argument(
        "--tie-margin",
        type=float,
        default=TIE_MARGIN,
        help="nats: a first divergence where both runs' two best tokens are this close is a "
        "near tie (rounding noise), not an escape",
    )
    p.add_argument(
        "--tenant-isolation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve with --kvguard-tenant-isolation and give the workload tenants (prefix-cache "
        "namespaces); default: on when a tenant class (" + ", ".join(TENANT_CLASSES) + ") runs",
    )
    p.add_argument(
        "--stream",
        type=float,
        nargs="?",
        const=1.0,
        default=0.0,
        metavar="FRACTION",
        help="stream this share of the requests (SSE; default with the flag: all): every token "
        "a client is sent is scored, and one that differs from the clean run's is an escape "
        "even if the guard aborts the request afterwards",
    )
    p.add_argument(
        "--long-prompts",
        type=float,
        default=None,
        metavar="FRACTION",
        help="give this share of the requests a long prompt (--long-prompt-tokens)",
    )
    p.add_argument(
        "--long-prompt-tokens",
        default="1500-3000",
        metavar="LO-HI",
        help="a long prompt's tokens, counted with the model's tokenizer, clamped to its context "
        "(default 1500-3000)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="serve with this --context-length (may exceed the model's own: RoPE extrapolates)",
    )
    p.add_argument(
        "--large-reads",
        action="store_true",
        help="read sets past the sampled budget: a pool of 65,536 tokens (unless "
        "--max-total-tokens), a quarter of the requests with long prompts (unless "
        "--long-prompts), chunked prefill 512 (unless --chunked-prefill-size)",
    )
    p.add_argument(
        "--off-arm",
        action="store_true",
        help="also run the injected workload with the guard off (mode off at every page size, "
        "after the others), in full: its escape rate is the campaign's sensitivity",
    )
    p.add_argument(
        "--quarantine-cap",
        type=float,
        default=0.25,
        metavar="FRACTION",
        help="--kvguard-quarantine-cap of the guarded servers (default 0.25: injections "
        "quarantine pages far faster than serving does; 0: kvguard-serve's own default)",
    )
    p.add_argument(
        "--on-violation",
        choices=ON_VIOLATION,
        default="recompute",
        help="what the guarded servers do with a request whose KV they found bad "
        "(KVGUARD_ON_VIOLATION): recompute it (heal: modes verified and paranoid; the others "
        "abort) or abort it (default: recompute)",
    )
    p.add_argument(
        "--recompute-breaker",
        type=int,
        default=None,
        metavar="N",
        help="KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE of the guarded servers: past N recomputes in "
        "a minute they abort instead (default: kvguard's own; 0: no breaker). A campaign heals "
        "far more often than serving does: a large one may open it",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--rejudge",
        type=Path,
        metavar="DIR",
        help="judge the campaign saved in DIR again (its answers and logs; e.g. with another "
        "--tie-margin) and rewrite its reports; runs nothing",
    )
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    dsa = model_is_dsa(args.model_path)
    classes = _list(args.classes) or [c for c in INJECTORS if dsa or c not in POOL_CLASSES]
    unknown = [c for c in classes if c not in INJECTORS]
    if not dsa and any(POOL_CLASSES.get(c) == "dsa" for c in classes):
        raise SystemExit(
            f"kvguard-fuzz: error: {', '.join(c for c in classes if c in POOL_CLASSES)} "
            "corrupt DSA index keys; the model has no indexer (no index_topk in its config.json): "
            "serve a DSA model (GLM-5, DeepSeek V3.2) with --model-path, or leave them out"
        )
    page_sizes = _list(args.page_size, int) or [16]
    configs = []  # "mode" runs at every --page-size, "mode@16" at that page size only
    for item in _list(args.guard_mode) or ["paranoid"]:
        mode, _, ps = item.partition("@")
        configs += [(mode, int(ps))] if ps else [(mode, p) for p in page_sizes]
    if args.off_arm:
        configs += [("off", p) for p in dict.fromkeys(ps for _, ps in configs)]
    configs = list(dict.fromkeys(configs))
    modes = list(dict.fromkeys(m for m, _ in configs))
    bad_modes = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(
            f"kvguard-fuzz: error: unknown classes {unknown}; known: {list(INJECTORS)}"
        )
    if bad_modes:
        raise SystemExit(
            f"kvguard-fuzz: error: unknown guard modes {bad_modes}; known: {list(MODES)}"
        )
    tenant_classes = [c for c in classes if c in TENANT_CLASSES]
    isolation = bool(tenant_classes) if args.tenant_isolation is None else args.tenant_isolation
    if tenant_classes and not isolation:
        raise SystemExit(
            f"kvguard-fuzz: error: {', '.join(tenant_classes)} runs only with tenant isolation "
            "(drop --no-tenant-isolation, or leave the class out with --classes)"
        )
    try:
        lo, _, hi = args.long_prompt_tokens.partition("-")
        long_tokens = (int(lo), int(hi or lo))
    except ValueError:
        raise SystemExit(
            f"kvguard-fuzz: error: --long-prompt-tokens {args.long_prompt_tokens!r}: want LO-HI"
        ) from None
    large = args.large_reads
    long_fraction = args.long_prompts if args.long_prompts is not None else 0.25 if large else 0.0
    if not 0 <= args.stream <= 1 or not 0 <= long_fraction <= 1:
        raise SystemExit("kvguard-fuzz: error: --stream and --long-prompts are fractions in [0, 1]")
    return Settings(
        seed=args.seed,
        classes=tuple(classes),
        num_requests=args.requests,
        num_injections=args.injections,
        modes=tuple(modes),
        page_sizes=tuple(dict.fromkeys(ps for _, ps in configs)),
        configs=tuple(configs),
        out=args.out or Path("runs") / f"fuzz-{args.seed}",
        model_path=args.model_path,
        wave_size=args.wave_size,
        max_total_tokens=args.max_total_tokens or (65536 if large else 2048),
        chunked_prefill_size=args.chunked_prefill_size or (512 if large else 64),
        canary_sweep_interval=args.canary_sweep_interval,
        max_tries=args.max_tries,
        max_deaths=args.max_deaths,
        tie_margin=args.tie_margin,
        tenant_isolation=isolation,
        stream_fraction=args.stream,
        long_fraction=long_fraction,
        long_tokens=long_tokens,
        context_length=args.context_length,
        quarantine_cap=args.quarantine_cap or None,
        on_violation=args.on_violation,
        recompute_breaker=args.recompute_breaker,
    )


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    try:  # the checkout the servers import kvguard (and the injectors) from
        root = Path(__file__).resolve().parents[1]
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if head:
            out["kvguard_git"] = head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    for dist in ("kvguard", "sglang", "torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


def model_identity(model_path: str | None) -> dict:
    """Which weights were served: the path and a digest of the safetensors files."""
    import hashlib

    model_path = str(_model_dir(model_path))
    h = hashlib.sha256()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        h.update(f.read_bytes())
    return {"path": model_path, "safetensors_sha256": h.hexdigest()[:16]}


def run_campaign(s: Settings, progress: bool = True, command: str = "") -> dict:
    s.out.mkdir(parents=True, exist_ok=True)
    configs = list(s.configs) or [(m, ps) for m in s.modes for ps in s.page_sizes]
    total = 2 * s.num_requests * len(configs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr)

    def tick(n, stats):
        if bar is not None:
            bar.set_description(f"{stats['cfg']} {stats['pass']}")
            bar.update(n)

    t0 = time.monotonic()
    first = None  # the first configuration whose clean pass completed
    report = {
        "kvguard_fuzz_report": 1,
        "seed": s.seed,
        "command": command,
        "model": model_identity(s.model_path),
        "versions": versions(),
        "settings": _fields(s),
        "configs": [],
    }
    count_tokens, long_tokens = None, s.long_tokens
    if s.long_fraction:
        count_tokens, context = token_counter(s.model_path)
        long_tokens = clamp_long_tokens(s.long_tokens, s.context_length or context)
        report["long_tokens"] = list(long_tokens)
    for mode, ps in configs:
        waves = build_workload(
            s.seed,
            s.num_requests,
            s.wave_size,
            tenants=s.tenant_isolation,
            stream_fraction=s.stream_fraction,
            long_fraction=s.long_fraction,
            long_tokens=long_tokens,
            count_tokens=count_tokens,
        )
        schedule_injections(s.seed, waves, s.num_injections, list(s.classes), s.max_tries)
        if mode == configs[0][0] and ps == configs[0][1]:
            report["schedule"] = [e for w in waves for e in w.injections]
        run = Runner(s, waves, tick).run(mode, ps)
        if first is None and run.reference:
            first = run
        elif first is not None and run.reference:  # the noise floor: clean run vs clean run
            run.result["clean_vs_first_clean"] = noise_floor(first, run, s.tie_margin)
        report["configs"].append(run.result)
        report["wall_seconds"] = round(time.monotonic() - t0, 1)
        write_all(report, s.out)  # after every configuration: a partial campaign still reports
    if bar is not None:
        bar.close()
    return report


def _model_dir(model_path: str | None) -> Path:
    if model_path is None:
        from kvguard.serve.default_model import DEFAULT_MODEL_DIR

        return Path(DEFAULT_MODEL_DIR)
    return Path(model_path)


def model_is_dsa(model_path: str | None) -> bool:
    """Whether the model has a DSA indexer (``index_topk`` in its config.json), whose pool keeps
    the index keys the index-key classes corrupt."""
    import json

    try:
        config = json.loads((_model_dir(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("index_topk"))


def token_counter(model_path: str | None):
    """(prompt -> token count with the served model's tokenizer, the model's context length);
    (None, None) where either is not found (long prompts are then sized by characters)."""
    import json

    root = _model_dir(model_path)
    count = context = None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(root / "tokenizer.json"))

        def count(text: str) -> int:
            return len(tok.encode(text).ids)

    except Exception:
        count = None
    try:
        cfg = json.loads((root / "config.json").read_text())
        context = cfg.get("max_position_embeddings")
    except (OSError, ValueError):
        pass
    return count, context


def clamp_long_tokens(want: tuple[int, int], context: int | None) -> tuple[int, int]:
    """A long prompt's token range, within the context less room for the longest output."""
    if not context:
        return want
    from kvguard.fuzz.workload import MAX_NEW_TOKENS

    top = context - max(MAX_NEW_TOKENS) - 32  # output, special tokens, a tokenizer's slack
    hi = min(want[1], top)
    return min(want[0], hi), hi


def noise_floor(first, run, tie_margin: float) -> dict:
    """Compare two clean passes of the same workload (different server, batches, cache states)."""
    counts = {"identical": 0, "near_tie": 0, "escaped": 0}
    decisive = []
    for key, ref in first.reference.items():
        if key in run.reference:
            outcome, where = compare(ref, run.reference[key], tie_margin)
            counts["identical" if outcome == "clean" else outcome] += 1
            if outcome == "escaped":
                decisive.append({"key": key, **where})
    return {"against": f"{first.mode}-ps{first.page_size}", **counts, "decisive": decisive[:20]}


def _fields(s: Settings) -> dict:
    from dataclasses import fields

    out = {}
    for f in fields(s):
        v = getattr(s, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v
    return out


def rejudge(out: Path, tie_margin: float) -> dict:
    """Judge a finished campaign again from its saved answers and logs (e.g. another tie
    margin); nothing is re-run."""
    import copy
    import json

    from kvguard.fuzz.campaign import ConfigRun, judge, partial_reference_of, reference_of
    from kvguard.fuzz.client import Response

    report = json.loads((out / "report.json").read_text())
    report["settings"]["tie_margin"] = tie_margin
    first = None
    for res in report["configs"]:
        run = ConfigRun(res["mode"], res["page_size"], out / f"{res['mode']}-ps{res['page_size']}")
        run.result = res
        answers = {}
        for name in ("clean", "injected"):
            path = run.dir / f"{name}.jsonl"
            rows = path.read_text().splitlines() if path.exists() else []
            answers[name] = [Response(**json.loads(line)) for line in rows]
        if not answers["clean"]:
            continue
        run.reference = reference_of(answers["clean"])
        run.partial = partial_reference_of(answers["clean"])
        planned = copy.deepcopy(report.get("schedule", []))
        judge(run, planned, run.reference, answers["clean"], answers["injected"], tie_margin)
        if first is None:
            first = run
        else:
            res["clean_vs_first_clean"] = noise_floor(first, run, tie_margin)
    report["rejudged"] = f"tie margin {tie_margin}"
    write_all(report, out)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rejudge is not None:
        report = rejudge(args.rejudge, args.tie_margin)
        print((args.rejudge / "report.md").resolve())
        return 1 if _failed(report) else 0
    s = settings_from(args)
    command = "kvguard-fuzz " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = run_campaign(s, progress=not args.no_progress, command=command)
    print((s.out / "report.md").resolve())
    for line in summary_lines(report):
        print(line)
    off = (report.get("sensitivity") or {}).get("off_arm")
    if off and not off["measuring"]:
        print(
            "kvguard-fuzz: warning: nothing escaped with the guard off "
            f"({off['injections_scored']} injections scored): this campaign measured nothing",
            file=sys.stderr,
        )
    return 1 if _failed(report) else 0


def summary_lines(report: dict) -> list[str]:
    """One line per configuration: what its guard did on a violation, and to how many."""
    out = []
    for c in report["configs"]:
        sm, req = c["summary"], c["summary"]["requests"]
        action = c.get("on_violation") or "no guard"
        if c["mode"] in UNGUARDED:
            action = "no guard"
        out.append(
            f"{c['mode']} ps{c['page_size']} (on violation: {action}): "
            f"{sm.get('requests_recomputed', 0)} requests recomputed "
            f"({sm.get('recomputes', 0)} recomputes), {req['detected'] + req['collateral']} "
            f"aborted by the guard, {req['escaped']} escaped, "
            f"{sm.get('client_visible_errors', 0)} client-visible errors"
        )
    return out


def _failed(report: dict) -> bool:
    bad = [c for c in report["configs"] if c["mode"] not in UNGUARDED and c["verdict"]]
    for c in bad:
        print(f"{c['mode']} ps{c['page_size']}: " + "; ".join(c["verdict"]), file=sys.stderr)
    return bool(bad)

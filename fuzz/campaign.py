"""A fault-injection campaign: for each configuration (guard mode x page size) start kvguard-serve
with the fuzz plugin armed, run the workload once clean (the reference, and the mode's
throughput), then again with the injection schedule fed to the control file wave by wave, and
judge every request with the oracle.

Guard modes: kvguard's ``off``, ``tags``, ``sampled``, ``paranoid``, ``verified``; ``default``:
no ``--kvguard-mode`` at all (whatever kvguard-serve defaults to; the mode it reports is
recorded); and ``canary``: kvguard off, SGLang's own ``--kv-canary log`` on (it only logs: its
detections are counted from its log lines).

The guard-off arm (mode ``off``) runs the same injected workload in full: a server death there
restarts the server for the rest of the workload however often it happens (``off_max_deaths``),
since its escape rate is the campaign's sensitivity (an oracle that sees nothing with the guard
off is not measuring anything).

Streaming (``stream_fraction``): that share of the requests is streamed, in both passes, and the
oracle scores every token a client was sent. Large read sets: ``max_total_tokens`` of 65,536 and
more, and ``long_fraction`` of the requests with prompts of ``long_tokens`` tokens (clamped to
the model's context, ``context_length`` if set), so steps read more than the ``sampled`` mode's
per-step budget; the plugin logs how many KV tokens steps read (``read_sets``).

With ``tenant_isolation`` every server runs with ``--kvguard-tenant-isolation`` and the workload
carries tenants (prefix-cache namespaces); the ``cross_tenant`` class needs both.

``on_violation``: what the guarded servers do with a request whose KV they found bad
(``KVGUARD_ON_VIOLATION``): ``recompute`` (heal it: released, prefilled again, decoded on; modes
``verified`` and ``paranoid`` only, the others abort) or ``abort``. The oracle scores a healed
request like any other: its output, streamed tokens included, must be the clean run's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.fuzz.client import Response, run_wave
from kvguard.fuzz.oracle import (
    TIE_MARGIN,
    UNGUARDED,
    canary_flags,
    classify,
    guard_violations,
    injections_from_log,
    read_jsonl,
    recomputes_of,
)
from kvguard.fuzz.workload import Wave
from kvguard.serve.child import ServeProcess, ServerDied

MODES = ("off", "tags", "sampled", "paranoid", "verified", "default", "canary")
ON_VIOLATION = ("recompute", "abort")  # KVGUARD_ON_VIOLATION of the guarded servers


@dataclass(frozen=True, slots=True)
class Settings:
    seed: int
    classes: tuple[str, ...]
    num_requests: int  # per pass, per configuration
    num_injections: int  # per configuration
    modes: tuple[str, ...]
    page_sizes: tuple[int, ...]
    out: Path
    model_path: str | None = None
    wave_size: int = 24
    max_total_tokens: int = 2048
    chunked_prefill_size: int = 64
    canary_sweep_interval: int = 8
    max_tries: int = 80
    max_deaths: int = 3  # server deaths after which a configuration stops (each restart ~1 min)
    tie_margin: float = TIE_MARGIN
    configs: tuple[tuple[str, int], ...] = ()  # (mode, page size) in run order; default: all pairs
    tenant_isolation: bool = False  # --kvguard-tenant-isolation, and a workload with tenants
    stream_fraction: float = 0.0  # share of the requests streamed (SSE), scored token by token
    long_fraction: float = 0.0  # share of the requests with a long prompt
    long_tokens: tuple[int, int] = (1500, 3000)  # a long prompt's tokens (clamped to the context)
    context_length: int | None = None  # --context-length (may exceed the model's own)
    off_max_deaths: int | None = None  # server deaths after which mode off stops (None: never)
    # --kvguard-quarantine-cap of the guarded modes: a campaign quarantines pages far faster than
    # serving does, and at the default (1% of a 2,048-token pool: one page) every detection
    # would fail the guard closed (/health 503) until its victim is released
    quarantine_cap: float | None = 0.25
    # KVGUARD_ON_VIOLATION of the guarded servers: heal a request whose KV went bad, or abort it
    on_violation: str = "recompute"
    # KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE of the guarded servers (None: kvguard's default; 0:
    # no breaker): a campaign heals far more often than serving does
    recompute_breaker: int | None = None


@dataclass(slots=True)
class ConfigRun:
    mode: str
    page_size: int
    dir: Path
    result: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)  # key -> clean-pass (output ids, top-2)
    partial: dict = field(default_factory=dict)  # key -> what a clean-pass stream was sent

    @property
    def name(self) -> str:
        return f"{self.mode}-ps{self.page_size}"


def server_args(s: Settings, mode: str, page_size: int) -> list[str]:
    args = [
        "--page-size",
        str(page_size),
        "--max-total-tokens",
        str(s.max_total_tokens),
        "--chunked-prefill-size",
        str(s.chunked_prefill_size),
        "--log-format",
        "json",
        "--random-seed",
        str(s.seed),
        "--sleep-on-idle",
    ]
    if mode != "default":  # "default": whatever kvguard-serve runs without the flag
        args += ["--kvguard-mode", "off" if mode == "canary" else mode]
    if s.quarantine_cap and mode not in UNGUARDED:
        args += ["--kvguard-quarantine-cap", str(s.quarantine_cap)]
    if s.context_length:
        args += ["--context-length", str(s.context_length)]
    if mode == "canary":
        args += [
            "--kv-canary",
            "log",
            "--kv-canary-real-data",
            "all",
            "--kv-canary-sweep-interval",
            str(s.canary_sweep_interval),
        ]
    if s.tenant_isolation:
        args += ["--kvguard-tenant-isolation"]
    if s.model_path:
        args += ["--model-path", s.model_path]
    return args


class Runner:
    """Runs one configuration; ``progress(n, stats)`` is told of every finished wave."""

    def __init__(self, s: Settings, waves: list[Wave], progress=None):
        self.s, self.waves, self.progress = s, waves, progress or (lambda n, stats: None)

    # -- server lifecycle: a fresh control file per server instance (the plugin's "seen" set
    # -- starts empty, so a restarted server must not see the entries already injected) ---------
    def _start(self, run: ConfigRun) -> ServeProcess:
        n = run.result.setdefault("server_starts", 0) + 1
        run.result["server_starts"] = n
        self.control = run.dir / f"control-{n}.json"
        self.plan: list[dict] = []
        self._write_plan()
        env = {
            "KVGUARD_FUZZ_CONTROL": str(self.control),
            "KVGUARD_FUZZ_LOG": str(run.dir / "injections.jsonl"),
        }
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # modest CPU use
        if run.mode == "canary":
            env["SGLANG_KV_CANARY_RING_CAPACITY"] = (
                "65536"  # log every violation, not the first 1024
            )
        if run.mode not in UNGUARDED:  # heal or abort (modes off and canary run no guard)
            env["KVGUARD_ON_VIOLATION"] = self.s.on_violation
            if self.s.recompute_breaker is not None:
                env["KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE"] = str(self.s.recompute_breaker)
        if self.s.context_length:  # a longer context than the model's own (RoPE extrapolates)
            env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
        srv = ServeProcess(
            server_args(self.s, run.mode, run.page_size), run.dir / "server.log", env
        )
        t0 = time.monotonic()
        srv.start()
        run.result.setdefault("start_seconds", []).append(round(time.monotonic() - t0, 1))
        run.result.setdefault("guard_status", _guard_status(srv))
        return srv

    def _write_plan(self):
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"plan": self.plan}))
        os.replace(tmp, self.control)  # the plugin never sees a half-written file

    def _append(self, entries: list[dict]):
        if entries:
            self.plan.extend(entries)
            self._write_plan()

    # -- one configuration --------------------------------------------------------------------
    def run(self, mode: str, page_size: int) -> ConfigRun:
        run = ConfigRun(mode, page_size, self.s.out / f"{mode}-ps{page_size}")
        run.dir.mkdir(parents=True, exist_ok=True)
        for name in ("server.log", "injections.jsonl", "clean.jsonl", "injected.jsonl"):
            (run.dir / name).unlink(missing_ok=True)
        res = run.result
        res.update(mode=mode, page_size=page_size, deaths=[], waves=[])
        if mode not in UNGUARDED:
            res["on_violation"] = self.s.on_violation
        try:
            srv = self._start(run)
        except ServerDied as e:
            res["start_error"] = str(e)[-2000:]
            return run
        try:
            reference, clean = self._clean_pass(run, srv)
            srv.flush_cache()  # the injected pass starts from an empty prefix cache, as clean
            srv, injected = self._injected_pass(run, srv)
            res["idle_end"] = _idle(srv)
        except ServerDied as e:
            res["error"] = str(e)[-3000:]
            return run
        finally:
            srv.stop(drain=False)  # judged already idle: nothing in flight to drain
        self._judge(run, reference, clean, injected)
        return run

    def _clean_pass(self, run: ConfigRun, srv: ServeProcess):
        responses: list[Response] = []
        t0, log_from = time.monotonic(), srv.log_size()
        for w in self.waves:
            got = asyncio.run(run_wave(srv.url, w.requests, "c"))
            responses += got
            self.progress(len(got), {"cfg": run.name, "pass": "clean"})
            if not _alive(srv, run.result):
                raise ServerDied(
                    f"{run.name}: server died in the clean pass (wave {w.index}):\n"
                    + srv.log_tail()
                )
        wall = time.monotonic() - t0
        scored = [r for r in responses if not r.client_abort]
        tokens = sum(r.completion_tokens or 0 for r in scored if r.status == 200)
        specs = {spec.key: spec for w in self.waves for spec in w.requests}
        hits = [r for r in scored if r.status == 200 and (r.cached_tokens or 0) > 0]
        run.result["clean"] = {
            # the prefix cache still serves hits (within a tenant, for requests with one)
            "prefix_hits": len(hits),
            "tenant_prefix_hits": sum(
                1 for r in hits if specs[r.key].extra_key or specs[r.key].cache_salt
            ),
            "tenant_requests": sum(
                1 for r in scored if specs[r.key].extra_key or specs[r.key].cache_salt
            ),
            "seconds": round(wall, 2),
            "requests": len(responses),
            "completion_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2),
            "requests_per_s": round(len(responses) / wall, 3),
            "failed": sum(1 for r in scored if r.status != 200 or r.output_ids is None),
            "guard_aborts": sum(1 for r in scored if r.violation),  # false aborts: no injection yet
            "idle": _idle(srv),
        }
        if run.mode == "canary":  # what the canary reports with nothing injected: false alarms
            with open(srv.log, "rb") as f:
                f.seek(log_from)
                run.result["clean"]["canary_violations"] = len(
                    canary_flags(f.read().decode(errors="replace"))
                )
        reference = run.reference = reference_of(responses)
        run.partial = partial_reference_of(responses)
        _dump(run.dir / "clean.jsonl", responses)
        return reference, responses

    def _injected_pass(self, run: ConfigRun, srv: ServeProcess):
        responses: list[Response] = []
        inj_log = run.dir / "injections.jsonl"
        t0 = time.monotonic()
        for i, w in enumerate(self.waves):
            for e in w.injections:
                e["wave"] = w.index
            wave = {
                "wave": w.index,
                "log_from": srv.log_size(),
                "inj_from": _lines(inj_log),
                "entries": [e["id"] for e in w.injections],
            }
            got = asyncio.run(
                run_wave(
                    srv.url,
                    w.requests,
                    "i",
                    on_sent=lambda w=w: self._append([dict(e) for e in w.injections]),
                )
            )
            responses += got
            wave["alive"] = _alive(srv, run.result)
            if wave["alive"]:
                wave["idle"] = _idle(srv)
            wave["log_to"], wave["inj_to"] = srv.log_size(), _lines(inj_log)
            run.result["waves"].append(wave)
            self.progress(len(got), {"cfg": run.name, "pass": "injected"})
            if not wave["alive"]:
                run.result["deaths"].append(
                    {"wave": w.index, "exit_code": srv.proc.poll(), "log_tail": srv.log_tail(3000)}
                )
                srv.stop(drain=False)
                limit = self.s.max_deaths
                if run.mode == "off":  # the guard-off arm runs in full: it is the sensitivity
                    limit = self.s.off_max_deaths or len(self.waves) + 1
                if len(run.result["deaths"]) >= limit:
                    run.result["stopped_early"] = f"after {len(run.result['deaths'])} server deaths"
                    break
                if i + 1 < len(self.waves):
                    srv = self._start(run)  # the rest of the workload on a fresh server
        run.result["injected_seconds"] = round(time.monotonic() - t0, 2)
        _dump(run.dir / "injected.jsonl", responses)
        return srv, responses

    # -- judging ------------------------------------------------------------------------------
    def _judge(
        self, run: ConfigRun, reference: dict, clean: list[Response], injected: list[Response]
    ):
        planned = [e for w in self.waves for e in w.injections]
        judge(run, planned, reference, clean, injected, self.s.tie_margin)


def reference_of(responses: list[Response]) -> dict:
    """key -> (output ids, top-2) of every clean-pass answer that can serve as a reference."""
    return {
        r.key: (r.output_ids, r.top2)
        for r in responses
        if not r.client_abort
        and r.status == 200
        and r.violation is None
        and r.output_ids
        and (not r.streamed or r.stream_end == "done")
    }


def partial_reference_of(responses: list[Response]) -> dict:
    """key -> (tokens, top-2) a clean-pass stream was sent before its client dropped it: what
    the same drop in the injected pass is scored against, as far as both got."""
    return {
        r.key: (r.stream_ids, r.stream_top2)
        for r in responses
        if r.client_abort and r.streamed and r.violation is None and r.stream_ids
    }


def _guard_status(srv: ServeProcess) -> dict:
    """The guard as the server reports it (``/server_info``: mode, active): which mode
    ``default`` really ran."""
    try:
        import requests

        info = requests.get(f"{srv.url}/server_info", timeout=30).json()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    status = info.get("kvguard")
    if isinstance(status, list):
        status = status[0] if status else None
    if not isinstance(status, dict):
        return {"active": False}
    keys = ("active", "mode", "sweep_tokens_per_step", "on_violation", "recompute_budget")
    return {k: status.get(k) for k in keys if k in status}


def judge(
    run: ConfigRun,
    planned: list[dict],
    reference: dict,
    clean: list[Response],
    injected: list[Response],
    tie_margin: float = TIE_MARGIN,
) -> None:
    """Fold a configuration's logs and client answers into ``run.result``."""
    res = run.result
    inj_events = read_jsonl(run.dir / "injections.jsonl")
    injections = injections_from_log(inj_events, planned)
    log_bytes = (run.dir / "server.log").read_bytes()
    log_text = log_bytes.decode(errors="replace")
    server_events = read_jsonl(run.dir / "server.log")
    violations = guard_violations(server_events)
    records, injections = classify(
        reference,
        injected,
        injections,
        violations,
        tie_margin,
        partial=run.partial or partial_reference_of(clean),
    )
    reads = [e for e in inj_events if e.get("event") == "read_sets"]
    if reads:  # how many KV tokens steps read (the last tally of each server instance)
        res["read_sets"] = _read_sets(reads)
    for inj in injections.values():
        inj["landed_wave"] = _landed_wave(inj["id"], inj_events, res["waves"])
    if run.mode == "canary":
        _canary_attribution(res, injections, log_bytes)
    res["clean_guard_aborts"] = [r.rid for r in clean if r.violation]
    # healed in the clean pass (nothing injected yet): false recomputes, reported
    res["clean_guard_recomputes"] = [
        r.rid for r in clean if recomputes_of(violations.get(r.rid) or []) and not r.violation
    ]
    res["memory_leak_warnings"] = log_text.count("memory leak detected")
    res["guard_memory_check_warnings"] = sum(
        1 for e in server_events if e.get("event") == "kvguard_engine_memory_check_after_violations"
    )
    res["guard_failed_closed"] = sum(
        1 for e in server_events if e.get("event") == "kvguard_failed_closed"
    )
    res["guard_errors"] = sum(
        1
        for e in server_events
        if e.get("event", "").startswith("kvguard_") and e.get("event", "").endswith("_failed")
    )
    res["injector_errors"] = [e for e in inj_events if e.get("event") == "injector_error"][:20]
    res["requests"] = records
    res["injections"] = sorted(injections.values(), key=lambda x: x["id"])
    for inj in res["injections"]:
        inj["victims"] = sorted(inj["victims"])


FAIL_CLOSED_WAIT_S = 60  # how long a live server answering /health 503 may take to clear


def _alive(srv: ServeProcess, res: dict) -> bool:
    """Healthy, or back to healthy within ``FAIL_CLOSED_WAIT_S``: a guard that failed closed
    (quarantine cap) answers /health 503 until the quarantined pages' holders are released,
    and that is no server death (``failed_closed_waits`` counts it)."""
    if srv.healthy():
        return True
    deadline = time.monotonic() + FAIL_CLOSED_WAIT_S
    while srv.running() and time.monotonic() < deadline:
        time.sleep(1)
        if srv.healthy():
            res["failed_closed_waits"] = res.get("failed_closed_waits", 0) + 1
            return True
    return False


def _idle(srv: ServeProcess) -> dict:
    try:
        load = srv.wait_idle()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        k: load.get(k)
        for k in ("num_used_tokens", "num_running_reqs", "num_waiting_reqs", "max_total_num_tokens")
    }


def _dump(path: Path, responses: list[Response]):
    """Every client answer of a pass (output tokens included), for forensics."""
    with open(path, "w") as f:
        for r in responses:
            f.write(json.dumps(r.as_dict()) + "\n")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _landed_wave(inj_id: int, events: list[dict], waves: list[dict]) -> int | None:
    for n, ev in enumerate(events):
        if ev.get("id") == inj_id and ev.get("event") in ("injected", "skipped"):
            for w in waves:
                if w["inj_from"] <= n < w["inj_to"]:
                    return w["wave"]
    return None


def _canary_attribution(res: dict, injections: dict[int, dict], raw: bytes):
    """SGLang's canary names a slot, not a request: count its violations per wave, and flag the
    injections that landed in a wave with at least one."""
    per_wave = {}
    for w in res["waves"]:
        per_wave[w["wave"]] = len(
            canary_flags(raw[w["log_from"] : w["log_to"]].decode(errors="replace"))
        )
        w["canary_violations"] = per_wave[w["wave"]]
    res["canary_violations_injected"] = sum(per_wave.values())
    for inj in injections.values():
        inj["canary_flagged"] = (
            bool(per_wave.get(inj.get("landed_wave"), 0)) if inj["status"] == "injected" else False
        )
    quiet = [w for w in res["waves"] if not w["entries"]]
    res["canary_violations_in_waves_without_injection"] = sum(w["canary_violations"] for w in quiet)


def _read_sets(events: list[dict]) -> dict:
    """Fold the plugin's running ``read_sets`` tallies (one series per server instance: a
    series restarts when ``steps`` goes down) into one."""
    last: list[dict] = []
    for ev in events:
        if last and ev["steps"] > last[-1]["steps"]:
            last[-1] = ev
        else:
            last.append(ev)
    out = {k: sum(e.get(k, 0) for e in last) for k in ("steps", "over_512", "over_2048", "tokens")}
    out["max"] = max(e.get("max", 0) for e in last)
    out["mean"] = round(out["tokens"] / out["steps"], 1) if out["steps"] else 0
    return out

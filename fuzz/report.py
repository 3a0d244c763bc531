"""Campaign reports: ``report.json`` (everything), ``report.md`` (verdicts, detection matrix,
throughput), ``report.png`` (the detection matrix as bars, drawn with PIL)."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path

from kvguard.fuzz.oracle import INJECTION_OUTCOMES, REQUEST_OUTCOMES, UNGUARDED

# injections (and victims) whose victims' outputs were scored
SCORED = ("escaped", "near_tie", "exposed", "detected", "recomputed")
# per class: what the guard did to the requests charged to its injections, and what clients saw
ACTION_COUNTS = (
    "aborts",
    "victims_aborted",
    "collateral",
    "victims_recomputed",
    "collateral_recomputed",
    "recomputes",
    "escaped_requests",
    "client_errors",
)


def summarize(cfg: dict) -> dict:
    """Per-configuration counts: request outcomes, injection outcomes per class, lags."""
    reqs, injs = cfg.get("requests", []), cfg.get("injections", [])
    by_class: dict[str, Counter] = {}
    aborts: dict[str, Counter] = {}
    lags: dict[str, list[int]] = {}
    for inj in injs:
        by_class.setdefault(inj["cls"], Counter())[inj["outcome"]] += 1
        if inj["outcome"] not in ("skipped", "not_run", "injector_error"):
            a = aborts.setdefault(inj["cls"], Counter())
            a["injections"] += 1
            for k in ACTION_COUNTS:
                a[k] += inj.get(k, 0)
            landed, made = inj.get("bad_writes") or (0, 0)
            a["bad_writes_landed"] += landed
            a["bad_writes"] += made
        if inj.get("canary_flagged"):
            by_class[inj["cls"]]["canary_flagged"] += 1
        if inj.get("steps_to_abort") is not None:
            lags.setdefault(inj["cls"], []).append(inj["steps_to_abort"])
    outcomes = Counter(r["outcome"] for r in reqs)
    landed = {inj["id"]: inj.get("landed_wave") for inj in injs}

    def waves_after(r):  # how long after its injections a request became a victim
        gaps = [r["wave"] - landed[i] for i in r["victim_of"] if landed.get(i) is not None]
        return min(gaps) if gaps else None

    idle_used = [
        w["idle"].get("num_used_tokens")
        for w in cfg.get("waves", [])
        if isinstance(w.get("idle"), dict)
    ]
    end_used = (cfg.get("idle_end") or {}).get("num_used_tokens")
    return {
        "requests": {k: outcomes.get(k, 0) for k in REQUEST_OUTCOMES},
        "escapes_from_victims": sum(
            1 for r in reqs if r["outcome"] == "escaped" and r["victim_of"]
        ),
        # Late victims: a prefix-cache hit on wrong KV, or a holder of a page freed again later.
        "detected_two_or_more_waves_after_injection": sum(
            1 for r in reqs if r["outcome"] == "detected" and (waves_after(r) or 0) >= 2
        ),
        "false_aborts_with_changed_kv": sum(
            1 for r in reqs if r["outcome"] == "false_abort" and r.get("guard_saw_changed_kv")
        ),
        "near_ties_of_victims": sum(
            1 for r in reqs if r["outcome"] == "near_tie" and r["victim_of"]
        ),
        "escapes_unattributed": sum(
            1 for r in reqs if r["outcome"] == "escaped" and not r["victim_of"]
        ),
        # streamed requests: a wrong token sent before the end (or the abort) is an escape
        "streamed_requests": sum(1 for r in reqs if r.get("streamed")),
        "streamed_tokens": sum(r.get("tokens_sent", 0) for r in reqs if r.get("streamed")),
        "streamed_escapes": sum(1 for r in reqs if r.get("streamed_escape")),
        # of them, aborted by the guard after the wrong token went out (the old oracle's
        # "detected"), and dropped by their own client
        "streamed_escapes_aborted": sum(
            1 for r in reqs if r.get("streamed_escape") and r["guard_aborted"]
        ),
        "streamed_escapes_dropped": sum(
            1 for r in reqs if r.get("streamed_escape") and r.get("stream_end") == "dropped"
        ),
        # tokens that reached a client although computed from wrong KV (same or not)
        "tokens_from_wrong_kv": sum(r.get("tokens_from_wrong_kv", 0) for r in reqs),
        "requests_sent_tokens_from_wrong_kv": sum(
            1 for r in reqs if r.get("tokens_from_wrong_kv", 0) > 0
        ),
        "victims_scored": sum(
            1 for r in reqs if r["victim_of"] and r["outcome"] in ("clean", *SCORED)
        ),
        "injections": {k: sum(c.get(k, 0) for c in by_class.values()) for k in INJECTION_OUTCOMES},
        "by_class": {k: dict(v) for k, v in sorted(by_class.items())},
        # aborts each class cost: its victims aborted, and requests only exposed to it aborted
        "aborts_by_class": {k: dict(v) for k, v in sorted(aborts.items())},
        "steps_to_abort": {
            k: {"median": statistics.median(v), "max": max(v), "n": len(v)}
            for k, v in sorted(lags.items())
        },
        # writes into a page the writer does not own that reached the KV (a firewall drops them)
        "bad_writes_landed": sum(a["bad_writes_landed"] for a in aborts.values()),
        "bad_writes": sum(a["bad_writes"] for a in aborts.values()),
        "server_deaths": len(cfg.get("deaths", [])),
        "clean_pass_guard_aborts": len(cfg.get("clean_guard_aborts", [])),
        "idle_used_tokens_max": max((u for u in idle_used if u is not None), default=None),
        "idle_used_tokens_end": end_used,
        "memory_leak_warnings": cfg.get("memory_leak_warnings", 0),
        "read_sets": cfg.get("read_sets"),
        # healing (kvguard's recompute instead of abort, KVGUARD_ON_VIOLATION)
        "on_violation": cfg.get("on_violation"),
        "requests_recomputed": sum(1 for r in reqs if r.get("recomputes")),
        "recomputes": sum(r.get("recomputes", 0) for r in reqs),
        "recomputed_then_aborted": sum(
            1 for r in reqs if r.get("recomputes") and r["guard_aborted"]
        ),
        "victims_recomputed_escaped": sum(
            1 for r in reqs if r.get("recomputes") and r["victim_of"] and r["outcome"] == "escaped"
        ),
        # what clients saw: guard aborts and every other error (a request its own client
        # dropped saw none it did not ask for), and of them those no injection was charged with
        "client_visible_errors": sum(1 for r in reqs if r.get("client_error")),
        "client_errors_unattributed": sum(
            1 for r in reqs if r.get("client_error") and r.get("charged_to") is None
        ),
        # the guard's log against what its clients saw: an abort logged that no client saw, a
        # request logged healed whose client saw an error
        "guard_aborts_unseen": sum(1 for r in reqs if r.get("guard_abort_unseen")),
        "recomputes_then_error": sum(1 for r in reqs if r.get("recompute_then_error")),
        # recompute events naming a count already named (a step in flight flagging it again)
        "repeated_recompute_events": sum(r.get("repeated_recompute_events", 0) for r in reqs),
        # streams that took back tokens they had sent (a chunk counting fewer than before)
        "streams_withdrawn": sum(1 for r in reqs if r.get("stream_withdrawn")),
        "clean_pass_guard_recomputes": len(cfg.get("clean_guard_recomputes", [])),
        # aborts where recompute was configured: why the guard did not heal (budget spent,
        # breaker open, a mode that does not verify reads, a step it could not judge)
        "not_healed": dict(
            Counter(r["why_not_healed"] for r in reqs if r.get("why_not_healed")).most_common()
        ),
    }


def verdict(cfg: dict) -> list[str]:
    """What makes a guarded configuration fail: escapes, false aborts, deaths, leaks."""
    s = cfg["summary"]
    bad = []
    if cfg.get("error") or cfg.get("start_error"):
        bad.append("configuration did not complete")
    if cfg.get("stopped_early"):
        bad.append(f"stopped {cfg['stopped_early']}")
    if s["requests"]["escaped"]:
        streamed = s.get("streamed_escapes", 0)
        bad.append(
            f"{s['requests']['escaped']} escaped"
            + (
                f" ({streamed} streamed, {s.get('streamed_escapes_aborted', 0)} of them aborted "
                "after the wrong token went out)"
                if streamed
                else ""
            )
        )
    if s["requests"]["false_abort"] or s["clean_pass_guard_aborts"]:
        bad.append(f"{s['requests']['false_abort'] + s['clean_pass_guard_aborts']} false aborts")
    if s["requests"]["collateral"]:
        bad.append(f"{s['requests']['collateral']} collateral aborts")
    if s["bad_writes_landed"]:
        bad.append(f"{s['bad_writes_landed']} of {s['bad_writes']} bad writes landed")
    if s["requests"]["error"]:
        bad.append(f"{s['requests']['error']} failed requests")
    if s.get("streams_withdrawn"):
        bad.append(f"{s['streams_withdrawn']} streams took back tokens they had sent")
    if s["server_deaths"]:
        bad.append(f"{s['server_deaths']} server deaths")
    if s["idle_used_tokens_end"]:
        bad.append(f"{s['idle_used_tokens_end']} KV tokens held when idle")
    return bad


def write_all(report: dict, out: Path) -> None:
    for cfg in report["configs"]:
        cfg["summary"] = summarize(cfg)
        cfg["verdict"] = verdict(cfg)
    report["totals"] = _totals(report["configs"])
    report["sensitivity"] = sensitivity(report["configs"])
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(markdown(report))
    draw_png(report, out / "report.png")


def _totals(configs: list[dict]) -> dict:
    t: Counter = Counter()
    for c in configs:
        s = c["summary"]
        t["requests_scored"] += sum(v for k, v in s["requests"].items() if k != "client_abort")
        t["clean_requests"] += s["requests"]["clean"] + (c.get("clean") or {}).get("requests", 0)
        t["injections_run"] += sum(
            v for k, v in s["injections"].items() if k not in ("skipped", "not_run")
        )
        for k in (
            "escaped",
            "exposed",
            "false_abort",
            "collateral",
            "detected",
            "recomputed",
            "recomputed_collateral",
            "false_recompute",
            "error",
        ):
            t[k] += s["requests"].get(k, 0)
        t["client_visible_errors"] += s.get("client_visible_errors", 0)
        t["streamed_escapes"] += s.get("streamed_escapes", 0)
        t["server_deaths"] += s["server_deaths"]
    return dict(t)


def sensitivity(configs: list[dict]) -> dict:
    """Per configuration, how often an injection's harm reached a client: of the injections
    whose victims were scored (escaped, near tie, exposed or detected), the share that escaped;
    and of the victims scored, the share that escaped. With the guard off (mode ``off``) that
    is the campaign's sensitivity: what the oracle sees when nothing stops the harm. An off arm
    with no escape measures nothing (``measuring`` false)."""
    out: dict = {"configs": {}}
    for c in configs:
        s = c["summary"]
        inj = s["injections"]
        scored = sum(inj.get(k, 0) for k in SCORED)
        victims = s.get("victims_scored", 0)
        escaped_victims = s.get("escapes_from_victims", 0)
        row = {
            "mode": c["mode"],
            "page_size": c["page_size"],
            "injections_scored": scored,
            "injections_escaped": inj.get("escaped", 0),
            "injections_exposed": inj.get("exposed", 0),
            "injection_escape_rate": round(inj.get("escaped", 0) / scored, 4) if scored else None,
            "victims_scored": victims,
            "victims_escaped": escaped_victims,
            "victim_escape_rate": round(escaped_victims / victims, 4) if victims else None,
            "streamed_escapes": s.get("streamed_escapes", 0),
        }
        out["configs"][f"{c['mode']}-ps{c['page_size']}"] = row
    off = [r for r in out["configs"].values() if r["mode"] == "off"]
    if off:
        scored = sum(r["injections_scored"] for r in off)
        escaped = sum(r["injections_escaped"] for r in off)
        out["off_arm"] = {
            "injections_scored": scored,
            "injections_escaped": escaped,
            "escape_rate": round(escaped / scored, 4) if scored else None,
            "victims_scored": sum(r["victims_scored"] for r in off),
            "victims_escaped": sum(r["victims_escaped"] for r in off),
            "measuring": escaped > 0,
        }
    return out


# -- markdown -------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    s, model = report["settings"], report.get("model") or {}
    lines = [
        "# kvguard fault-injection campaign",
        "",
        f"Seed {report['seed']}; model `{model.get('path')}` (safetensors sha256 "
        f"{model.get('safetensors_sha256')}); "
        f"{s['num_requests']} requests per pass, {s['num_injections']} injections per "
        f"configuration, waves of ~{s['wave_size']}; pool {s['max_total_tokens']} tokens, "
        f"chunked prefill {s['chunked_prefill_size']}. "
        f"Wall time {report.get('wall_seconds', 0) / 60:.1f} min.",
        "",
        f"Command: `{report.get('command', '')}`",
        "",
        *_on_violation_lines(report),
        "Versions: " + ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items()),
        "",
        "## Verdict per configuration",
        "",
        "| configuration | scored requests | clean | exposed | detected | collateral | recomputed "
        "(collateral, false) | escaped "
        "(streamed, of them aborted after) | tokens sent from wrong KV (requests) | near-tie "
        "divergences (victims) | false aborts (KV changed) | errors | client-visible errors | "
        "server deaths | idle KV held (end) | verdict |",
        "| --- " * 17 + "|",
    ]
    for c in report["configs"]:
        r = c["summary"]["requests"]
        scored = sum(v for k, v in r.items() if k != "client_abort")
        fa = r["false_abort"] + c["summary"]["clean_pass_guard_aborts"]
        ok = "ok" if not c["verdict"] else "; ".join(c["verdict"])
        if c["mode"] in UNGUARDED and c["verdict"]:
            ok = "unguarded: " + ok
        sm = c["summary"]
        mode = c["mode"]
        if mode == "default" and (c.get("guard_status") or {}).get("mode"):
            mode = f"default ({c['guard_status']['mode']})"
        lines.append(
            f"| {mode} ps{c['page_size']} | {scored} | {r['clean']} | {r.get('exposed', 0)} | "
            f"{r['detected']} | {r['collateral']} | {r.get('recomputed', 0)} "
            f"({r.get('recomputed_collateral', 0)}, {r.get('false_recompute', 0)}) | {r['escaped']} "
            f"({sm.get('streamed_escapes', 0)}, {sm.get('streamed_escapes_aborted', 0)}) | "
            f"{sm.get('tokens_from_wrong_kv', 0)} "
            f"({sm.get('requests_sent_tokens_from_wrong_kv', 0)}) | "
            f"{r['near_tie']} ({c['summary']['near_ties_of_victims']}) | {fa} "
            f"({c['summary']['false_aborts_with_changed_kv']}) | "
            f"{r['error']} | {sm.get('client_visible_errors', '')} | "
            f"{c['summary']['server_deaths']} | "
            f"{c['summary']['idle_used_tokens_end']} | {ok} |"
        )
    lines += [
        "",
        "Requests the client dropped itself are not scored. An escape is a completed request "
        "whose tokens differ from the clean run's at a step the model decided clearly, or a "
        "streamed request that was sent such a token, even if the guard aborted it afterwards "
        "(a streamed escape: the client had the wrong token already). A victim (a request that "
        "read, or would have read, wrong KV bytes) that completed with the clean run's tokens is "
        "*exposed*: the wrong bytes changed no greedy token this time. Tokens sent from wrong "
        "KV: tokens that reached a client (streamed, or in a completed output) although the "
        "forward that computed them read wrong KV bytes, the same tokens or not. A near-tie "
        "divergence first differs at a step where both runs had "
        f"their two best tokens within {report['settings'].get('tie_margin')} nats (a candidate in "
        "common): clean runs "
        "flip those too (next table), so they are listed, not counted as escapes. A false abort "
        "is a guard abort of a request no injection was seen to touch; in parentheses those where "
        "the guard found changed KV bytes (a digest mismatch: corruption the plugin did not "
        "follow, e.g. the aftermath of an injected double free), the rest aborted over pages "
        "whose bytes still verified (e.g. every holder of a page quarantined because another "
        "request read it before it was ready). A detection is a guard abort of a victim (a "
        "request that read, or would have read, wrong KV bytes because of an injection); a "
        "collateral abort is one of a request that only held a page an injection involved, its "
        "own KV intact (its output would have matched), and a victim of none. A victim of "
        "`cross_tenant` that completes counts as escaped (another tenant's KV served it), "
        "whatever its tokens, unless the guard recomputed it before it read that KV. "
        "Recomputed: a victim kvguard healed instead of aborting it (its KV released, prefilled "
        "again from its prompt and the tokens it kept, decoded on) that completed with the "
        "clean run's tokens, every streamed one included; in parentheses, the same for requests "
        "only exposed to an injection (collateral) and for requests no injection touched "
        "(false): reported, not failures. A recomputed request whose tokens differ is an escape "
        "like any other; tokens computed from wrong KV that a recompute dropped and computed "
        "again never left, and are not counted as sent. Client-visible errors: guard aborts and "
        "every other error a client saw.",
        "",
    ]
    lines += _sensitivity_lines(report)
    lines += _read_set_lines(report)
    lines += _noise_table(report)
    lines += _aborts_table(report)
    lines += _tenant_lines(report)
    lines += ["## Detection matrix (injections by class and outcome)", ""]
    for c in report["configs"]:
        lines += _matrix(c)
    lines += [
        "## Throughput of the clean passes",
        "",
        "| configuration | requests | completion tokens | seconds | tokens/s | relative to off |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    base = {
        c["page_size"]: (c.get("clean") or {}).get("tokens_per_s")
        for c in report["configs"]
        if c["mode"] == "off"
    }
    for c in report["configs"]:
        cl = c.get("clean") or {}
        rel = ""
        if base.get(c["page_size"]) and cl.get("tokens_per_s"):
            rel = f"{cl['tokens_per_s'] / base[c['page_size']]:.2f}x"
        lines.append(
            f"| {c['mode']} ps{c['page_size']} | {cl.get('requests', '')} | "
            f"{cl.get('completion_tokens', '')} | {cl.get('seconds', '')} | "
            f"{cl.get('tokens_per_s', '')} | {rel} |"
        )
    lines += [
        "",
        "Throughput on a shared 2-core CPU box is noisy: compare modes within one campaign only.",
        "",
    ]
    lines += _problems(report)
    lines += [
        "## Outcome definitions",
        "",
        "Injection outcomes: **escaped** (a victim's wrong token reached its client: a wrong "
        "output, or a streamed token sent before an abort), **detected** (a victim was aborted "
        "by kvguard and none escaped), **recomputed** (a victim was recomputed by kvguard, none "
        "aborted, none escaped), **refused** (the "
        "guard refused the bad prefix-cache hit, so nothing read it), **exposed** (victims "
        "served the reference output; `masked` in reports before streaming), **near_tie** (a victim's output differs only from a near-tie step on), "
        "**unscored** (its only victims were dropped by their client or failed), "
        "**no_victim** (the touched KV was never read by a running request), **not_landed** (a "
        "stale write that never found a reader, or an in-forward flip whose layer never ran), "
        "**skipped** "
        "(no fitting moment within max_tries scheduler steps), **not_run** (still queued at the "
        "end). Steps to flag: forward passes from the one the corruption was injected before to "
        "the one kvguard first flagged a victim in (to abort or recompute it). For `canary` (SGLang's kv-canary in log mode: it never "
        "aborts) *canary flagged* counts injections that landed in a wave where the canary logged "
        "a violation.",
        "",
    ]
    return "\n".join(lines)


def _on_violation_lines(report: dict) -> list[str]:
    action = report["settings"].get("on_violation")
    if not action:
        return []
    return [
        f"On a violation the guarded servers were told to **{action}** "
        f"(`KVGUARD_ON_VIOLATION={action}`): healing applies in modes `verified` and `paranoid`; "
        "`tags`, `sampled` and guard errors abort whatever the setting, and so does a request "
        "past its recompute budget.",
        "",
    ]


def _sensitivity_lines(report: dict) -> list[str]:
    sens = report.get("sensitivity") or {}
    rows = list((sens.get("configs") or {}).values())
    if not rows:
        return []
    out = [
        "## Sensitivity: how often harm reached a client",
        "",
        "Of the injections whose victims were scored (escaped, near tie, exposed or detected), "
        "those that escaped (a victim's wrong token reached its client); of the victims scored, "
        "those that escaped. With the guard off (`off`) nothing stops the harm: that escape rate "
        "is the campaign's sensitivity, what the oracle can see at all.",
        "",
        "| configuration | injections scored | escaped | exposed | escape rate | victims scored | "
        "victims escaped | victim escape rate | streamed escapes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def pct(x):
        return "" if x is None else f"{100 * x:.1f}%"

    for r in rows:
        out.append(
            f"| {r['mode']} ps{r['page_size']} | {r['injections_scored']} | "
            f"{r['injections_escaped']} | {r['injections_exposed']} | "
            f"{pct(r['injection_escape_rate'])} | {r['victims_scored']} | {r['victims_escaped']} | "
            f"{pct(r['victim_escape_rate'])} | {r['streamed_escapes']} |"
        )
    off = sens.get("off_arm")
    if off:
        out += [
            "",
            f"**Sensitivity (guard-off arm): {off['injections_escaped']} of "
            f"{off['injections_scored']} scored injections escaped "
            f"({pct(off['escape_rate'])}); {off['victims_escaped']} of {off['victims_scored']} "
            "victims.**"
            + (
                ""
                if off["measuring"]
                else " Nothing escaped with the guard off: this campaign measured nothing."
            ),
        ]
    else:
        out += ["", "No guard-off arm ran (`--off-arm`): the campaign's sensitivity is unknown."]
    return out + [""]


def _read_set_lines(report: dict) -> list[str]:
    rows = [c for c in report["configs"] if c["summary"].get("read_sets")]
    if not rows:
        return []
    out = [
        "## Read sets",
        "",
        "KV tokens each step's batch read (its sequence lengths), counted by the plugin: the "
        "`sampled` mode re-hashes 512 of them per step by default.",
        "",
        "| configuration | steps | mean | max | steps above 512 | steps above 2048 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in rows:
        r = c["summary"]["read_sets"]
        out.append(
            f"| {c['mode']} ps{c['page_size']} | {r['steps']} | {r['mean']} | {r['max']} | "
            f"{r['over_512']} | {r['over_2048']} |"
        )
    return out + [""]


def _noise_table(report: dict) -> list[str]:
    rows = [c for c in report["configs"] if c.get("clean_vs_first_clean")]
    if not rows:
        return []
    out = [
        "### Noise floor: clean pass against clean pass",
        "",
        "The same workload, no injection, on two servers: how often greedy outputs differ anyway "
        "(batch composition and prefix-cache state change the rounding).",
        "",
        "| configuration | compared with | identical | near-tie divergences | decisive "
        "divergences |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in rows:
        n = c["clean_vs_first_clean"]
        out.append(
            f"| {c['mode']} ps{c['page_size']} | {n['against']} | {n['identical']} | "
            f"{n['near_tie']} | {n['escaped']} |"
        )
    return out + [""]


def _aborts_table(report: dict) -> list[str]:
    rows = [
        (c, cls, a) for c in report["configs"] for cls, a in c["summary"]["aborts_by_class"].items()
    ]
    if not rows:
        return []
    out = [
        "## Guard actions per injection, by class",
        "",
        "Each victim (a request an injection harmed: it read or would read wrong KV) and each "
        "request only exposed to one (held a page involved, own KV intact) is charged to one "
        "injection. Recomputed: healed by kvguard (recomputed, not aborted in the end), victims "
        "and exposed (collateral); recomputes: how many times, all requests charged; aborted: "
        "victims, and collateral (exposed requests aborted); escaped: requests charged to the "
        "class whose wrong token reached a client; client-visible errors: guard aborts and every "
        "other error their clients saw. Bad writes: forward writes into a page the writer does "
        "not own (`shared_write`), landed of made (the page's bytes changed): a write firewall "
        "lands none.",
        "",
        *_not_healed_lines(report),
        "| configuration | class | injections run | victims recomputed | collateral recomputed | "
        "recomputes | victims aborted | collateral aborted | escaped | client-visible errors | "
        "aborts per injection | bad writes landed |",
        "| --- " * 12 + "|",
    ]
    for c, cls, a in rows:
        n = a.get("injections", 0)
        per = f"{a.get('aborts', 0) / n:.2f}" if n else ""
        writes = (
            f"{a.get('bad_writes_landed', 0)} of {a['bad_writes']}" if a.get("bad_writes") else ""
        )
        out.append(
            f"| {c['mode']} ps{c['page_size']} | {cls} | {n} | {a.get('victims_recomputed', 0)} | "
            f"{a.get('collateral_recomputed', 0)} | {a.get('recomputes', 0)} | "
            f"{a.get('victims_aborted', 0)} | {a.get('collateral', 0)} | "
            f"{a.get('escaped_requests', 0)} | {a.get('client_errors', 0)} | {per} | {writes} |"
        )
    return out + [""]


def _not_healed_lines(report: dict) -> list[str]:
    rows = [c for c in report["configs"] if c["summary"].get("not_healed")]
    if not rows:
        return []
    out = ["Aborts where recompute was configured, by the guard's reason:", ""]
    for c in rows:
        why = "; ".join(f"{k}: {n}" for k, n in c["summary"]["not_healed"].items())
        out.append(f"- {c['mode']} ps{c['page_size']}: {why}")
    return out + [""]


def _tenant_lines(report: dict) -> list[str]:
    if not report["settings"].get("tenant_isolation"):
        return []
    out = [
        "## Tenants",
        "",
        "Served with `--kvguard-tenant-isolation`; the workload's requests carry prefix-cache "
        "namespaces (`extra_key`, `cache_salt`). Clean passes (no injection): requests served "
        "a prefix-cache hit.",
        "",
        "| configuration | prefix hits | of them with a tenant | requests with a tenant | "
        "clean-pass aborts |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in report["configs"]:
        cl = c.get("clean") or {}
        out.append(
            f"| {c['mode']} ps{c['page_size']} | {cl.get('prefix_hits', '')} | "
            f"{cl.get('tenant_prefix_hits', '')} | {cl.get('tenant_requests', '')} | "
            f"{cl.get('guard_aborts', '')} |"
        )
    return out + [""]


def _matrix(c: dict) -> list[str]:
    s = c["summary"]
    cols = list(INJECTION_OUTCOMES)
    canary = c["mode"] == "canary"
    head = (
        "| class | "
        + " | ".join(cols)
        + (" | canary flagged" if canary else "")
        + " | steps to flag (median/max) |"
    )
    out = [
        f"### {c['mode']} ps{c['page_size']}",
        "",
        head,
        "| --- " * (len(cols) + 2 + canary) + "|",
    ]
    for cls, counts in s["by_class"].items():
        lag = s["steps_to_abort"].get(cls)
        lag_s = f"{lag['median']:g}/{lag['max']}" if lag else ""
        row = f"| {cls} | " + " | ".join(str(counts.get(k, 0)) for k in cols)
        if canary:
            row += f" | {counts.get('canary_flagged', 0)}"
        out.append(row + f" | {lag_s} |")
    tot = s["injections"]
    out.append(
        "| **all** | "
        + " | ".join(f"**{tot.get(k, 0)}**" for k in cols)
        + (
            f" | **{sum(v.get('canary_flagged', 0) for v in s['by_class'].values())}**"
            if canary
            else ""
        )
        + " | |"
    )
    if canary:
        out.append("")
        out.append(
            f"Canary violations logged in the clean pass: "
            f"{(c.get('clean') or {}).get('canary_violations', 0)}; in the injected pass: "
            f"{c.get('canary_violations_injected', 0)} "
            f"({c.get('canary_violations_in_waves_without_injection', 0)} in waves without an "
            "injection). The canary names a slot, not a request: an injection counts as flagged "
            "when the canary logged a violation during the wave it landed in."
        )
    late = s.get("detected_two_or_more_waves_after_injection")
    if late:
        out += [
            "",
            f"{late} of the {s['requests']['detected']} detected requests became victims two or "
            "more waves after their injection (a later prefix-cache hit on wrong KV, or a page of "
            "theirs the injection's aftermath put back on the free list).",
        ]
    out.append("")
    return out


def _problems(report: dict) -> list[str]:
    """Reproduction details for anything a guarded mode got wrong (a victim that completed
    unnoticed, or was sent tokens computed from wrong KV, included)."""
    out = []
    for c in report["configs"]:
        if c["mode"] in UNGUARDED:
            continue
        bad = [
            r
            for r in c.get("requests", [])
            if r["outcome"] in ("escaped", "false_abort", "collateral", "error", "exposed")
            or r.get("tokens_from_wrong_kv")
            or r.get("stream_withdrawn")
            or r.get("guard_abort_unseen")
            or r.get("recompute_then_error")
        ]
        if not bad and not c.get("deaths") and not c.get("error"):
            continue
        out += [f"### Problems in {c['mode']} ps{c['page_size']}", ""]
        if c.get("error"):
            out += ["```", c["error"][-1500:], "```"]
        for r in bad[:20]:
            out.append(
                f"- {r['rid']} (wave {r['wave']}): {r['outcome']}; victim of {r['victim_of']} "
                f"{r['classes']}"
                + (f"; exposed to {r['exposed_to']}" if r.get("exposed_to") else "")
                + ("; served another tenant's KV" if r.get("leak") else "")
                + (f"; first differing token {r['first_diff']}" if "first_diff" in r else "")
                + (
                    f" of {r.get('tokens_sent')} streamed ({r.get('stream_end')})"
                    if r.get("streamed_escape")
                    else ""
                )
                + (f", top-2 margins (clean, this run) {r['margins']}" if "margins" in r else "")
                + (
                    f"; sent {r['tokens_from_wrong_kv']} tokens computed from wrong KV (from "
                    f"token {r.get('wrong_kv_from_token')})"
                    if r.get("tokens_from_wrong_kv")
                    else ""
                )
                + (f"; guard {r['violation']} {r.get('guard_kinds')}" if r.get("violation") else "")
                + (
                    f"; recomputed {r['recomputes']}x (guard actions {r.get('guard_actions')})"
                    if r.get("recomputes")
                    else ""
                )
                + (
                    f"; stream took back sent tokens {r['stream_withdrawn']}x"
                    if r.get("stream_withdrawn")
                    else ""
                )
                + (
                    "; guard logged an abort its client never saw"
                    if r.get("guard_abort_unseen")
                    else ""
                )
                + (
                    "; logged healed, its client saw an error"
                    if r.get("recompute_then_error")
                    else ""
                )
                + (f"; {r['error'][:160]}" if r.get("error") and not r.get("violation") else "")
            )
        for d in c.get("deaths", []):
            out += [
                f"- server died after wave {d['wave']} (exit {d['exit_code']})",
                "```",
                d["log_tail"][-1200:],
                "```",
            ]
        out.append("")
    if out:
        out = ["## Problems (guarded modes)", ""] + out
    return out


# -- png ------------------------------------------------------------------------------------------
COLORS = {
    "detected": (46, 160, 67),
    "recomputed": (40, 130, 170),
    "refused": (120, 190, 120),
    "escaped": (218, 54, 51),
    "near_tie": (240, 160, 60),
    "exposed": (160, 160, 160),
    "unscored": (190, 200, 230),
    "no_victim": (210, 210, 210),
    "not_landed": (225, 215, 225),
    "skipped": (240, 228, 180),
    "not_run": (245, 245, 245),
    "injector_error": (120, 60, 160),
}


def draw_png(report: dict, path: Path) -> None:
    from PIL import Image, ImageDraw

    configs = report["configs"]
    classes = sorted({k for c in configs for k in c["summary"]["by_class"]})
    label_w, bar_w, row_h, pad = 150, 260, 16, 12
    num_w = 70
    panel_h = 28 + row_h * (len(classes) + 1)
    cols = min(3, max(1, len(configs)))
    rows = -(-len(configs) // cols)
    width = cols * (label_w + bar_w + num_w + pad * 2)
    thr_h = 40 + 18 * len(configs)
    height = rows * (panel_h + pad) + 40 + thr_h + 30
    img = Image.new("RGB", (width, height), "white")
    d = ImageDraw.Draw(img)
    d.text(
        (pad, 8),
        f"kvguard fault-injection campaign, seed {report['seed']}: injections by class and outcome",
        fill="black",
    )
    top = 30
    for n, c in enumerate(configs):
        x0 = (n % cols) * (label_w + bar_w + num_w + pad * 2) + pad
        y0 = top + (n // cols) * (panel_h + pad)
        s = c["summary"]
        req = s["requests"]
        d.text(
            (x0, y0),
            f"{c['mode']} ps{c['page_size']}: escaped {req['escaped']}, false aborts "
            f"{req['false_abort']}, collateral {req.get('collateral', 0)}, deaths "
            f"{s['server_deaths']}",
            fill="black",
        )
        most = (
            max((sum(v.get(k, 0) for k in COLORS) for v in s["by_class"].values()), default=1) or 1
        )
        for i, cls in enumerate(classes):
            y = y0 + 18 + i * row_h
            d.text((x0, y + 2), cls, fill="black")
            x = x0 + label_w
            counts = s["by_class"].get(cls, {})
            for k, color in COLORS.items():
                w = round(bar_w * counts.get(k, 0) / most)
                if w:
                    d.rectangle([x, y + 2, x + w - 1, y + row_h - 3], fill=color)
                    x += w
            run = sum(
                counts.get(k, 0)
                for k in ("detected", "recomputed", "escaped", "exposed", "unscored", "no_victim")
            )
            caught = counts.get("detected", 0) + counts.get("recomputed", 0)
            d.text(
                (x0 + label_w + bar_w + 6, y + 2),
                f"{caught}/{run} det, {counts.get('escaped', 0)} esc",
                fill="black",
            )
    y = top + rows * (panel_h + pad)
    x = pad
    for k, color in COLORS.items():  # legend
        d.rectangle([x, y + 2, x + 10, y + 12], fill=color, outline="black")
        d.text((x + 14, y + 1), k, fill="black")
        x += 24 + 7 * len(k)
    y += 30
    d.text((pad, y), "clean-pass throughput (completion tokens/s)", fill="black")
    best = max(((c.get("clean") or {}).get("tokens_per_s") or 0 for c in configs), default=1) or 1
    for i, c in enumerate(configs):
        tps = (c.get("clean") or {}).get("tokens_per_s") or 0
        yy = y + 18 + i * 18
        d.text((pad, yy), f"{c['mode']} ps{c['page_size']}", fill="black")
        w = round((width - label_w - 80) * tps / best)
        d.rectangle(
            [pad + label_w, yy + 2, pad + label_w + max(w, 1), yy + 13], fill=(70, 110, 190)
        )
        d.text((pad + label_w + w + 6, yy + 1), f"{tps:.1f}", fill="black")
    img.save(path)

"""The operators' files: Prometheus alerting rules (ops/prometheus), the Grafana dashboard
(ops/grafana) and their runbook (docs/operations.md).

Fast tier: promtool parses the rules and runs their unit tests; every alert is labelled,
annotated and has a runbook section; every series the rules and the dashboard name is one kvguard
defines or one of SGLang's that the runbook lists. Engine tier: a real Prometheus scrapes a real
kvguard-serve and evaluates the rules: every rule and dashboard expression runs, the series have
samples, nothing fires on a healthy server; an injected bit flip is healed (recomputed) and fires
the violation alert, and with the recompute breaker's limit at one that recompute opens the
breaker (its alert fires) and a second bit flip is aborted."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client import CollectorRegistry
from prometheus_server import PrometheusServer, binary
from tiny_model import serving_model

from kvguard.metrics import GuardMetrics
from kvguard.verdict import Kind

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "ops/prometheus/kvguard-alerts.yml"
RULE_TESTS = ROOT / "ops/prometheus/kvguard-alerts.test.yml"
DASHBOARD = ROOT / "ops/grafana/kvguard-dashboard.json"
RUNBOOK = ROOT / "docs/operations.md"
SEVERITIES = {"critical", "warning", "info"}
# Grafana's own variables, as a query over the last minutes would see them
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$instance": ".*"}
# A metric name (not a label, function or keyword): kvguard's, or a recorded one
SERIES = re.compile(r"(?<![\w:])(kvguard_\w+|\w+:\w+:\w+)")
# SGLang's series, by either spelling: sglang:x, or sglang_x as a Prometheus 2.x scrape stores it
# (ops/prometheus/kvguard-alerts.yml says why)
SGLANG = re.compile(r'__name__=~"sglang\[:_\](\w+)"')


def alerting_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for g in groups for rule in g["rules"] if "alert" in rule]


def recording_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for g in groups for rule in g["rules"] if "record" in rule]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def panel_exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def dashboard_exprs() -> list[str]:
    """Every PromQL expression of the dashboard: its panels' and its annotations'."""
    return panel_exprs() + [a["expr"] for a in dashboard()["annotations"]["list"] if "expr" in a]


def as_promql(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def series_in(expr: str) -> set[str]:
    """The series an expression reads (SGLang's as sglang:x)."""
    names = set(SERIES.findall(re.sub(r'"[^"]*"', '""', expr)))  # not inside label values
    return names | {f"sglang:{n}" for n in SGLANG.findall(expr)}


def selector(name: str, instance: str) -> str:
    """A selector of the series ``name`` (SGLang's by either spelling) of one server."""
    if name.startswith("sglang:"):
        return f'{{__name__=~"sglang[:_]{name.removeprefix("sglang:")}", instance="{instance}"}}'
    return f'{name}{{instance="{instance}"}}'


def guard_series() -> dict[str, bool]:
    """Every series kvguard defines (counters with their _total), and whether it is labelled
    (then absent from /metrics until its first count)."""
    registry = CollectorRegistry()
    GuardMetrics(registry)
    out = {}
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = not any(s.name == name for s in family.samples)
    return out


def runbook_series() -> set[str]:
    """The series docs/operations.md lists (the first column of its series tables)."""
    return set(re.findall(r"^\| `((?:kvguard_|sglang:)\w+)` \|", RUNBOOK.read_text(), re.M))


def runbook_anchors() -> set[str]:
    """GitHub's anchors of docs/operations.md's headings."""
    headings = re.findall(r"^#+ (.+)$", RUNBOOK.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


# -- fast tier: the files ---------------------------------------------------------------------
def test_promtool_checks_the_rules():
    out = subprocess.run(
        [binary("promtool"), "check", "rules", str(RULES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    n = len(alerting_rules()) + len(recording_rules())
    assert f"SUCCESS: {n} rules found" in out.stdout, out.stdout


def test_promtool_unit_tests_of_the_rules_pass():
    out = subprocess.run(
        [binary("promtool"), "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # every alert is exercised by a unit test
    tested = RULE_TESTS.read_text()
    untested = [r["alert"] for r in alerting_rules() if r["alert"] not in tested]
    assert not untested, untested


def test_every_alert_is_labelled_annotated_and_has_a_runbook_section():
    anchors = runbook_anchors()
    names = [r["alert"] for r in alerting_rules()]
    assert len(names) == len(set(names)), names
    for rule in alerting_rules():
        name = rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, name
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], name
        page, _, anchor = notes["runbook_url"].partition("#")
        assert page == "docs/operations.md" and anchor == name.lower(), (name, notes)
        assert anchor in anchors, f"{name}: no section '### {name}' in docs/operations.md"
    # and no runbook section for an alert that does not exist
    sections = re.findall(r"^### (Kvguard\w+)$", RUNBOOK.read_text(), re.M)
    assert sorted(sections) == sorted(names)


def test_the_required_alerts_exist():
    by_name = {r["alert"]: r for r in alerting_rules()}
    required = {
        "KvguardIntegrityViolation": ("kvguard_violations_total", "critical"),
        "KvguardAbortRateHigh": ("kvguard_requests_aborted_total", None),
        "KvguardUncheckedForward": ("kvguard_unchecked_forwards_total", "critical"),
        "KvguardInternalErrors": ("kvguard_internal_errors_total", None),
        "KvguardFailedClosed": ("kvguard_healthy", "critical"),
        "KvguardQuarantineNearCap": ("kvguard_quarantine_cap_pages", None),
        "KvguardCpuOverBudget": ("instance:kvguard_check_cpu_share:rate5m", None),
        "KvguardMetricsAbsent": ("kvguard_steps_checked_total", "critical"),
        "KvguardRecomputeBreakerOpen": ("kvguard_recompute_breaker_open", "critical"),
        "KvguardRecomputeRateHigh": ("kvguard_requests_recomputed_total", None),
    }
    for name, (series, severity) in required.items():
        assert name in by_name, name
        assert series in series_in(by_name[name]["expr"]), (name, by_name[name]["expr"])
        assert severity in (None, by_name[name]["labels"]["severity"]), name


def test_dashboard_shape():
    dash = dashboard()
    assert dash["uid"] == "kvguard" and dash["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "kvguard_steps_checked_total" in variables["instance"]["definition"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), ids
    for p in panels():
        where = p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert p["targets"] and p["description"], where
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), where
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0, where
        for t in p["targets"]:  # every selector filters on the server variable
            assert t["expr"].count("{") == t["expr"].count('instance=~"$instance"'), t["expr"]


def test_every_series_named_is_known():
    """The rules and the dashboard name only series kvguard defines, SGLang series the runbook
    lists, and rules the file records; kvguard's series are all documented and all shown."""
    defined = guard_series()
    documented = runbook_series()
    recorded = {r["record"] for r in recording_rules()}
    named: dict[str, str] = {}
    for rule in alerting_rules() + recording_rules():
        named |= dict.fromkeys(series_in(rule["expr"]), rule.get("alert", rule.get("record")))
    for expr in dashboard_exprs():
        named |= dict.fromkeys(series_in(expr), expr)
    for expr in [r["expr"] for r in alerting_rules() + recording_rules()] + dashboard_exprs():
        assert "sglang:" not in expr, f"select SGLang's series by either spelling: {expr}"
    for name, where in named.items():
        if name.startswith("kvguard_"):
            assert name in defined, f"{where}: {name} is not a series of kvguard.metrics"
        elif name.startswith("sglang:"):
            assert name in documented, f"{where}: {name} is not listed in docs/operations.md"
        else:
            assert name in recorded, f"{where}: {name} is neither a series nor a recorded rule"
    assert set(defined) <= documented, set(defined) - documented
    assert documented - set(defined) <= {n for n in named if n.startswith("sglang:")}
    shown = set().union(*(series_in(e) for e in dashboard_exprs()))
    assert set(defined) <= shown, f"not on the dashboard: {set(defined) - shown}"


def test_violations_alert_whatever_became_of_the_request():
    """A healed violation is still a violation: the violation alert reads every violation, not
    only those that aborted a request."""
    rule = next(r for r in alerting_rules() if r["alert"] == "KvguardIntegrityViolation")
    assert series_in(rule["expr"]) == {"kvguard_violations_total"}, rule["expr"]
    assert "action" not in rule["expr"], rule["expr"]


# -- engine tier: a live server, a live Prometheus ------------------------------------------
# paranoid verifies every read before tokens leave, so a violation is healed (the default
# on_violation, recompute); a breaker of one recompute a minute makes the next one abort.
SERVER_ARGS = [
    "--page-size",
    "16",
    "--max-total-tokens",
    "1024",
    "--kvguard-mode",
    "paranoid",
    "--kvguard-recompute-breaker-per-minute",
    "1",
]
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return "


class Live:
    """A kvguard-serve with the fault injector armed (nothing planned yet), and a Prometheus
    scraping it."""

    def __init__(self, serve_processes, workdir: Path):
        self.control = workdir / "fuzz-control.json"
        self.fuzz_log = workdir / "fuzz.jsonl"
        model, is_default = serving_model()
        args = SERVER_ARGS + ([] if is_default else ["--model-path", str(model)])
        env = {
            "KVGUARD_FUZZ_CONTROL": str(self.control),
            "KVGUARD_FUZZ_LOG": str(self.fuzz_log),
            # 64 pages: the default cap (1%) is one page, and the injected fault quarantines one;
            # the server must stay healthy for the other test, whichever runs first
            "KVGUARD_QUARANTINE_CAP": "0.5",
        }
        self.srv = serve_processes(args, env)
        for _ in range(3):
            self.generate(8)
        self.instance = f"127.0.0.1:{self.srv.port}"
        self.prom = PrometheusServer(workdir / "prometheus", [self.instance], [RULES])
        self.prom.start()

    def generate(self, n: int) -> requests.Response:
        return requests.post(
            f"{self.srv.url}/generate",
            timeout=120,
            json={
                "text": PROMPT,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            },
        )

    def injected(self, inj_id: int) -> bool:
        """The fault injector injected plan entry ``inj_id``."""
        log = self.fuzz_log.read_text().splitlines() if self.fuzz_log.exists() else []
        events = [json.loads(line) for line in log]
        return any(e.get("id") == inj_id and e["event"] == "injected" for e in events)

    def value(self, name: str) -> float:
        """The latest scraped value of one of this server's series, summed."""
        result = self.prom.query(f"sum({selector(name, self.instance)})")
        return float(result[0]["value"][1]) if result else 0.0

    def alive(self) -> bool:
        """True while the server runs; its log's tail as the failure if it died."""
        assert self.srv.running(), f"kvguard-serve died:\n{self.srv.log_tail()}"
        return True

    def rules_evaluated(self) -> list[dict]:
        """Every rule, once each has been evaluated on scraped data."""
        self.prom.wait_for(
            lambda: self.prom.query("kvguard_steps_checked_total"), 60, "kvguard series scraped"
        )
        self.prom.wait_for(
            lambda: self.prom.query('count(count_over_time(up{job="kvguard"}[1m]) >= 3)'),
            60,
            "three scrapes",
        )
        return self.prom.wait_for(
            lambda: [r for r in self.prom.rules() if r["health"] != "unknown"] == self.prom.rules()
            and self.prom.rules(),
            60,
            "rules evaluated",
        )


@pytest.fixture(scope="module")
def live(serve_processes, tmp_path_factory):
    binary("prometheus")  # a skip (or in CI a failure) before a server is started for nothing
    stack = Live(serve_processes, tmp_path_factory.mktemp("ops"))
    yield stack
    stack.prom.stop()


@pytest.mark.engine
def test_rules_and_dashboard_evaluate_against_a_live_server(live):
    rules = live.rules_evaluated()
    assert len(rules) == len(alerting_rules()) + len(recording_rules())
    failed = {r["name"]: r.get("lastError") for r in rules if r["health"] != "ok"}
    assert not failed, failed
    for expr in [r["expr"] for r in alerting_rules() + recording_rules()] + dashboard_exprs():
        live.prom.query(as_promql(expr))  # raises with Prometheus's error
    # every series named has samples from this server, but a labelled one not counted yet
    named = set().union(*(series_in(e) for e in dashboard_exprs()))
    named |= {n for r in alerting_rules() for n in series_in(r["expr"])}
    labelled = {n for n, is_labelled in guard_series().items() if is_labelled}
    have = {}
    for name in sorted(named):
        result = live.prom.query(selector(name, live.instance))
        assert result or name in labelled, f"{name}: no samples from {live.instance}"
        have[name] = bool(result)
    # every panel shows data where the series it reads have samples
    for expr in panel_exprs():
        if all(have[n] for n in series_in(expr)):
            assert live.prom.query(as_promql(expr)), expr
    value = {
        n: float(live.prom.query(f"sum({selector(n, live.instance)})")[0]["value"][1])
        for n, ok in have.items()
        if ok
    }
    assert value["kvguard_steps_checked_total"] > 0 and value["kvguard_tokens_checked_total"] > 0
    assert value["kvguard_unchecked_forwards_total"] == 0
    assert value["kvguard_healthy"] == 1 and value["kvguard_quarantine_cap_pages"] >= 1
    assert value["kvguard_state_bytes"] > 0
    # the recording rule joins kvguard's series with SGLang's on this server
    share = live.prom.query("instance:kvguard_check_cpu_share:rate5m")
    assert [s["metric"]["instance"] for s in share] == [live.instance], share


@pytest.mark.engine
def test_alerts_quiet_on_a_healthy_server_then_fire_on_injected_faults(live):
    live.rules_evaluated()
    # The CPU budget alert is left out: on two loaded cores the guard's share of a short burst
    # can be anything; its unit test covers it.
    quiet = 'ALERTS{alertname!="KvguardCpuOverBudget"}'
    assert live.prom.query(quiet) == []
    clean = live.generate(24)
    assert clean.status_code == 200, clean.text
    plan = [{"id": 1, "cls": "bit_flip", "seed": 7}]
    # a bit flip is healed: recomputed, the client answered as the clean run was
    live.control.write_text(json.dumps({"plan": plan}))
    healed = live.generate(24)
    assert live.injected(1), healed.text
    assert healed.status_code == 200, healed.text
    assert healed.json()["text"] == clean.json()["text"]
    # a second within the minute: past the breaker's limit (one), aborted
    plan.append({"id": 2, "cls": "bit_flip", "seed": 8})
    live.control.write_text(json.dumps({"plan": plan}))
    aborted = live.generate(24)
    assert live.injected(2), aborted.text
    assert "KV cache integrity violation" in aborted.text, aborted.text
    firing = live.prom.wait_for(
        lambda: live.alive()
        and live.prom.query('ALERTS{alertname="KvguardIntegrityViolation", alertstate="firing"}'),
        60,
        "KvguardIntegrityViolation firing",
    )
    assert {a["metric"]["instance"] for a in firing} == {live.instance}
    kinds = {a["metric"]["kind"] for a in firing}
    assert "checksum_mismatch" in kinds and kinds <= {k.name.lower() for k in Kind}, kinds
    breaker = live.prom.wait_for(
        lambda: live.prom.query(
            'ALERTS{alertname="KvguardRecomputeBreakerOpen", alertstate="firing"}'
        ),
        60,
        "KvguardRecomputeBreakerOpen firing",
    )
    assert {a["metric"]["instance"] for a in breaker} == {live.instance}
    alerts = {a["labels"]["alertname"]: a for a in live.prom.api("alerts")["alerts"]}
    for name in ("KvguardIntegrityViolation", "KvguardRecomputeBreakerOpen"):
        assert live.instance in alerts[name]["annotations"]["summary"], alerts[name]
        assert alerts[name]["annotations"]["runbook_url"] == f"docs/operations.md#{name.lower()}"
    # one request recomputed (counted once), one aborted (counted at each step that read the bad
    # KV: under the overlap scheduler, the next step was launched before the verdict); what the
    # recompute cost is counted. The abort may not be scraped yet: the alerts fired on the heal.
    live.prom.wait_for(
        lambda: live.value("kvguard_requests_aborted_total") >= 1, 30, "the abort scraped"
    )
    assert live.value("kvguard_requests_recomputed_total") == 1
    assert live.value("kvguard_recompute_seconds_total") > 0
    assert live.value("kvguard_tokens_recomputed_total") >= 1
    assert live.value("kvguard_pages_quarantined_total") >= 1
    # contained: the server goes on serving
    assert live.generate(4).status_code == 200 and live.alive()

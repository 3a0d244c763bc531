"""kvguard's Prometheus series: one namespace, base units, counters ending in _total, each test on
its own CollectorRegistry; and the multiprocess path by which a scheduler process's counters
reach the server's /metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from kvguard import metrics
from kvguard.metrics import GuardMetrics

COUNTERS = [
    "kvguard_steps_checked_total",
    "kvguard_tokens_checked_total",
    "kvguard_tokens_checksummed_total",
    "kvguard_violations_total",
    "kvguard_requests_aborted_total",
    "kvguard_pages_quarantined_total",
    "kvguard_check_seconds_total",
    "kvguard_transfers_checked_total",
    "kvguard_transfer_check_seconds_total",
    "kvguard_forward_hash_seconds_total",
    "kvguard_unchecked_forwards_total",
]


def samples(registry: CollectorRegistry) -> dict[str, float]:
    return {
        s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else ""): s.value
        for family in registry.collect()
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_series_names():
    registry = CollectorRegistry()
    GuardMetrics(registry)
    families = {f.name: f.type for f in registry.collect()}
    assert all(name.startswith("kvguard_") for name in families), families
    assert all(kind in ("counter", "gauge") for kind in families.values()), families
    names = set(samples(registry))
    assert set(COUNTERS) - {"kvguard_violations_total"} <= names  # labelled: absent until used
    assert "kvguard_state_bytes" in names


def test_counts_land_in_the_given_registry_only():
    mine, other = CollectorRegistry(), CollectorRegistry()
    m = GuardMetrics(mine)
    GuardMetrics(other)
    m.steps_checked.inc()
    m.tokens_checked.inc(512)
    m.check_seconds.inc(0.25)
    m.violations.labels(kind="epoch_mismatch").inc(2)
    m.state_bytes.set(4096)
    got = samples(mine)
    assert got["kvguard_steps_checked_total"] == 1
    assert got["kvguard_tokens_checked_total"] == 512
    assert got["kvguard_check_seconds_total"] == 0.25
    assert got['kvguard_violations_total{"kind": "epoch_mismatch"}'] == 2
    assert got["kvguard_state_bytes"] == 4096
    assert samples(other)["kvguard_steps_checked_total"] == 0


def test_one_set_per_registry():
    registry = CollectorRegistry()
    GuardMetrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        GuardMetrics(registry)


def test_default_is_one_instance_on_the_global_registry(monkeypatch):
    registry = CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", registry)
    monkeypatch.setattr(metrics, "_default", None)
    first = GuardMetrics.default()
    assert GuardMetrics.default() is first
    first.requests_aborted.inc()
    assert samples(registry)["kvguard_requests_aborted_total"] == 1


SCHEDULER = """
from kvguard.metrics import GuardMetrics
m = GuardMetrics()
m.steps_checked.inc(3)
m.violations.labels(kind="checksum_mismatch").inc()
m.state_bytes.set(1000)
"""
SERVER = """
import json
from prometheus_client import CollectorRegistry, multiprocess
registry = CollectorRegistry()
multiprocess.MultiProcessCollector(registry)
print(json.dumps({s.name + str(sorted(s.labels.items())): s.value
                  for f in registry.collect() for s in f.samples}))
"""


def test_scheduler_counters_reach_the_server_through_multiprocess_mode(tmp_path, monkeypatch):
    """Two scheduler processes count; a third process (the HTTP server's role) aggregates them
    from PROMETHEUS_MULTIPROC_DIR, as SGLang's /metrics does with --enable-metrics."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    for _ in range(2):
        subprocess.run([sys.executable, "-c", SCHEDULER], check=True, timeout=60)
    out = subprocess.run(
        [sys.executable, "-c", SERVER], check=True, capture_output=True, text=True, timeout=60
    )
    got = json.loads(out.stdout)
    assert got["kvguard_steps_checked_total[]"] == 6
    assert got["kvguard_violations_total[('kind', 'checksum_mismatch')]"] == 2
    # livesum: summed over the schedulers (a dead one's file goes with mark_process_dead)
    assert got["kvguard_state_bytes[]"] == 2000

"""The guard never takes the server down, live: a failure in any of its hooks fails the affected
requests closed and the engine serves on (at --tp 2 too, no rank left waiting); a storm of faults
under load costs what it flags and leaves nothing quarantined once idle; a guard that failed
closed says so at /health, refuses new requests with a clear error and stays up."""

from __future__ import annotations

import json
import random
import time

import pytest
import requests
from guarded_engine import guarded_engine, workload
from tiny_model import serving_model

from kvguard.fuzz.client import _top2
from kvguard.fuzz.guard_faults import HOOKS
from kvguard.fuzz.oracle import TIE_MARGIN, compare
from kvguard.health import FAILURES_TO_FAIL_CLOSED

pytestmark = pytest.mark.engine


def _faults_fired(eng) -> dict[str, int]:
    out: dict[str, int] = {}
    if eng.fuzz_log.exists():
        for line in eng.fuzz_log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "guard_fault":
                out[rec["hook"]] = out.get(rec["hook"], 0) + 1
    return out


def _served_or_refused(out: list[dict], reference: list[dict]) -> None:
    """No output differs from the clean run's: each is the clean output or an error."""
    for o, r in zip(out, reference):
        if "error" not in o:
            assert o["output_ids"] == r["output_ids"], o["rid"]


@pytest.mark.parametrize("tp", [1, 2])
def test_every_hook_failure_fails_closed(tmp_path, tp):
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}
    with guarded_engine(tmp_path, 16, mode="sampled", env=env, tp_size=tp) as eng:
        prompts = workload(8)
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference)
        for hook in HOOKS:
            eng.inject("guard_fault", seed=0, hook=hook, after=0, count=1)
            if hook == "resolve":  # acting runs on flagged steps only
                eng.inject("bit_flip", seed=5)
            out = eng.run(prompts, tag=hook)
            _served_or_refused(out, reference)
        if tp == 2:  # one rank cannot plan its acting on a flagged step, the other can: both
            # fail the batch closed (one healing what the other aborts would split them)
            eng.inject("guard_fault", seed=0, hook="resolve", after=0, count=1, rank=1)
            eng.inject("bit_flip", seed=5)
            out = eng.run(prompts, tag="split")
            _served_or_refused(out, reference)
            assert any("error" in o for o in out), "the flagged step was not failed closed"
        fresh = eng.run(prompts[:3], tag="fresh")  # every rank still in step, nothing leaked
        assert all("error" not in o for o in fresh), fresh
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]
        # (freed pages reach the allocator's free list lazily: a free may fail a round later)
        fired = _faults_fired(eng)
        assert [h for h in HOOKS if not fired.get(h)] == [], fired
        if tp == 2:  # on every rank for each hook, then on rank 1 alone
            assert fired["resolve"] >= 3, fired


def _serve(serve_processes, tmp_path, env=None):
    model, _ = serving_model()
    control, log = tmp_path / "control.json", tmp_path / "fuzz.jsonl"
    srv = serve_processes(
        ["--model-path", str(model), "--page-size", "16", "--max-total-tokens", "16384"],
        env={"KVGUARD_FUZZ_CONTROL": str(control), "KVGUARD_FUZZ_LOG": str(log), **(env or {})},
    )
    return srv, control, log


def _generate(srv, prompt: str, n: int = 32) -> requests.Response:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n}}
    return requests.post(f"{srv.url}/generate", json=body, timeout=300)


def _generate_top2(srv, prompt: str, n: int) -> requests.Response:
    """A greedy completion with the two best tokens at each step (the oracle's tie test)."""
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": n},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    return requests.post(f"{srv.url}/generate", json=body, timeout=300)


def _output(answer: dict) -> tuple[list[int], list]:
    """(output ids, top-2 per output token) of a /generate answer, as the oracle compares them."""
    top = answer["meta_info"]["output_top_logprobs"]
    return answer["output_ids"], [_top2(pos) for pos in top]


def test_a_storm_under_load_then_a_clean_request(shared_server):
    """A bit flip injected at every decode step for 30 steps while requests keep arriving (48
    distinct prompts, 16 at a time): the server stays up, no output differs from the clean
    run's (a request is served clean, aborted for the violation, or refused while the guard had
    failed closed), a fresh request is served clean, and once idle nothing stays quarantined
    (pages scrubbed back into service) and the guard is healthy. On the session's shared server
    (its quarantine cap, 0.25, is one the storm stays under: this is about containment and
    cost, not failing closed), which must be left healthy and idle for the tests after it."""
    from concurrent.futures import ThreadPoolExecutor

    srv = shared_server.get()
    before = srv.metric_totals()
    rng = random.Random(7)
    prompts = [f"{i}: " + " ".join(str(rng.randint(0, 999)) for _ in range(20)) for i in range(48)]
    with ThreadPoolExecutor(16) as ex:
        reference = list(ex.map(lambda p: _generate_top2(srv, p, 64).json(), prompts))
    ids = shared_server.inject([{"cls": "bit_flip", "seed": i, "max_tries": 50} for i in range(30)])
    with ThreadPoolExecutor(16) as ex:
        out = list(ex.map(lambda p: _generate_top2(srv, p, 64), prompts))
    events = shared_server.fuzz_events(ids)
    steps = sorted(e["step"] for e in events if e.get("event") == "injected")
    assert len(steps) >= 25 and steps[-1] - steps[0] < 2 * len(steps), steps  # a step apart
    for resp, ref in zip(out, reference):
        if resp.status_code == 200:
            # a healed request is prefilled again: its KV is computed by another path, so a
            # token whose two best were a near tie in the clean run may flip (the oracle's rule)
            verdict, where = compare(_output(ref), _output(resp.json()), TIE_MARGIN)
            assert verdict in ("clean", "near_tie"), (verdict, where)
        else:
            assert "KV cache integrity violation" in resp.text or "KVGuardFailedClosed" in resp.text
    assert sum(r.status_code != 200 for r in out) >= 1
    srv.wait_idle()
    assert srv.running() and srv.healthy()
    fresh = _generate(srv, prompts[0], 64)
    assert fresh.status_code == 200 and fresh.json()["output_ids"] == reference[0]["output_ids"]
    srv.wait_idle()
    m = srv.metric_totals()
    grew = {k: m.get(k, 0) - before.get(k, 0) for k in m}
    assert grew.get("kvguard_violations_total", 0) >= 25
    assert m.get("kvguard_quarantined_pages", 0) == 0  # scrubbed back into service
    assert grew.get("kvguard_internal_errors_total", 0) == 0
    assert m.get("kvguard_healthy", 1) == 1


def test_a_guard_that_failed_closed_says_so_and_stays_up(serve_processes, tmp_path):
    srv, control, _ = _serve(serve_processes, tmp_path)
    ok = _generate(srv, "def f(x):", 8)
    assert ok.status_code == 200
    entry = {"id": 1, "cls": "guard_fault", "hook": "check", "after": 0}
    control.write_text(json.dumps({"plan": [{**entry, "count": 10 * FAILURES_TO_FAIL_CLOSED}]}))
    # Every step fails its check (an overlapped step may take a request's second failure):
    # each request is aborted, never served, until the guard fails closed and the front door
    # refuses the rest.
    deadline = time.monotonic() + 60
    while requests.get(f"{srv.url}/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "still healthy"
        assert _generate(srv, "import os", 8).status_code != 200
    health = requests.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 503 and "restart" in health.json()["kvguard"]["reason"]
    refused = _generate(srv, "import sys", 8)
    assert refused.status_code == 503
    assert refused.json()["error"]["type"] == "KVGuardFailedClosed"
    m = srv.metric_totals()  # /metrics still answers
    assert m["kvguard_healthy"] == 0 and m["kvguard_internal_errors_total"] >= 8
    assert srv.running()

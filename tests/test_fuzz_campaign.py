"""A short fault-injection campaign against a real kvguard-serve (paranoid, page size 16): every
injected corruption must be aborted or harmless, no clean request aborted, the server alive and
no KV held once idle. ~3-5 min on two loaded cores (one server start, two passes of the workload).

The full campaign (see fuzz/results/report.md for the command) runs the same code at scale."""

from __future__ import annotations

import json

from tiny_model import serving_model

from kvguard.fuzz.campaign import Settings
from kvguard.fuzz.cli import run_campaign
from kvguard.fuzz.client import Response
from kvguard.fuzz.injectors import INJECTORS
from kvguard.fuzz.oracle import classify, compare, injections_from_log
from kvguard.fuzz.workload import build_workload, schedule_injections


def test_schedule_is_a_function_of_the_seed():
    def plan(seed):
        waves = build_workload(seed, 120, 24)
        schedule_injections(seed, waves, 20, list(INJECTORS))
        return [(w.index, [r.text for r in w.requests], w.injections) for w in waves]

    assert plan(3) == plan(3)
    assert plan(3) != plan(4)
    classes = [e["cls"] for _, _, entries in plan(3) for e in entries]
    assert sorted(set(classes)) == sorted(INJECTORS)  # 20 entries: every class twice
    assert all(classes.count(c) == 2 for c in INJECTORS)


def test_oracle_outcomes():
    ref = {
        k: (v, None)
        for k, v in {"a": [1, 2], "b": [3, 4], "c": [5, 6], "d": [7, 8], "e": [9, 9]}.items()
    }
    responses = [
        Response("i-a", "a", 1, status=200, output_ids=[1, 2]),  # victim, unharmed
        Response("i-b", "b", 1, status=500, violation="kvg-1"),  # victim, aborted
        Response("i-c", "c", 1, status=200, output_ids=[5, 0]),  # wrong output
        Response("i-d", "d", 1, status=500, violation="kvg-2"),  # aborted, not a victim
        Response("i-e", "e", 1, status=200, output_ids=[9], client_abort=True),
    ]
    events = [
        {"event": "injected", "id": 1, "cls": "bit_flip", "at_step": 10, "victims": ["i-a"]},
        {"event": "injected", "id": 2, "cls": "table_swap", "at_step": 12, "victims": ["i-b"]},
        {"event": "injected", "id": 3, "cls": "stale_writer", "at_step": 13, "victims": []},
        {"event": "landed", "id": 3, "cls": "stale_writer", "at_step": 15, "victims": ["i-c"]},
        {"event": "skipped", "id": 4, "cls": "never_written", "step": 30},
    ]
    planned = [
        {"id": i, "cls": c}
        for i, c in enumerate(
            ["bit_flip", "table_swap", "stale_writer", "never_written", "bit_flip"], 1
        )
    ]
    injections = injections_from_log(events, planned)
    records, injections = classify(
        ref, responses, injections, {"i-b": {"step": 14, "request": "i-b"}}
    )
    assert [r["outcome"] for r in records] == [
        "clean",
        "detected",
        "escaped",
        "false_abort",
        "client_abort",
    ]
    assert records[1]["steps_to_abort"] == 2
    assert [injections[i]["outcome"] for i in range(1, 6)] == [
        "masked",
        "detected",
        "escaped",
        "skipped",
        "not_run",
    ]


def test_near_tie_is_not_an_escape():
    top = [[-0.1, 5, -3.0, 6], [-0.50, 7, -0.55, 8], [-0.2, 9, -2.0, 1]]
    flipped = [[-0.1, 5, -3.0, 6], [-0.52, 8, -0.54, 7], [-0.2, 9, -2.0, 1]]
    assert compare(([5, 7, 9], top), ([5, 7, 9], top))[0] == "clean"
    outcome, where = compare(([5, 7, 9], top), ([5, 8, 9], flipped))
    assert outcome == "near_tie" and where["first_diff"] == 1
    decisive = [[-0.1, 5, -3.0, 6], [-0.1, 8, -4.0, 7], [-0.2, 9, -2.0, 1]]
    assert compare(([5, 7, 9], top), ([5, 8, 9], decisive))[0] == "escaped"
    assert compare(([5, 7, 9], top), ([5, 7], None))[0] == "escaped"  # shorter: never a tie
    three_way = [[-0.1, 5, -3.0, 6], [-0.53, 4, -0.53, 7], [-0.2, 9, -2.0, 1]]  # 4, 7, 8 tied
    assert compare(([5, 7, 9], top), ([5, 4, 9], three_way))[0] == "near_tie"


def test_short_campaign_paranoid(tmp_path):
    model, _ = serving_model()
    s = Settings(
        seed=11,
        classes=tuple(INJECTORS),
        num_requests=96,
        num_injections=10,
        modes=("paranoid",),
        page_sizes=(16,),
        out=tmp_path,
        model_path=str(model),
        wave_size=24,
        max_tries=60,
    )
    report = run_campaign(s, progress=False)
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "report.md", "report.png"}
    cfg = json.loads((tmp_path / "report.json").read_text())["configs"][0]
    summary, where = cfg["summary"], f"see {tmp_path / 'report.md'}"
    assert not cfg.get("start_error") and not cfg.get("error"), (
        cfg.get("error") or cfg.get("start_error"),
        where,
    )
    assert summary["server_deaths"] == 0, ([d["log_tail"][-1500:] for d in cfg["deaths"]], where)
    assert summary["requests"]["escaped"] == 0, (
        [r for r in cfg["requests"] if r["outcome"] == "escaped"],
        where,
    )
    assert summary["requests"]["false_abort"] == 0 and summary["clean_pass_guard_aborts"] == 0, (
        where
    )
    assert summary["requests"]["error"] == 0, (
        [r for r in cfg["requests"] if r["outcome"] == "error"][:5],
        where,
    )
    assert summary["idle_used_tokens_end"] == 0, where
    assert summary["injections"]["detected"] >= 3, (summary["injections"], where)
    assert report["configs"][0]["verdict"] == []

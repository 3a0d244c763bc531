"""Short fault-injection campaigns against a real kvguard-serve (page size 16): every injected
corruption must be healed, aborted or harmless, no clean request aborted, no request aborted that
only held a page an injection involved (collateral), the server alive and no KV held once idle;
and the tenant barrier (cross_tenant) holding. The guarded servers heal (``on_violation``
recompute, kvguard's default): in mode paranoid the classes the guard heals must cost their
clients no error at all (a healed request's output, streamed tokens included, is the clean
run's), and mode sampled must heal nothing. ~3-5 min each on two loaded cores (one server start,
two passes of the workload).

The full campaign (see fuzz/results/report.md for the command) runs the same code at scale."""

from __future__ import annotations

import json

import pytest
from tiny_model import serving_model

from kvguard.fuzz.campaign import Settings
from kvguard.fuzz.cli import run_campaign
from kvguard.fuzz.client import Response
from kvguard.fuzz.injectors import INJECTORS, POOL_CLASSES
from kvguard.fuzz.oracle import classify, compare, injections_from_log
from kvguard.fuzz.workload import TENANTS, build_workload, schedule_injections


def test_schedule_is_a_function_of_the_seed():
    def plan(seed):
        waves = build_workload(seed, 120, 24)
        schedule_injections(seed, waves, 2 * len(INJECTORS), list(INJECTORS))
        return [(w.index, [r.text for r in w.requests], w.injections) for w in waves]

    assert plan(3) == plan(3)
    assert plan(3) != plan(4)
    classes = [e["cls"] for _, _, entries in plan(3) for e in entries]
    assert sorted(set(classes)) == sorted(INJECTORS)  # every class twice
    assert all(classes.count(c) == 2 for c in INJECTORS)
    *_, (_, _, last) = plan(3)
    assert "stale_writer" not in {e["cls"] for e in last}  # nothing after it would reuse a page


def test_workload_tenants_share_prefixes_across_tenants():
    """With tenants the prompts are the seed's prompts; every namespace shape occurs; a shared
    header reaches several tenants (cross-tenant repeats), a conversation keeps its tenant."""
    plain = build_workload(5, 200, 24)
    waves = build_workload(5, 200, 24, tenants=True)
    reqs = [r for w in waves for r in w.requests]
    assert [r.text for r in reqs] == [r.text for w in plain for r in w.requests]
    assert {(r.extra_key, r.cache_salt) for r in reqs} == set(TENANTS)
    by_head: dict[str, set] = {}
    for r in reqs:
        by_head.setdefault(r.text[:100], set()).add((r.extra_key, r.cache_salt))
    assert max(len(t) for t in by_head.values()) >= 3
    by_conv: dict[int, set] = {}
    for r in reqs:
        if r.conversation is not None:
            by_conv.setdefault(r.conversation, set()).add((r.extra_key, r.cache_salt))
    assert all(len(t) == 1 for t in by_conv.values())
    assert all(r.extra_key is None and r.cache_salt is None for w in plain for r in w.requests)


def test_oracle_outcomes():
    ref = {
        k: (v, None)
        for k, v in {
            "a": [1, 2],
            "b": [3, 4],
            "c": [5, 6],
            "d": [7, 8],
            "e": [9, 9],
            "f": [2, 2],
            "g": [4, 4],
            "h": [6, 6],
        }.items()
    }
    responses = [
        Response("i-a", "a", 1, status=200, output_ids=[1, 2]),  # victim, unharmed
        Response("i-b", "b", 1, status=500, violation="kvg-1"),  # victim, aborted
        Response("i-c", "c", 1, status=200, output_ids=[5, 0]),  # wrong output
        Response("i-d", "d", 1, status=500, violation="kvg-2"),  # aborted, untouched
        Response("i-e", "e", 1, status=200, output_ids=[9], client_abort=True),
        Response("i-f", "f", 1, status=500, violation="kvg-3"),  # aborted, only exposed
        Response("i-g", "g", 1, status=200, output_ids=[4, 4]),  # exposed, completed
        Response("i-h", "h", 1, status=200, output_ids=[6, 6]),  # read another tenant's KV
    ]
    events = [
        {"event": "injected", "id": 1, "cls": "bit_flip", "at_step": 10, "victims": ["i-a"]},
        {
            "event": "injected",
            "id": 2,
            "cls": "premature_free",
            "at_step": 12,
            "victims": ["i-b"],
            "exposed": [],
        },
        {
            "event": "victims",
            "id": 2,
            "cls": "premature_free",
            "at_step": 13,
            "victims": ["i-b"],
            "exposed": ["i-f", "i-g"],
        },
        {
            "event": "injected",
            "id": 3,
            "cls": "stale_writer",
            "at_step": 13,
            "victims": [],
            "pending": True,
        },
        {"event": "landed", "id": 3, "cls": "stale_writer", "at_step": 15, "victims": ["i-c"]},
        {"event": "skipped", "id": 4, "cls": "never_written", "step": 30},
        {
            "event": "injected",
            "id": 6,
            "cls": "cross_tenant",
            "at_step": 31,
            "victims": ["i-h"],
            "why": {"i-h": "read another tenant's KV"},
        },
        {
            "event": "injected",
            "id": 7,
            "cls": "cross_tenant",
            "at_step": 33,
            "victims": [],
            "detail": {"refused": True},
        },
        {
            "event": "injected",
            "id": 8,
            "cls": "stale_writer",
            "at_step": 34,
            "victims": [],
            "pending": True,
        },
    ]
    classes = ["bit_flip", "premature_free", "stale_writer", "never_written", "bit_flip"]
    classes += ["cross_tenant", "cross_tenant", "stale_writer"]
    planned = [{"id": i, "cls": c} for i, c in enumerate(classes, 1)]
    injections = injections_from_log(events, planned)
    records, injections = classify(
        ref, responses, injections, {"i-b": {"step": 14, "request": "i-b"}}
    )
    assert [r["outcome"] for r in records] == [
        "exposed",  # a victim that completed with the reference tokens
        "detected",
        "escaped",
        "false_abort",
        "client_abort",
        "collateral",
        "clean",
        "escaped",  # identical tokens, but served from another tenant's KV
    ]
    assert records[1]["steps_to_abort"] == 2
    assert records[5]["exposed_to"] == [2] and records[7]["leak"]
    assert [injections[i]["outcome"] for i in range(1, 9)] == [
        "exposed",
        "detected",
        "escaped",
        "skipped",
        "not_run",
        "escaped",
        "refused",
        "not_landed",
    ]
    assert (injections[2]["aborts"], injections[2]["victims_aborted"]) == (2, 1)
    assert injections[2]["collateral"] == 1


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


def _campaign(tmp_path, **kw) -> tuple[dict, str]:
    model, _ = serving_model()
    s = Settings(
        **{
            "num_requests": 96,
            "modes": ("paranoid",),
            "page_sizes": (16,),
            "out": tmp_path,
            "model_path": str(model),
            "wave_size": 24,
            "max_tries": 60,
            **kw,
        }
    )
    run_campaign(s, progress=False)
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "report.md", "report.png"}
    cfg = json.loads((tmp_path / "report.json").read_text())["configs"][0]
    return cfg, f"see {tmp_path / 'report.md'}"


# Classes whose victims the guard heals (recomputes) in modes verified and paranoid: no client of
# a request charged to one of them may see an error. The data (seeds 11 and 21, paranoid and
# verified, page sizes 16 and 1): every class's flagged victims were recomputed, none aborted but
# one request hit by three injections, aborted once its budget of recomputes was spent (healing
# may still abort there, and for a step the guard could not judge: guard faults, not injected
# here). cross_tenant's bad hits were refused (no reader to heal); a reader it flags is healed too.
HEALED = (
    "premature_free",
    "double_allocation",
    "stale_writer",
    "read_before_ready",
    "table_redirect",
    "table_swap",
    "stale_prefix",
    "shared_write",
    "never_written",
    "bit_flip",
    "cross_tenant",
    "exponent_flip",
    "in_forward_flip",
    "lost_store",
    "misdirected_store",
    "flipped_store",
)
BUDGET_SPENT = "recompute budget spent"  # the guard's reason: healed as often as allowed


def _healed(cfg: dict, where: str, classes=HEALED) -> None:
    """In recompute mode: the guard did heal, and the healed classes cost their clients no error
    (an abort after the request's recompute budget was spent apart)."""
    summary = cfg["summary"]
    assert cfg.get("on_violation") == "recompute", where
    cls_of = {i["id"]: i["cls"] for i in cfg["injections"]}
    errors = [
        r
        for r in cfg["requests"]
        if r.get("client_error")
        and cls_of.get(r.get("charged_to")) in classes
        and not (r.get("why_not_healed") or "").startswith(BUDGET_SPENT)
    ]
    assert not errors, (errors[:5], summary["aborts_by_class"], where)
    reasons = [k for k in summary["not_healed"] if not k.startswith(BUDGET_SPENT)]
    assert not reasons, (summary["not_healed"], where)  # no breaker, no unverified mode
    assert summary["requests_recomputed"] > 0, (summary["aborts_by_class"], where)
    assert summary["recomputes_then_error"] == 0 and summary["streams_withdrawn"] == 0, where


def _no_harm(cfg: dict, where: str) -> None:
    """No wrong output out, no healthy request aborted, nothing failed, server alive, no leak."""
    summary = cfg["summary"]
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
    # a request whose own KV was intact (it only held a page an injection involved) is not aborted
    assert summary["requests"]["collateral"] == 0, (
        [r for r in cfg["requests"] if r["outcome"] == "collateral"][:5],
        summary["aborts_by_class"],
        where,
    )
    assert summary["bad_writes_landed"] == 0, (summary["aborts_by_class"], where)  # firewall
    assert summary["requests"]["error"] == 0, (
        [r for r in cfg["requests"] if r["outcome"] == "error"][:5],
        where,
    )
    assert summary["idle_used_tokens_end"] == 0, where
    assert cfg["verdict"] == [], where


ANY_POOL = tuple(c for c in INJECTORS if c not in POOL_CLASSES)  # the default model's MHA pool


@pytest.mark.campaign
def test_short_campaign_paranoid(tmp_path):
    """Every class an MHA pool takes, one injection each (cross_tenant too: tenants in the
    workload, isolation on)."""
    cfg, where = _campaign(
        tmp_path,
        seed=11,
        classes=ANY_POOL,
        num_injections=len(ANY_POOL),
        tenant_isolation=True,
    )
    _no_harm(cfg, where)
    outcomes = cfg["summary"]["injections"]
    assert outcomes["detected"] + outcomes["recomputed"] >= 3, (outcomes, where)
    _healed(cfg, where)


@pytest.mark.campaign
def test_tenant_barrier_holds(tmp_path):
    """cross_tenant: SGLang's prefix cache hands tenant A's pages to tenant B (a namespace collision
    in the lookup). With isolation on, every such hit is refused or its reader aborted (a reader
    that completes is a leak, counted escaped), and in the clean pass same-tenant reuse still hits
    with no request aborted."""
    cfg, where = _campaign(
        tmp_path,
        seed=12,
        classes=("cross_tenant",),
        num_injections=6,
        modes=("sampled",),
        tenant_isolation=True,
    )
    _no_harm(cfg, where)
    outcomes = cfg["summary"]["injections"]
    assert outcomes["detected"] + outcomes["refused"] >= 3, (outcomes, where)
    assert outcomes["detected"] + outcomes["refused"] == sum(
        v for k, v in outcomes.items() if k not in ("skipped", "not_run")
    ), (outcomes, where)
    clean = cfg["clean"]
    assert clean["tenant_prefix_hits"] > 0 and clean["guard_aborts"] == 0, (clean, where)
    # sampled cannot vouch for every read: it aborts, whatever on_violation says
    assert cfg["on_violation"] == "recompute", where
    assert cfg["summary"]["requests_recomputed"] == 0, (cfg["summary"]["aborts_by_class"], where)

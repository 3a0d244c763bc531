"""The guard inside a live SGLang engine (CPU): real scheduler, allocator, radix cache, KV pool.

Each bug class is made to happen inside the running engine by the fault-injection plugin
(``kvguard.fuzz``, the test-only injection point, driven through its control file). One engine
per page size (16 and 1), in the default mode (verified), serves every test here, switched at
run time between aborting and healing (a ``guard_settings`` plan entry):

- ``on_violation=abort``, for every class: the requests whose KV was touched are aborted with a
  KV-integrity error naming a violation id, every other request's greedy output equals the clean
  reference, the violation is logged with its forensic record, and the engine then answers a
  fresh request correctly;
- ``recompute`` (healing, the default): no client sees an error; every request, its victims
  included, answers exactly as the clean reference did; only requests whose KV an injection
  touched are recomputed; each recompute is logged with its forensic record;
- a byte flipped inside the forward, after every check before it, is caught before its token
  leaves (the read hashed in attention) and healed.

Under tensor parallelism and on the pre-forward fallback read path: ``test_heal_engine``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from guarded_engine import (
    CLASSES,
    GuardedEngine,
    flip_during_forward,
    guarded_engine,
    healed_run,
    violation_events,
    workload,
)

pytestmark = pytest.mark.engine  # every test here runs a live engine


@pytest.fixture(scope="module", params=[16, 1], ids=["ps16", "ps1"])
def engine(request, tmp_path_factory) -> Iterator[GuardedEngine]:
    """The module's engine at one page size (pytest runs every test of one page size, then the
    next), verified, healing; a test that switches it switches it back."""
    tmp = tmp_path_factory.mktemp(f"engine-ps{request.param}")
    with guarded_engine(tmp, request.param, mode="verified") as eng:
        yield eng


def test_each_injected_bug_aborts_only_its_victims(engine: GuardedEngine):
    eng = engine
    eng.settings(on_violation="abort")
    try:
        prompts = workload(16)
        reference = eng.run(prompts, tag="abort-ref")
        assert all("error" not in r for r in reference)
        eng.new_log()
        for i, cls in enumerate(CLASSES):
            inj_id = eng.inject(cls, seed=i)
            out = eng.run(prompts, tag=f"abort-{cls}")
            recs = eng.injection_records(inj_id)
            assert recs and recs[0]["event"] == "injected", f"{cls}: no fitting moment ({recs})"
            victims = set().union(*(set(r["victims"]) for r in recs))
            aborted = [j for j, o in enumerate(out) if "error" in o]
            # every abort names a KV integrity violation with an id
            for j in aborted:
                assert "KV cache integrity violation kvg-" in out[j]["error"], out[j]["error"]
            logged = violation_events(eng.new_log())
            if not aborted:  # a premature free caught before the page was reused: taken back
                repaired = [e for e in logged.values() if "premature_free" in e["kinds"]]
                assert cls == "premature_free" and repaired, f"{cls}: nothing detected"
            # no false abort: only requests whose KV the injection touched are aborted
            extra = [e for e in logged.values() if e["request"] in {out[j]["rid"] for j in aborted}]
            assert {out[j]["rid"] for j in aborted} <= victims, (
                f"{cls}: aborted beyond {victims}: "
                f"{[out[j]['error'][:160] for j in aborted if out[j]['rid'] not in victims]} "
                f"{[e for e in extra if e['request'] not in victims]}"
            )
            # no escape: every request that was not aborted answered exactly as the clean run did
            for j, (o, r) in enumerate(zip(out, reference)):
                if "error" not in o:
                    assert o["output_ids"] == r["output_ids"], f"{cls}: request {j} escaped"
            # the forensic record of each abort reached the log
            for j in aborted:
                vid = out[j]["error"].split("violation ")[1].split(":")[0]
                ev = logged[vid]
                assert ev["kinds"] and ev["request"] and ev["step"] > 0
                assert ev["action"] == "abort" and ev["recomputes"] == 0
                assert any(p["positions"] for p in ev["pages"]) or "quarantined_page" in ev["kinds"]
        # the engine is still serving, and serving correctly
        fresh = eng.run(prompts[:3], tag="abort-fresh")
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]
    finally:
        eng.settings(on_violation="recompute")


def test_each_injected_bug_is_healed(engine: GuardedEngine):
    eng = engine
    prompts = workload(16)
    reference = eng.run(prompts, tag="heal-ref")
    assert all("error" not in r for r in reference)
    eng.new_log()
    for i, cls in enumerate(CLASSES):
        inj_id = eng.inject(cls, seed=i)
        healed_run(eng, prompts, reference, cls, inj_id, tag=f"heal-{cls}")
    fresh = eng.run(prompts[:3], tag="heal-fresh")
    assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]


@pytest.mark.parametrize("engine", [16], indirect=True, ids=["ps16"])
def test_a_flip_during_the_forward_is_healed_where_reads_are_verified(engine: GuardedEngine):
    """With the read hashed in attention (the read path in force here, in /server_info and the
    start-up log) a byte flipped inside the forward is caught before its token leaves and
    healed (``guarded_engine.flip_during_forward``; the pre-forward fallback, where it is
    aborted instead: ``test_heal_engine``)."""
    assert engine.engine.get_server_info()["kvguard"]["read_path"] == "verified_in_attention"
    assert '"read_path": "verified_in_attention"' in engine.log.read_text(errors="replace")
    flip_during_forward(engine, "verified_in_attention")

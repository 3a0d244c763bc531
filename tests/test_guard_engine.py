"""The guard inside a live SGLang engine (CPU): real scheduler, allocator, radix cache, KV pool.

Each bug class is made to happen inside the running engine by the fault-injection plugin
(``kvguard.fuzz``, the test-only injection point, driven through its control file). With
``on_violation=abort`` (healing: ``test_heal_engine``), for every class: the requests whose KV
was touched are aborted with a KV-integrity error naming a violation
id, every other request's greedy output equals the clean reference, the violation is logged with
its forensic record, and the engine then answers a fresh request correctly.
"""

from __future__ import annotations

import pytest
from guarded_engine import guarded_engine, violation_events, workload

CLASSES = [
    "double_allocation",
    "premature_free",
    "shared_write",
    "table_redirect",
    "table_swap",
    "bit_flip",
]
pytestmark = pytest.mark.engine  # every test here runs a live engine


@pytest.mark.parametrize("page_size", [16, 1])
def test_each_injected_bug_aborts_only_its_victims(tmp_path, capfd, page_size):
    with guarded_engine(tmp_path, page_size, env={"KVGUARD_ON_VIOLATION": "abort"}) as eng:
        prompts = workload(16)
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference)
        for i, cls in enumerate(CLASSES):
            eng.inject(cls, seed=i)
            out = eng.run(prompts, tag=cls)
            recs = eng.injection_records(i + 1)
            assert recs and recs[0]["event"] == "injected", f"{cls}: no fitting moment ({recs})"
            victims = set().union(*(set(r["victims"]) for r in recs))
            aborted = [j for j, o in enumerate(out) if "error" in o]
            # every abort names a KV integrity violation with an id
            for j in aborted:
                assert "KV cache integrity violation kvg-" in out[j]["error"], out[j]["error"]
            cap = capfd.readouterr()  # the scheduler child shares this test's stdout/stderr
            logged = violation_events(cap.out + cap.err)
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
        fresh = eng.run(prompts[:3], tag="fresh")
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]

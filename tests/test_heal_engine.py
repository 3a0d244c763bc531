"""Healing inside a live SGLang engine (CPU): each bug class is made to happen by the
fault-injection plugin, as in ``test_guard_engine``, with the guard's default action,
``recompute``. No client sees an error: every request, its victims included, answers exactly as
the clean reference did; only requests whose KV an injection touched are recomputed; each
recompute is logged with its forensic record. Under tensor parallelism both ranks heal the same
request."""

from __future__ import annotations

import pytest
from guarded_engine import guarded_engine, violation_events, workload
from test_guard_engine import CLASSES

pytestmark = pytest.mark.engine  # every test here runs a live engine


def _healed_run(eng, capfd, prompts, reference, cls, inj_id):
    out = eng.run(prompts, tag=cls)
    recs = eng.injection_records(inj_id)
    assert recs and recs[0]["event"] == "injected", f"{cls}: no fitting moment ({recs})"
    victims = set().union(*(set(r["victims"]) for r in recs))
    errors = [o for o in out if "error" in o]
    assert not errors, f"{cls}: a client saw an error: {[o['error'][:160] for o in errors]}"
    cap = capfd.readouterr()  # the scheduler child shares this test's stdout/stderr
    logged = [e for e in violation_events(cap.out + cap.err).values() if e["request"]]
    assert all(e["action"] == "recompute" for e in logged), logged
    healed = {e["request"] for e in logged}
    if cls != "premature_free":  # (a premature free caught before reuse is taken back instead)
        assert healed, f"{cls}: nothing detected"
    assert healed <= victims, f"{cls}: recomputed beyond the victims {victims}: {healed}"
    for e in logged:
        assert e["kinds"] and e["step"] > 0 and e["recomputes"] >= 1
    for j, (o, r) in enumerate(zip(out, reference)):
        assert o["output_ids"] == r["output_ids"], f"{cls}: request {j} differs from the clean run"
    assert "kvguard_request_requeued" in cap.out + cap.err or not healed
    return healed


@pytest.mark.parametrize("page_size", [16, 1])
def test_each_injected_bug_is_healed(tmp_path, capfd, page_size):
    with guarded_engine(tmp_path, page_size, mode="verified") as eng:
        prompts = workload(16)
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference)
        for i, cls in enumerate(CLASSES):
            eng.inject(cls, seed=i)
            _healed_run(eng, capfd, prompts, reference, cls, i + 1)
        fresh = eng.run(prompts[:3], tag="fresh")
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]


def test_tensor_parallel_ranks_heal_alike(tmp_path, capfd):
    """--tp 2 on CPU: a bit flipped in one rank's KV heads only. That rank's checksum fails, the
    other's does not; the verdicts are OR-reduced over the TP group and the breaker's state
    rides with them, so both ranks send the same request back, re-prefill it in step, neither
    hangs, and every request answers as in the clean run."""
    # one OpenMP core per rank
    env = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    with guarded_engine(tmp_path, 16, mode="verified", env=env, tp_size=2) as eng:
        prompts = workload(8)
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference)
        eng.inject("bit_flip", seed=3, rank=0)
        healed = _healed_run(eng, capfd, prompts, reference, "bit_flip", 1)
        assert healed
        fresh = eng.run(prompts[:2], tag="fresh")  # both ranks still in step
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:2]]

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


def _kept_from_bad_bytes(out: list[dict], record: dict) -> dict[str, list]:
    """Requests served (no error) that kept a token computed from wrong KV: a span of such
    tokens (the fuzz watch's ``wrong_kv``, [from, to)) not closed by a restart that dropped them
    (kept ``to`` <= ``from``)."""
    served = {o["rid"] for o in out if "error" not in o}
    return {
        rid: spans
        for rid, spans in record["wrong_kv"].items()
        if rid in served and any(to is None or to > first for first, to in spans)
    }


@pytest.mark.parametrize("read_path", ["pre_forward_check", "verified_in_attention"])
def test_a_flip_during_the_forward_is_healed_only_where_reads_are_verified(
    tmp_path, capfd, read_path
):
    """A byte of a running request's KV flipped inside the forward, after every check made
    before it (``in_forward_flip``: in the layer about to read it, or one time in four in an
    earlier layer, which the next step reads), in verified mode. Where the read path in force
    is a pre-forward check (forced on CPU by KVGUARD_TEST_PRE_FORWARD_READS, as a GPU pool or
    another attention backend has it) the token computed from it may leave and only the next
    step's check flags the request: it is aborted (its client gets the KV integrity error), not
    healed with its tokens kept; every other request answers as the clean run did.
    With the read hashed in attention the same fault is caught before the token leaves and
    healed. Either way no request is served a token computed from bad bytes. The read path in
    force is in /server_info (the guard's report) and in the start-up log."""
    fallback = read_path == "pre_forward_check"
    env = {"KVGUARD_TEST_PRE_FORWARD_READS": "1"} if fallback else {}
    with guarded_engine(tmp_path, 16, mode="verified", env=env) as eng:
        assert eng.engine.get_server_info()["kvguard"]["read_path"] == read_path
        prompts = workload(8)
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference)
        started = capfd.readouterr()
        assert f'"read_path": "{read_path}"' in started.out + started.err
        eng.inject("in_forward_flip", seed=1)
        out = eng.run(prompts, tag="flip")
        cap = capfd.readouterr()
        recs = eng.injection_records(1)
        assert [r for r in recs if r["event"] == "fired"], f"the flip never fired: {recs}"
        last = recs[-1]
        victim = last["detail"]["rid"]
        assert victim in last["wrong_kv"], last  # it computed a token from the flipped byte
        assert not _kept_from_bad_bytes(out, last), last["wrong_kv"]
        aborted = {o["rid"] for o in out if "error" in o}
        for o in out:
            if "error" in o:
                assert "KV cache integrity violation kvg-" in o["error"], o["error"]
        victims = set().union(*(set(r["victims"]) for r in recs))
        exposed = set().union(*(set(r["exposed"]) for r in recs))
        assert aborted <= victims | exposed, (aborted, victims, exposed)
        logged = [e for e in violation_events(cap.out + cap.err).values() if e["request"]]
        mine = [e for e in logged if e["request"] == victim]
        assert mine, f"the victim was not flagged: {logged}"
        if fallback:  # its token left before the check that flagged it: aborted
            # (a step already in flight flags it again once finished: logged, action "none")
            assert victim in aborted and mine[0]["action"] == "abort", mine
            assert all(e["action"] in ("abort", "none") for e in mine), mine
            assert "pre_forward_check" in mine[0]["why_not_healed"], mine[0]
        else:  # flagged before its token left: healed, nobody sees an error
            assert not aborted and all(e["action"] == "recompute" for e in logged), logged
        for j, (o, r) in enumerate(zip(out, reference)):
            if "error" not in o:
                assert o["output_ids"] == r["output_ids"], f"request {j} differs from the clean run"
        fresh = eng.run(prompts[:3], tag="fresh")  # still serving
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]

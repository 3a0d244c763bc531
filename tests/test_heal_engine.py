"""Healing inside a live SGLang engine (CPU), where the engine differs from ``test_guard_engine``'s
shared ones: under tensor parallelism both ranks heal the same request; and on the fallback read
path (a pre-forward check, as a GPU pool or another attention backend has it) a flip inside the
forward is aborted, not healed with its token kept."""

from __future__ import annotations

import pytest
from guarded_engine import flip_during_forward, guarded_engine, healed_run, workload

pytestmark = pytest.mark.engine  # every test here runs a live engine


def test_tensor_parallel_ranks_heal_alike(tmp_path):
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
        eng.new_log()
        inj_id = eng.inject("bit_flip", seed=3, rank=0)
        healed = healed_run(eng, prompts, reference, "bit_flip", inj_id, tag="bit_flip")
        assert healed
        fresh = eng.run(prompts[:2], tag="fresh")  # both ranks still in step
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:2]]


def test_a_flip_during_the_forward_is_aborted_where_reads_are_checked_before_it(tmp_path):
    """A byte of a running request's KV flipped inside the forward, after every check made
    before it (``in_forward_flip``: in the layer about to read it, or one time in four in an
    earlier layer, which the next step reads), in verified mode. Where the read path in force
    is a pre-forward check (forced on CPU by KVGUARD_TEST_PRE_FORWARD_READS, as a GPU pool or
    another attention backend has it) the token computed from it may leave and only the next
    step's check flags the request: it is aborted (its client gets the KV integrity error), not
    healed with its tokens kept; every other request answers as the clean run did. The read
    path in force is in /server_info (the guard's report) and in the start-up log. (With the
    read hashed in attention the same fault is healed: ``test_guard_engine``.)"""
    env = {"KVGUARD_TEST_PRE_FORWARD_READS": "1"}
    with guarded_engine(tmp_path, 16, mode="verified", env=env) as eng:
        assert eng.engine.get_server_info()["kvguard"]["read_path"] == "pre_forward_check"
        assert '"read_path": "pre_forward_check"' in eng.log.read_text(errors="replace")
        flip_during_forward(eng, "pre_forward_check")

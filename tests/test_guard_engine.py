"""The guard inside a live SGLang engine (CPU): real scheduler, allocator, radix cache, KV pool.

Each bug class is made to happen inside the running engine by the fault-injection plugin
(``kvguard.fuzz``, the test-only injection point, driven through its control file). For every
class: the requests whose KV was touched are aborted with a KV-integrity error naming a violation
id, every other request's greedy output equals the clean reference, the violation is logged with
its forensic record, and the engine then answers a fresh request correctly.
"""

from __future__ import annotations

import asyncio
import json
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
from cpu_engine import cpu_engine
from tiny_model import serving_model

CLASSES = [
    "double_allocation",
    "premature_free",
    "shared_write",
    "table_redirect",
    "table_swap",
    "bit_flip",
]
pytestmark = pytest.mark.engine  # every test here runs a live engine

SAMPLING = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


def workload(n: int, seed: int = 0) -> list[str]:
    """Concurrent prompts with shared prefixes (the prefix cache is in play) and mixed lengths."""
    rng = random.Random(seed)
    bases = [
        "def foo(x, y):\n    return x + y\n" * 3,
        "import os\nimport sys\n" * 4,
        "class A(object):\n    pass\n" * 3,
    ]
    return [
        rng.choice(bases) + " ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 30)))
        for _ in range(n)
    ]


class GuardedEngine:
    """A live engine with the guard and the fault-injection plugin (driven by its control file)."""

    def __init__(self, engine, control: Path, fuzz_log: Path):
        self.engine, self.control, self.fuzz_log = engine, control, fuzz_log
        self.plan: list[dict] = []

    def run(self, prompts: list[str], tag: str = "ref") -> list[dict]:
        """All prompts concurrently, request ids ``{tag}-{i}``; an aborted request comes back as
        {"error": message, "rid": ...}."""
        rids = [f"{tag}-{i}" for i in range(len(prompts))]

        async def go():
            return await asyncio.gather(
                *[
                    self.engine.async_generate(p, SAMPLING, rid=rid)
                    for p, rid in zip(prompts, rids)
                ],
                return_exceptions=True,
            )

        out = self.engine.loop.run_until_complete(asyncio.wait_for(go(), 300))
        return [
            {"error": str(r), "rid": rid} if isinstance(r, Exception) else {**r, "rid": rid}
            for r, rid in zip(out, rids)
        ]

    def inject(self, cls: str, seed: int, **entry):
        self.plan.append(
            {"id": len(self.plan) + 1, "cls": cls, "seed": seed, "max_tries": 60, **entry}
        )
        self.control.write_text(json.dumps({"plan": self.plan}))

    def injection_records(self, inj_id: int) -> list[dict]:
        if not self.fuzz_log.exists():
            return []
        recs = [json.loads(line) for line in self.fuzz_log.read_text().splitlines()]
        return [r for r in recs if r.get("id") == inj_id]


@contextmanager
def guarded_engine(tmp: Path, page_size: int, mode: str = "paranoid", env=None, **engine_args):
    control, fuzz_log = tmp / "control.json", tmp / "fuzz.jsonl"
    env = {
        "SGLANG_CACHE_DIR": str(tmp / "sglang-cache"),
        "KVGUARD_MODE": mode,
        "KVGUARD_LOG_FORMAT": "json",
        "KVGUARD_FUZZ_CONTROL": str(control),
        "KVGUARD_FUZZ_LOG": str(fuzz_log),
        **(env or {}),
    }
    model, _ = serving_model()
    args = dict(max_total_tokens=2048, page_size=page_size, chunked_prefill_size=128)
    with cpu_engine(model, env, **{**args, **engine_args}) as engine:
        yield GuardedEngine(engine, control, fuzz_log)


def violation_events(text: str) -> dict[str, dict]:
    out = {}
    for line in text.splitlines():
        if '"kv_integrity_violation"' in line and line.lstrip().startswith("{"):
            ev = json.loads(line)
            out[ev["violation_id"]] = ev
    return out


@pytest.mark.parametrize("page_size", [16, 1])
def test_each_injected_bug_aborts_only_its_victims(tmp_path, capfd, page_size):
    with guarded_engine(tmp_path, page_size) as eng:
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
            assert {out[j]["rid"] for j in aborted} <= victims, f"{cls}: aborted beyond {victims}"
            # no escape: every request that was not aborted answered exactly as the clean run did
            for j, (o, r) in enumerate(zip(out, reference)):
                if "error" not in o:
                    assert o["output_ids"] == r["output_ids"], f"{cls}: request {j} escaped"
            # the forensic record of each abort reached the log
            for j in aborted:
                vid = out[j]["error"].split("violation ")[1].split(":")[0]
                ev = logged[vid]
                assert ev["kinds"] and ev["request"] and ev["step"] > 0
                assert any(p["positions"] for p in ev["pages"]) or "quarantined_page" in ev["kinds"]
        # the engine is still serving, and serving correctly
        fresh = eng.run(prompts[:3], tag="fresh")
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]


def test_tensor_parallel_ranks_agree(tmp_path):
    """--tp 2 on CPU: a bit flipped in one rank's KV heads only. That rank's checksum fails, the
    other's does not; the verdicts are OR-reduced over the TP group, so both ranks abort the same
    request, neither hangs, and every other request answers as in the clean run."""
    # one OpenMP core per rank
    with guarded_engine(tmp_path, 16, env={"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}, tp_size=2) as eng:
        prompts = workload(8)
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference)
        eng.inject("bit_flip", seed=3, rank=0)
        out = eng.run(prompts, tag="flip")
        recs = eng.injection_records(1)
        assert recs and recs[0]["event"] == "injected", recs
        victims = set().union(*(set(r["victims"]) for r in recs))
        aborted = {o["rid"] for o in out if "error" in o}
        assert aborted and aborted <= victims, (aborted, victims)
        for o, r in zip(out, reference):
            if "error" not in o:
                assert o["output_ids"] == r["output_ids"]
        fresh = eng.run(prompts[:2], tag="fresh")  # both ranks still in step
        assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:2]]

"""A live guarded SGLang engine (CPU) driven by the fault-injection plugin (``kvguard.fuzz``, the
test-only injection point, through its control file): the shared helper of the engine tests."""

from __future__ import annotations

import asyncio
import json
import random
from contextlib import contextmanager
from pathlib import Path

from cpu_engine import cpu_engine
from tiny_model import serving_model

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

    def run(self, prompts: list[str], tag: str = "ref", sampling: dict | None = None) -> list[dict]:
        """All prompts concurrently, request ids ``{tag}-{i}``; an aborted request comes back as
        {"error": message, "rid": ...}. ``sampling`` replaces :data:`SAMPLING`."""
        rids = [f"{tag}-{i}" for i in range(len(prompts))]

        async def go():
            return await asyncio.gather(
                *[
                    self.engine.async_generate(p, sampling or SAMPLING, rid=rid)
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

    def assert_flip_caught(self, prompts: list[str], reference: list[dict], **entry) -> list[dict]:
        """One injected bit flip: only its victims are aborted or recomputed (healed: SGLang
        counts the retraction in ``meta_info.num_retractions``), every request that was not
        aborted answers as the clean run did. Returns the outputs."""
        self.inject("bit_flip", seed=3, **entry)
        out = self.run(prompts, tag=f"flip{len(self.plan)}")
        recs = self.injection_records(len(self.plan))
        assert recs and recs[0]["event"] == "injected", recs
        victims = set().union(*(set(r["victims"]) for r in recs))
        aborted = {o["rid"] for o in out if "error" in o}
        healed = {o["rid"] for o in out if o.get("meta_info", {}).get("num_retractions")}
        assert aborted | healed and aborted | healed <= victims, (aborted, healed, victims)
        for o, r in zip(out, reference):
            if "error" not in o:
                assert o["output_ids"] == r["output_ids"]
        return out

    def injection_records(self, inj_id: int) -> list[dict]:
        if not self.fuzz_log.exists():
            return []
        recs = [json.loads(line) for line in self.fuzz_log.read_text().splitlines()]
        return [r for r in recs if r.get("id") == inj_id]


@contextmanager
def guarded_engine(
    tmp: Path, page_size: int, mode: str = "paranoid", env=None, model=None, **engine_args
):
    """The engine over ``model`` (default: the embedded serving model)."""
    control, fuzz_log = tmp / "control.json", tmp / "fuzz.jsonl"
    env = {
        "SGLANG_CACHE_DIR": str(tmp / "sglang-cache"),
        "KVGUARD_MODE": mode,
        "KVGUARD_LOG_FORMAT": "json",
        "KVGUARD_FUZZ_CONTROL": str(control),
        "KVGUARD_FUZZ_LOG": str(fuzz_log),
        **(env or {}),
    }
    if model is None:
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

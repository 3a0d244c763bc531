"""A live guarded SGLang engine (CPU) driven by the fault-injection plugin (``kvguard.fuzz``, the
test-only injection point, through its control file): the shared helper of the engine tests.

The engine's processes write their output to a log file (``GuardedEngine.new_log``), not to the
test's captured stdout: so an engine can outlive one test (a module-scoped fixture) and each test
still reads the scheduler log lines of its own runs."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
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

    def __init__(self, engine, control: Path, fuzz_log: Path, log: Path):
        self.engine, self.control, self.fuzz_log, self.log = engine, control, fuzz_log, log
        self.plan: list[dict] = []
        self._log_read = 0

    def new_log(self) -> str:
        """What the engine's processes (its schedulers: kvguard's log lines) wrote since the
        last call."""
        with open(self.log, "rb") as f:
            f.seek(self._log_read)
            data = f.read()
        self._log_read += len(data)
        return data.decode(errors="replace")

    def settings(self, **settings: str) -> None:
        """Switch the guard (``mode``, ``on_violation``) before the next step: a plan entry
        the fault-injection plugin applies (``guard_settings``)."""
        self._append({"cls": "guard_settings", **settings})

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

    def inject(self, cls: str, seed: int, **entry) -> int:
        """Plan one fault; returns its plan id (``injection_records``)."""
        return self._append({"cls": cls, "seed": seed, "max_tries": 60, **entry})

    def _append(self, entry: dict) -> int:
        inj_id = len(self.plan) + 1
        self.plan.append({"id": inj_id, **entry})
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"plan": self.plan}))
        os.replace(tmp, self.control)  # the plugin never reads a half-written file
        return inj_id

    def assert_flip_caught(self, prompts: list[str], reference: list[dict], **entry) -> list[dict]:
        """One injected bit flip: only its victims are aborted or recomputed (healed: SGLang
        counts the retraction in ``meta_info.num_retractions``), every request that was not
        aborted answers as the clean run did. Returns the outputs."""
        inj_id = self.inject("bit_flip", seed=3, **entry)
        out = self.run(prompts, tag=f"flip{inj_id}")
        recs = self.injection_records(inj_id)
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
    log = tmp / "engine.log"
    with _output_to(log) as restore, cpu_engine(model, env, **{**args, **engine_args}) as engine:
        restore()  # the schedulers write to the log; the test's own output is its own again
        yield GuardedEngine(engine, control, fuzz_log, log)


@contextmanager
def _output_to(log: Path):
    """While the engine starts, this process's stdout and stderr (file descriptors 1 and 2) go
    to ``log``: the scheduler processes it starts inherit them and write there for their life.
    Restored as soon as the engine is up, so the test's own output is captured as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    restored = False

    def restore() -> None:
        nonlocal restored
        if not restored:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            restored = True

    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield restore
    finally:
        restore()
        for d in (fd, *saved):
            os.close(d)


def violation_events(text: str) -> dict[str, dict]:
    out = {}
    for line in text.splitlines():
        if '"kv_integrity_violation"' in line and line.lstrip().startswith("{"):
            ev = json.loads(line)
            out[ev["violation_id"]] = ev
    return out


# -- what the engine tests check, shared by the modules that share engines --------------------------
CLASSES = [  # the bug classes an MHA engine test injects (fuzz injectors)
    "double_allocation",
    "premature_free",
    "shared_write",
    "table_redirect",
    "table_swap",
    "bit_flip",
]


def kept_from_bad_bytes(out: list[dict], record: dict) -> dict[str, list]:
    """Requests served (no error) that kept a token computed from wrong KV: a span of such
    tokens (the fuzz watch's ``wrong_kv``, [from, to)) not closed by a restart that dropped them
    (kept ``to`` <= ``from``)."""
    served = {o["rid"] for o in out if "error" not in o}
    return {
        rid: spans
        for rid, spans in record["wrong_kv"].items()
        if rid in served and any(to is None or to > first for first, to in spans)
    }


def flip_during_forward(eng: GuardedEngine, read_path: str, seed: int = 1) -> None:
    """A byte of a running request's KV flipped inside the forward, after every check made
    before it (``in_forward_flip``), in verified mode, healing. On ``pre_forward_check`` the
    victim's token leaves before the next step flags it: aborted, not healed; on
    ``verified_in_attention`` it is caught before its token leaves and healed. Either way no
    request is served a token computed from bad bytes, and every other request answers as the
    clean run did."""
    fallback = read_path == "pre_forward_check"
    prompts = workload(8)
    reference = eng.run(prompts, tag=f"ref{len(eng.plan)}")
    assert all("error" not in r for r in reference)
    eng.new_log()
    inj_id = eng.inject("in_forward_flip", seed=seed)
    out = eng.run(prompts, tag=f"flip{inj_id}")
    logged_text = eng.new_log()
    recs = eng.injection_records(inj_id)
    assert [r for r in recs if r["event"] == "fired"], f"the flip never fired: {recs}"
    last = recs[-1]
    victim = last["detail"]["rid"]
    assert victim in last["wrong_kv"], last  # it computed a token from the flipped byte
    assert not kept_from_bad_bytes(out, last), last["wrong_kv"]
    aborted = {o["rid"] for o in out if "error" in o}
    for o in out:
        if "error" in o:
            assert "KV cache integrity violation kvg-" in o["error"], o["error"]
    victims = set().union(*(set(r["victims"]) for r in recs))
    exposed = set().union(*(set(r["exposed"]) for r in recs))
    assert aborted <= victims | exposed, (aborted, victims, exposed)
    logged = [e for e in violation_events(logged_text).values() if e["request"]]
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
    fresh = eng.run(prompts[:3], tag=f"fresh{inj_id}")  # still serving
    assert [o["output_ids"] for o in fresh] == [r["output_ids"] for r in reference[:3]]


def healed_run(eng: GuardedEngine, prompts, reference, cls: str, inj_id: int, tag: str) -> set:
    """Run the prompts with injection ``inj_id`` planned: nobody sees an error, only its victims
    are recomputed (each logged), every answer is the clean run's. Returns the healed ids."""
    out = eng.run(prompts, tag=tag)
    recs = eng.injection_records(inj_id)
    assert recs and recs[0]["event"] == "injected", f"{cls}: no fitting moment ({recs})"
    victims = set().union(*(set(r["victims"]) for r in recs))
    errors = [o for o in out if "error" in o]
    assert not errors, f"{cls}: a client saw an error: {[o['error'][:160] for o in errors]}"
    text = eng.new_log()
    logged = [e for e in violation_events(text).values() if e["request"]]
    assert all(e["action"] == "recompute" for e in logged), logged
    healed = {e["request"] for e in logged}
    if cls != "premature_free":  # (a premature free caught before reuse is taken back instead)
        assert healed, f"{cls}: nothing detected"
    assert healed <= victims, f"{cls}: recomputed beyond the victims {victims}: {healed}"
    for e in logged:
        assert e["kinds"] and e["step"] > 0 and e["recomputes"] >= 1
    for j, (o, r) in enumerate(zip(out, reference)):
        assert o["output_ids"] == r["output_ids"], f"{cls}: request {j} differs from the clean run"
    assert "kvguard_request_requeued" in text or not healed
    return healed

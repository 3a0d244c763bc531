"""Both KV structures of a GLM-5 (DSA) model guarded in a live engine: the tiny random GLM-5
checkpoint (tiny_model.tiny_random_glm_dsa) served on CPU at page size 64 with the guard on and
the fault-injection plugin driving it. Prompts span two or three 64-token pages and are longer
than index_topk, so the indexer selects. After a clean run (no violation), each of a latent-row
bit flip (``bit_flip``), a flipped bit of an index key or its scale (``index_key_flip``) and
another request's index key written over a resting slot's (``index_key_misplaced``) is
injected (in verified mode, the default, also a latent bit flipped inside the forward, after
the pre-forward check: ``in_forward_flip``): the guard flags (recomputes, or aborts with a
KV-integrity error) its victims and no one else, each flag logged with its forensic record, and a victim it did not flag answers as the
clean run did; afterwards the engine still answers every prompt.

Only an unflagged victim's output is compared token for token: the batch's composition moves
this random model's greedy path (FP8 index keys and FP8 KV turn float rounding into other
top-k selections; measured with the guard off: of six prompts served cold in batches of six and
of two, one starts with another token), so a request that an abort or a recompute moved into
another batch may differ from the clean run without any KV of its own touched."""

from __future__ import annotations

import pytest
from guarded_engine import guarded_engine, violation_events
from tiny_model import GLM_INDEX_TOPK, GLM_PAGE_SIZE, tiny_random_glm_dsa

pytestmark = pytest.mark.engine  # every test here runs a live engine

CLASSES = ("bit_flip", "index_key_flip", "index_key_misplaced")
SAMPLING = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
LINES = [
    "def area(r):\n    return 3.14159 * r * r\n",
    "import os\nfor name in os.listdir('.'):\n    print(name)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]


def prompts() -> list[str]:
    """Six prompts of 122 to 170 tokens (two or three pages, past index_topk), in pairs that
    share their first page (prefix-cache hits on it)."""
    out = []
    for i in range(6):
        head = LINES[i % 3] * 3 + LINES[(i + 1) % 3] * 2
        out.append(head + " ".join(str(7 * i + j) for j in range(10 + 4 * i)) + "\n" + LINES[i % 3])
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_random_glm_dsa()


def _caught(eng, texts, reference, cls, seed) -> dict:
    """Inject ``cls`` once: the guard flags (aborts or recomputes) some of its victims and no
    one else, each flag logged with its forensic record; a victim it did not flag answers as
    the clean run did (no escape)."""
    inj_id = eng.inject(cls, seed=seed)
    out = eng.run(texts, tag=cls, sampling=SAMPLING)
    recs = eng.injection_records(inj_id)
    assert recs and recs[0]["event"] == "injected", f"{cls}: not injected: {recs}"
    victims = set().union(*(set(r["victims"]) for r in recs))
    assert victims, f"{cls}: no reader of the corrupted slot: {recs}"
    logged = [e for e in violation_events(eng.new_log()).values() if e["request"]]
    flagged = {e["request"] for e in logged}
    aborted = {o["rid"] for o in out if "error" in o}
    assert flagged, f"{cls}: nothing detected ({recs[0]['detail']})"
    assert flagged | aborted <= victims, f"{cls}: flagged beyond the victims {victims}: {flagged}"
    for e in logged:
        assert e["kinds"] and e["step"] > 0 and any(p["positions"] for p in e["pages"]), e
    for o, r in zip(out, reference):
        if "error" in o:
            assert "KV cache integrity violation kvg-" in o["error"], o["error"]
        elif o["rid"] in victims - flagged:  # read the corrupted KV, not flagged: must be intact
            assert o["output_ids"] == r["output_ids"], f"{cls}: {o['rid']} escaped"
    same = sum(o.get("output_ids") == r["output_ids"] for o, r in zip(out, reference))
    return {"victims": len(victims), "flagged": len(flagged), "aborted": len(aborted),
            "as_clean": same}  # fmt: skip


@pytest.mark.parametrize(
    "mode, kv_cache_dtype",
    [("verified", "fp8_e4m3"), ("paranoid", "auto")],
    ids=["default-fp8", "paranoid"],
)
def test_latent_and_index_key_faults_are_caught(tmp_path, model, mode, kv_cache_dtype):
    """verified is the guard's default mode (its action recompute: a victim is healed), FP8 KV
    the GLM family's default; paranoid aborts (float32 KV)."""
    env = {} if mode == "verified" else {"KVGUARD_ON_VIOLATION": "abort"}
    args = dict(dtype="float32", kv_cache_dtype=kv_cache_dtype, chunked_prefill_size=256)
    with guarded_engine(tmp_path, GLM_PAGE_SIZE, mode, env, model=model, **args) as eng:
        texts = prompts()
        tokenizer = eng.engine.tokenizer_manager.tokenizer
        lens = [len(tokenizer(t)["input_ids"]) for t in texts]
        assert min(lens) > GLM_PAGE_SIZE + GLM_INDEX_TOPK and max(lens) < 3 * GLM_PAGE_SIZE, lens
        reference = eng.run(texts, sampling=SAMPLING)
        assert all("error" not in r for r in reference), reference
        assert not violation_events(eng.new_log())  # a clean run: no false alarm
        # verified hashes what the indexer and sparse MLA read: a flip inside the forward, after
        # the pre-forward check, is caught before the step's tokens leave
        classes = CLASSES + ("in_forward_flip",) if mode == "verified" else CLASSES
        outcome = {cls: _caught(eng, texts, reference, cls, i) for i, cls in enumerate(classes)}
        print(f"{mode}: {outcome}")
        # still serving: every prompt answered, cold again. Not compared token for token: the
        # batch's composition moves this random model's greedy path under FP8 (guard off, the
        # second prompt cold in a batch of two starts with another token than in the batch of
        # six), so only the steps above, whose batches the clean run's match, compare outputs
        eng.engine.flush_cache()
        again = eng.run(texts, tag="again", sampling=SAMPLING)
        assert all("error" not in o and len(o["output_ids"]) == 16 for o in again), again

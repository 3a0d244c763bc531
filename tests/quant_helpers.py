"""Shared by the FP8-KV and INT4 tests: a tiny *trained* Llama (so greedy decoding is not a coin
flip on flat logits), an SGLang CPU engine (``cpu_engine.py``) at their settings, and a Hugging
Face greedy reference."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from cpu_engine import cpu_engine

TINY_STEPS = 60
PROMPTS = (
    "def __init__(self",
    "import os\nimport ",
    "class Foo:\n    def ",
    "for i in range(",
    "    return self.",
    "if __name__ == ",
)


def tiny_trained_model() -> Path:
    """kvguard's default-model recipe in its TINY spec (hidden 64, 2 layers, MLP 128), trained for
    a few dozen steps; cached on disk, keyed by the build scripts' source."""
    from kvguard.serve import tiny_builder
    from kvguard.serve.default_model import build as B

    sources = Path(B.__file__).read_bytes() + Path(tiny_builder.__file__).read_bytes()
    digest = hashlib.sha256(sources).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / "kvguard-test-models"
    out = root / f"tiny-{digest}-s{TINY_STEPS}"
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix="building-"))
    B.build(staging, tiny=True, steps=TINY_STEPS, log=lambda *a, **k: None)
    try:
        staging.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return out


def prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(p)["input_ids"] for p in PROMPTS]


@contextmanager
def sglang_engine(model_dir: Path, guard_mode: str = "off", **kw):
    """An SGLang CPU engine (torch_native attention, page 16); ``kw`` adds Engine arguments."""
    args = dict(max_total_tokens=2048, page_size=16)
    with cpu_engine(model_dir, {"KVGUARD_MODE": guard_mode}, **{**args, **kw}) as engine:
        yield engine


def sglang_greedy(engine, ids: list[list[int]], n: int) -> list[dict]:
    return engine.generate(
        input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    )


def hf_greedy(
    model_dir: Path,
    ids: list[list[int]],
    n: int,
    dtype=torch.bfloat16,
    state_dict: dict | None = None,
) -> list[list[int]]:
    """Greedy continuations from transformers (optionally with replaced weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    model.eval()
    out = []
    with torch.no_grad():
        for row in ids:
            x = torch.tensor([row])
            for _ in range(n):
                nxt = model(input_ids=x).logits[0, -1].float().argmax()
                x = torch.cat([x, nxt.view(1, 1)], dim=1)
            out.append(x[0, len(row) :].tolist())
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions where two sets of greedy continuations agree."""
    same = total = 0
    for x, y in zip(a, b):
        same += sum(int(p == q) for p, q in zip(x, y))
        total += max(len(x), len(y))
    return same / max(total, 1)

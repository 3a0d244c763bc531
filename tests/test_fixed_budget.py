"""bench/fixed_budget.py sizes the FP8 pool of a fixed KV byte budget from the pool layouts: the
bytes per token it computes equal what bench/quant*.py measured on SGLang's own pools for the
embedded models (bench/quant_results.md, quant_kimi_results.md, quant_glm_results.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvguard.bench.fixed_budget import kv_bytes_per_token

SERVE = Path(__file__).resolve().parents[1] / "serve"


@pytest.mark.parametrize(
    ("model", "bf16", "fp8"),
    [("default_model", 2048, 1024), ("kimi_model", 640, 320), ("glm_model", 1548, 1176)],
)
def test_bytes_per_token_equal_the_measured_pools(model, bf16, fp8):
    config = json.loads((SERVE / model / "checkpoint" / "config.json").read_text())
    assert kv_bytes_per_token(config, "bf16") == bf16
    assert kv_bytes_per_token(config, "fp8") == fp8

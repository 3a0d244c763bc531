"""The GLM-5 architecture (GlmMoeDsa: MLA + DSA sparse attention + MoE) served and guarded on CPU,
with kvguard's tiny trained GLM model (serve/glm_model/).

* HF equality: while a sequence holds at most ``index_topk`` tokens the indexer selects every
  causal position, so SGLang (patches/dsa_cpu.py) and transformers compute the same function:
  equal greedy tokens in float32, with the guard on, again through the prefix cache.
* ``kvguard-serve --embedded-model glm`` at its defaults (guard on, FP8 KV, page 64) starts,
  answers, checks its steps and flags nothing.
* A GlmMoeDsa checkpoint as transformers saves it (no SGLang-only keys such as
  ``indexer_rope_interleave``) with a latent SGLang's FP8 row cannot hold (``kv_lora_rank`` 64):
  at the defaults it is served guarded with its own KV dtype (the log says why not FP8); asked
  for FP8 explicitly, it is refused at start in one line, as is one with MoE layers whose
  config lacks the MoE keys SGLang reads without a default (its scheduler would die loading it).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from quant_helpers import hf_greedy, prompt_ids, sglang_engine, sglang_greedy  # noqa: E402

from kvguard.serve.glm_model import ensure_glm_model  # noqa: E402

N_NEW = 12


@pytest.fixture(scope="module")
def model():
    return ensure_glm_model()


def test_checkpoint_is_a_dsa_model(model):
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert cfg["index_head_dim"] == 128 and cfg["q_lora_rank"] and cfg["index_topk"] >= 16
    assert cfg["indexer_rope_interleave"] is True


@pytest.mark.engine
def test_greedy_equals_transformers_within_index_topk(model):
    topk = json.loads((model / "config.json").read_text())["index_topk"]
    n_new = min(N_NEW, topk // 2)
    ids = [p for p in prompt_ids(model) if len(p) + n_new <= topk][:3]
    assert ids, "no prompt short enough"
    want = hf_greedy(model, ids, n_new, dtype=torch.float32)
    with sglang_engine(
        model, guard_mode="paranoid", page_size=64, dtype="float32", kv_cache_dtype="auto"
    ) as engine:
        first = sglang_greedy(engine, ids, n_new)
        again = sglang_greedy(engine, ids, n_new)  # prefix-cache hits read latents and index keys
    assert [o["output_ids"] for o in first] == want
    assert [o["output_ids"] for o in again] == want


@pytest.mark.engine
def test_kvguard_serve_glm_at_defaults(serve_processes, model):
    import requests

    srv = serve_processes(["--embedded-model", "glm"])
    prompt = "def __init__(self, " + " ".join(f"x{i}" for i in range(24))  # past index_topk
    r = requests.post(
        f"{srv.url}/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 16
    info = requests.get(f"{srv.url}/server_info", timeout=30).json()
    assert info["kv_cache_dtype"] == "fp8_e4m3"
    assert info["page_size"] == 64
    assert info["model_path"] == str(model)
    srv.wait_idle()
    totals = srv.metric_totals()
    assert totals.get("kvguard_steps_checked_total", 0) > 0
    assert totals.get("kvguard_violations_total", 0) == 0


def _plain_hf_glm(out, first_k_dense_replace: int = 3, **released) -> None:
    """A random GlmMoeDsa checkpoint saved by transformers with its defaults but toy sizes."""
    import shutil
    from pathlib import Path

    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    tok = Path(__file__).resolve().parents[1] / "serve" / "default_model" / "checkpoint"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / name, out / name)
    config = GlmMoeDsaConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, first_k_dense_replace=first_k_dense_replace, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
        q_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2, index_n_heads=4,
        max_position_embeddings=4096, **released,
    )  # fmt: skip
    torch.manual_seed(0)
    GlmMoeDsaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert "indexer_rope_interleave" not in saved and saved["kv_lora_rank"] == 64


@pytest.mark.engine
def test_plain_transformers_checkpoint_served_at_defaults(serve_processes, tmp_path):
    import requests
    from test_serve_http import assert_one_line_error, run_cli

    ckpt = tmp_path / "glm-plain"
    _plain_hf_glm(ckpt)
    refused = run_cli("--model-path", str(ckpt), "--kv-cache-dtype", "fp8_e4m3")
    assert_one_line_error(refused, "fp8_e4m3 cannot serve this model", "kv_lora_rank 64")
    # MoE layers: SGLang reads fields transformers does not save; kvguard-serve supplies the
    # values transformers' GlmMoeDsa code fixes (sigmoid, noaux_tc, MoE from layer 1 on)
    moe = tmp_path / "glm-plain-moe"
    _plain_hf_glm(moe, first_k_dense_replace=1, num_nextn_predict_layers=1)  # as GLM-5's has it
    srv = serve_processes(["--model-path", str(moe)])
    r = requests.post(
        f"{srv.url}/generate",
        json={"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 8}},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 8
    info = requests.get(f"{srv.url}/server_info", timeout=30).json()
    assert info["kv_cache_dtype"] in ("auto", "bfloat16"), info["kv_cache_dtype"]
    log = srv.log_tail(200_000)
    assert "kv_cache_fp8_default_skipped" in log
    assert "model_config_fields_supplied" in log and "noaux_tc" in log
    srv.wait_idle()
    totals = srv.metric_totals()
    assert totals.get("kvguard_steps_checked_total", 0) > 0
    assert totals.get("kvguard_violations_total", 0) == 0

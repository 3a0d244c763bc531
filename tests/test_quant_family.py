"""The quantization bench per MLA family (``bench/quant_mla.py``): SGLang's own pools at each
family's shapes, and GLM-5's INT4 experts through the quantize path Kimi's take.

* Pools: Kimi's ``MLATokenToKVPool`` holds 2x the tokens in FP8; GLM's ``DSATokenToKVPool`` packs
  FP8 latent rows with per-block scales and a bf16 rope part, and keeps its FP8 index keys in
  both dtypes, so its ratio is what those bytes give (1.32x for the tiny model, 1.63x at
  DeepSeek V3.2's shape), each figure derived here from the layout and checked against SGLang's
  buffers.
* GLM INT4: ``--targets experts`` quantizes exactly the routed experts (the DSA indexer, attention,
  shared experts and the dense layer stay BF16), and SGLang serves the checkpoint on CPU with FP8
  DSA KV and the guard at its default mode, predicting what transformers predicts on the same
  dequantized weights.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from kvguard.bench import quant_mla  # noqa: E402
from kvguard.quant import quantize as Q  # noqa: E402
from kvguard.serve.glm_model import ensure_glm_model  # noqa: E402
from kvguard.serve.kimi_model import ensure_kimi_model  # noqa: E402

INDEX_KEY_BYTES = 128 + 4  # an FP8 index key and its fp32 scale, per token and indexer layer


def _cfg(model):
    return json.loads((model / "config.json").read_text())


def test_kimi_fp8_mla_pool_holds_twice_the_tokens():
    cfg = _cfg(ensure_kimi_model())
    kv = quant_mla.pool_tokens("kimi", cfg, 64 << 20)
    layers, width = cfg["num_hidden_layers"], cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert kv["bf16"]["bytes_per_token"] == 2 * layers * width
    assert kv["fp8_e4m3"]["bytes_per_token"] == layers * width
    assert kv["bf16"]["index_bytes_per_token"] == kv["fp8_e4m3"]["index_bytes_per_token"] == 0
    assert kv["fp8_e4m3"]["tokens"] / kv["bf16"]["tokens"] >= 1.99


def test_glm_dsa_pool_bytes_latent_and_index_keys():
    cfg = _cfg(ensure_glm_model())
    kv = quant_mla.pool_tokens("glm", cfg, 64 << 20)
    layers, r, rope = cfg["num_hidden_layers"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    bf, f8 = kv["bf16"], kv["fp8_e4m3"]
    assert bf["latent_bytes_per_token"] == layers * 2 * (r + rope)
    assert f8["latent_bytes_per_token"] == layers * (r + r // 128 * 4 + 2 * rope)
    assert bf["index_bytes_per_token"] == f8["index_bytes_per_token"] == layers * INDEX_KEY_BYTES
    for d in (bf, f8):
        assert d["bytes_per_token"] == d["latent_bytes_per_token"] + d["index_bytes_per_token"]
        assert d["tokens"] % 64 == 0
    ratio = f8["tokens"] / bf["tokens"]
    assert ratio == pytest.approx(bf["bytes_per_token"] / f8["bytes_per_token"], rel=1e-3)
    assert ratio > 1.3  # 1548 / 1176 bytes per token for this model
    ref = quant_mla.reference_bytes_per_token()  # one layer at kv_lora_rank 512 + rope 64
    assert ref["bf16"] == {"latent": 1152, "index": 132, "total": 1284}
    assert ref["fp8_e4m3"] == {"latent": 656, "index": 132, "total": 788}


def test_glm_int4_experts_only(tmp_path):
    from safetensors import safe_open

    model = ensure_glm_model()
    cfg = _cfg(model)
    report = Q.quantize_checkpoint(model, tmp_path / "int4", targets="experts", log=lambda *a: None)
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    assert report["layers_quantized"] == 3 * moe_layers * cfg["n_routed_experts"]
    with safe_open(str(tmp_path / "int4" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    packed = {k.rsplit(".", 2)[0] for k in keys if k.endswith(".weight_packed")}
    assert packed and all(".mlp.experts." in k for k in packed), packed
    assert "model.layers.1.self_attn.indexer.wk.weight" in keys  # the indexer stays BF16
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in keys


@pytest.mark.engine
def test_glm_int4_experts_fp8_dsa_kv_guarded_serve(tmp_path, capfd):
    """The seed's stack on GLM: INT4 experts + FP8 DSA KV, guard at its default mode. Windows
    within index_topk (the indexer then selects every causal position, so transformers computes
    the same function): teacher-forced top-1 equal to transformers on the dequantized weights;
    then a prompt past index_topk, decoded to its length."""
    from quant_helpers import sglang_engine
    from test_int4_moe import dequantized_checkpoint, hf_scores

    from kvguard.bench.quant import greedy, heldout_windows, sglang_perplexity
    from kvguard.config import GuardConfig
    from kvguard.patches.guard_status import scheduler_statuses

    model = ensure_glm_model()
    cfg = _cfg(model)
    int4 = tmp_path / "int4"
    Q.quantize_checkpoint(model, int4, targets="experts", log=lambda *a: None)
    windows = heldout_windows(model, 8, cfg["index_topk"] - 1)
    long = heldout_windows(model, 1, 3 * cfg["index_topk"])[0]
    mode = GuardConfig().mode.value  # the default (verified)
    with sglang_engine(int4, guard_mode=mode, page_size=64, kv_cache_dtype="fp8_e4m3") as e:
        guard = scheduler_statuses(e)[0]
        _, top1 = sglang_perplexity(e, windows, cfg["vocab_size"])
        out = greedy(e, [long], 16)  # asserts it finished by length, not aborted
    assert guard["active"] and guard["mode"] == mode, guard
    assert len(out[0]) == 16
    logs = capfd.readouterr()
    assert "kvguard_int4_cpu_moe" in logs.out + logs.err  # the experts ran the INT4 CPU path
    assert "pool=dsa" in logs.out + logs.err  # and the KV the CPU FP8 DSA pool
    _, want = hf_scores(dequantized_checkpoint(int4, tmp_path / "deq"), windows)
    same = sum(a == b for a, b in zip(top1, want)) / len(top1)
    assert same >= 0.95, same  # 0.980 here (248 positions)

"""kvguard's tiny Kimi-K2-architecture model (serve/kimi_model/): the committed checkpoint looks
like a real Kimi K2 checkpoint (DeepseekV3ForCausalLM, MLA with q_lora, YaRN rope, MoE with a
shared expert and routed top-k, sigmoid router with a correction bias), loads in transformers,
is trained (held-out perplexity, Python-like greedy text), and the build is bit-for-bit
deterministic on a tiny spec. CPU only, no network, no model hub, no SGLang engine."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import kvguard.serve.kimi_model as km  # noqa: E402
from kvguard.serve import corpus  # noqa: E402
from kvguard.serve import tiny_builder as T  # noqa: E402
from kvguard.serve.default_model import DEFAULT_MODEL_DIR  # noqa: E402
from kvguard.serve.kimi_model import build as B  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def ckpt():
    return km.ensure_kimi_model()


@pytest.fixture(scope="module")
def report(ckpt):
    return json.loads((ckpt / "build_report.json").read_text())


@pytest.fixture(scope="module")
def config(ckpt):
    return json.loads((ckpt / "config.json").read_text())


@pytest.fixture(scope="module")
def model_fp32(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def test_checkpoint_files(ckpt, report):
    assert ckpt == km.KIMI_MODEL_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "build_report.json"):
        assert (ckpt / name).is_file(), name
    assert report["training_steps"] == report["planned_steps"] == B.DEFAULT_STEPS
    assert not report["stopped_early"]
    assert report["bytes_on_disk"] < 8 * 2**20  # a few MB


def test_ensure_kimi_model_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(km, "KIMI_MODEL_DIR", tmp_path / "nope")
    with pytest.raises(km.KimiModelMissingError, match=r"model\.safetensors"):
        km.ensure_kimi_model()


def test_config_has_the_fields_of_a_kimi_k2_checkpoint(config):
    """The field names and kinds of values of Kimi K2's config.json, at toy size."""
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["model_type"] == "deepseek_v3"
    yarn = config["rope_scaling"]
    assert yarn["type"] == "yarn" and yarn["factor"] > 1
    assert set(yarn) == {
        "type",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    }
    assert (
        config["max_position_embeddings"]
        == yarn["factor"] * yarn["original_max_position_embeddings"]
    )
    # MLA: low-rank queries, one compressed latent (+ shared rope part) per token
    assert config["q_lora_rank"] and config["kv_lora_rank"]
    assert config["qk_rope_head_dim"] and config["qk_nope_head_dim"] and config["v_head_dim"]
    assert config["num_key_value_heads"] == config["num_attention_heads"]
    # MoE: dense first layer, one shared expert, routed top-k, DeepSeek-V3's sigmoid router
    assert config["first_k_dense_replace"] == 1 and config["moe_layer_freq"] == 1
    assert config["n_shared_experts"] == 1
    assert config["n_routed_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert config["scoring_func"] == "sigmoid" and config["topk_method"] == "noaux_tc"
    assert config["n_group"] == config["topk_group"] == 1 and config["norm_topk_prob"]
    assert config["routed_scaling_factor"] > 1
    assert config["num_nextn_predict_layers"] == 0 and not config["tie_word_embeddings"]
    assert list(config) == sorted(config)  # written sorted, as the released config is


def test_transformers_reads_the_yarn_rope(ckpt):
    cfg = transformers.AutoConfig.from_pretrained(ckpt)
    assert cfg.rope_parameters["rope_type"] == "yarn"
    assert cfg.rope_parameters["rope_theta"] == B.FULL.rope_theta
    assert cfg.rope_parameters["factor"] == B.FULL.yarn_factor


def test_weights(ckpt, report):
    tensors = safetensors_torch.load_file(str(ckpt / "model.safetensors"))
    bias = {k: t for k, t in tensors.items() if k.endswith("e_score_correction_bias")}  # buffers
    assert sum(t.numel() for k, t in tensors.items() if k not in bias) == report["parameters"]
    assert len(bias) == B.FULL.num_layers - B.FULL.first_k_dense_replace
    for t in bias.values():  # DeepSeek-V3 keeps it in float32; balanced during training
        assert t.dtype == torch.float32 and t.shape == (B.FULL.n_routed_experts,)
        assert float(t.abs().max()) > 0
    others = [t for k, t in tensors.items() if k not in bias]
    assert all(t.dtype == torch.bfloat16 for t in others)
    experts = [k for k in tensors if ".mlp.experts." in k]  # per-expert, as checkpoints store them
    assert len(experts) == 3 * len(bias) * B.FULL.n_routed_experts
    assert "lm_head.weight" in tensors  # untied


def test_tokenizer_is_the_default_models(ckpt):
    """Same corpus, same recipe: the tokenizer the default model's builder trains."""
    assert (ckpt / "tokenizer.json").read_bytes() == (
        DEFAULT_MODEL_DIR / "tokenizer.json"
    ).read_bytes()


def test_heldout_perplexity_slice(ckpt, model_fp32, report):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    _, held = corpus.split_files(corpus.list_corpus_files())
    L, windows = B.FULL.seq_len, 8
    ids: list[int] = []
    for f in held:
        ids += T.encode_stream(tok.backend_tokenizer, [corpus.read_text(f)])
        if len(ids) > windows * L + 1:
            break
    ppl, n = T.heldout_perplexity(model_fp32, ids, L, windows)
    assert n == windows * L and math.isfinite(ppl)
    # trained: far below the vocabulary size (4096, an untrained model), near the build's figure
    assert ppl < 2.0 * report["heldout_perplexity"] < 1000, (ppl, report["heldout_perplexity"])


def test_greedy_is_python_like(ckpt, model_fp32):
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    enc = tok("def __init__(self", return_tensors="pt")
    with torch.no_grad():
        out = model_fp32.generate(
            **enc, do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id
        )
    text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert len(text) >= 10
    printable = sum(ch.isascii() and (ch.isprintable() or ch in "\n\t") for ch in text)
    assert printable / len(text) > 0.95, text
    assert any(w in text for w in ("self", "=", "(", ":", "return")), text


def test_build_is_deterministic_tiny(tmp_path):
    kw = dict(seed=7, steps=3, tiny=True, threads=1, log=lambda *a: None)
    r1 = B.build(tmp_path / "a", **kw)
    r2 = B.build(tmp_path / "b", **kw)
    assert r1["training_steps"] == 3 and r1["parameters"] == r2["parameters"]
    t1 = safetensors_torch.load_file(str(tmp_path / "a" / "model.safetensors"))
    t2 = safetensors_torch.load_file(str(tmp_path / "b" / "model.safetensors"))
    assert t1.keys() == t2.keys()
    for k in t1:
        assert t1[k].dtype == t2[k].dtype
        assert torch.equal(t1[k].view(torch.uint8), t2[k].view(torch.uint8)), k
    for name in ("tokenizer.json", "config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert r1["heldout_perplexity"] == r2["heldout_perplexity"]
    assert r1["router_bias_max_abs"] == r2["router_bias_max_abs"] > 0
    assert r1["samples_greedy"] == r2["samples_greedy"]


def test_build_refuses_foreign_out_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError, match=r"notes\.txt"):
        B.build(tmp_path, tiny=True, steps=1, log=lambda *a: None)
    assert (tmp_path / "notes.txt").read_text() == "not a model"

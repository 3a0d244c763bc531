"""Random checkpoints shaped as the released GLM-5 and Kimi K2 configs have them, saved by
transformers as it saves them (no SGLang-only keys: kvguard-serve supplies what transformers'
model code fixes).

Released values kept: the head shapes (MLA latent 512 + rope 64, ``qk_nope_head_dim``,
``v_head_dim``), the indexer (``index_head_dim`` 128, ``index_n_heads`` 32, interleaved indexer
rope as transformers' GlmMoeDsa applies it), the rope (GLM-5: default, theta 1e6; Kimi K2: YaRN
factor 32, beta 1/1, mscale 1/1, 4096 original positions, theta 50000; DeepSeek-V3.2-style YaRN
on the DSA architecture: factor 40, beta 32/1), routing (sigmoid, ``noaux_tc``, group 1,
``routed_scaling_factor``), ``first_k_dense_replace``, ``num_nextn_predict_layers``. Toy: hidden
size, layer count, experts, vocabulary (the default model's tokenizer), ``q_lora_rank``, heads,
``index_topk`` (32, so short prompts test the exact path and 150 tokens the selection).
Built once per machine, like :mod:`tiny_model`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tiny_model import cached_build

INDEX_TOPK = 32

# the released configs' values (GLM-5: zai-org/GLM-5; Kimi K2: moonshotai/Kimi-K2-Instruct)
GLM5 = dict(
    qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, kv_lora_rank=512,
    index_head_dim=128, index_n_heads=32, n_group=1, topk_group=1, routed_scaling_factor=2.5,
    first_k_dense_replace=3, num_nextn_predict_layers=1, max_position_embeddings=202752,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)  # fmt: skip
DSA_YARN = {  # DeepSeek-V3.2's rope on the GLM-5 architecture: the released-config crash
    **GLM5,
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
}  # fmt: skip
KIMI_K2 = dict(
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, n_group=1,
    topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
    num_nextn_predict_layers=0, max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
)  # fmt: skip
TOY = dict(
    vocab_size=4096, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, bos_token_id=0,
    eos_token_id=1, pad_token_id=2,
    initializer_range=0.1,  # peaked logits: greedy argmax is not decided by rounding
)  # fmt: skip


def glm5() -> Path:
    return _cached("glm5", "GlmMoeDsa", {**GLM5, "index_topk": INDEX_TOPK})


def dsa_yarn() -> Path:
    return _cached("dsa-yarn", "GlmMoeDsa", {**DSA_YARN, "index_topk": INDEX_TOPK})


def kimi_k2() -> Path:
    return _cached("kimi-k2", "DeepseekV3", KIMI_K2)


def _cached(name: str, arch: str, fields: dict) -> Path:
    return cached_build(f"released-{name}", __file__, lambda out: _build(out, arch, fields))


def _build(out: Path, arch: str, fields: dict) -> None:
    import torch
    import transformers

    tok = Path(__file__).resolve().parents[1] / "serve" / "default_model" / "checkpoint"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / name, out / name)
    config = getattr(transformers, f"{arch}Config")(**TOY, **fields)
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)

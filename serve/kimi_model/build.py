"""Build kvguard's tiny Kimi-K2-architecture model, offline and deterministically.

Usage::

    python -m kvguard.serve.kimi_model.build --out DIR [--steps N] [--minutes M] [--seed S]

Kimi K2 is the DeepSeek-V3 text architecture: MLA attention (queries through a low-rank
``q_lora_rank`` bottleneck; keys and values through one compressed latent per token,
``kv_lora_rank`` + a shared ``qk_rope_head_dim`` rotary part, which is what the KV cache stores)
and a mixture of experts (sigmoid router with an aux-loss-free ``e_score_correction_bias``, routed
top-k plus one shared expert, the first layer dense). This family makes the same architecture at
toy size, with the field names and kinds of values a real Kimi K2 ``config.json`` carries
(``DeepseekV3ForCausalLM``, YaRN rope scaling with its ``beta_fast``/``beta_slow``/``mscale``/
``mscale_all_dim``, ``topk_method: noaux_tc``, ``n_group``/``topk_group``,
``routed_scaling_factor``, ...), so that SGLang runs the code paths it runs for the real model.

Built by the shared builder (``kvguard.serve.tiny_builder``: the default model's corpus,
tokenizer and schedule): ``DeepseekV3ForCausalLM``, hidden 128, 4 layers (layer 0 dense, 1-3
MoE), 4 heads, q_lora_rank 64, kv_lora_rank 64, qk_rope_head_dim 16, qk_nope_head_dim 32,
v_head_dim 32, 8 routed experts (top-2, moe_intermediate_size 64) + 1 shared expert; untied
embeddings (as in Kimi K2); ~2.1M parameters. The router bias is updated the aux-loss-free way
DeepSeek-V3 does it (``tiny_builder.RouterBalancer``), so ``e_score_correction_bias`` holds real,
non-zero values (saved in float32). ``config.json`` is written in the real checkpoint's form
(``rope_scaling`` and ``rope_theta`` keys, sorted).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvguard.serve import tiny_builder as tb

DEFAULT_STEPS = 800
DEFAULT_MINUTES = 10.0
# DeepSeek-V3's bias update speed for aux-loss-free load balancing (its paper's gamma).
BIAS_UPDATE_SPEED = 1e-3


@dataclass(frozen=True)
class Spec(tb.Recipe):
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    intermediate_size: int = 384  # the dense first layer's MLP
    moe_intermediate_size: int = 64
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.827
    rope_theta: float = 50000.0
    yarn_factor: float = 4.0
    original_max_position_embeddings: int = 512

    @property
    def max_position_embeddings(self) -> int:
        return int(self.yarn_factor * self.original_max_position_embeddings)


FULL = Spec()
TINY = Spec(
    **tb.TINY_RECIPE,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    original_max_position_embeddings=64,
)


def checkpoint_config(spec: Spec) -> dict[str, Any]:
    """``config.json`` as a Kimi K2 checkpoint writes it (its field names, its kinds of values)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": tb.BOS_ID,
        "eos_token_id": tb.EOS_ID,
        "pad_token_id": tb.PAD_ID,
        "ep_size": 1,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "kv_lora_rank": spec.kv_lora_rank,
        "max_position_embeddings": spec.max_position_embeddings,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": spec.n_group,
        "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": spec.n_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": spec.num_heads,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_heads,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": spec.q_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": spec.yarn_factor,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": spec.original_max_position_embeddings,
            "type": "yarn",
        },
        "rope_theta": spec.rope_theta,
        "routed_scaling_factor": spec.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": spec.topk_group,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": spec.v_head_dim,
        "vocab_size": spec.vocab_size,
    }


def make_model(spec: Spec) -> tuple[Any, dict[str, Any]]:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg_json = checkpoint_config(spec)
    config = DeepseekV3Config.from_dict(copy.deepcopy(cfg_json))  # it edits rope_scaling
    return DeepseekV3ForCausalLM(config), cfg_json


FAMILY = tb.Family(
    name="kimi_model",
    title="kvguard's tiny Kimi-K2-architecture model",
    full=FULL,
    tiny=TINY,
    default_steps=DEFAULT_STEPS,
    default_minutes=DEFAULT_MINUTES,
    make_model=make_model,
    make_hooks=lambda model, spec: [tb.RouterBalancer(model, BIAS_UPDATE_SPEED)],
    dtype_on_disk="bfloat16 (e_score_correction_bias float32)",
    report_extra=lambda spec: {
        "kv_cache_values_per_token_and_layer": spec.kv_lora_rank + spec.qk_rope_head_dim
    },
)


def build(out: Path, **kw: Any) -> dict[str, Any]:
    """``tiny_builder.build`` for this family (keywords: seed, steps, minutes, tiny, threads,
    command, log, spec)."""
    return tb.build(FAMILY, out, **kw)


def main(argv: list[str] | None = None) -> int:
    return tb.main(FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())

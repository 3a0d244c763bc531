"""Build kvguard's tiny GLM-5-architecture model, offline and deterministically.

Usage::

    python -m kvguard.serve.glm_model.build --out DIR [--steps N] [--minutes M] [--seed S]

GLM-5 (``GlmMoeDsaForCausalLM``, ``model_type`` ``glm_moe_dsa``) is the DeepSeek-V3 text
architecture (MLA attention with a ``q_lora_rank`` bottleneck and one compressed latent per token;
MoE with a sigmoid ``noaux_tc`` router, routed top-k plus a shared expert, the first layer dense)
plus DeepSeek Sparse Attention: each layer's *indexer* scores every earlier token
(``sum_h w[t,h] * relu(q[t,h] . k[j])`` over ``index_n_heads`` heads of ``index_head_dim``, with
interleaved rope on the first ``qk_rope_head_dim`` dims) and attention reads only the top
``index_topk`` of them. This family makes that at toy size, with the dimensions SGLang's DSA code
requires (``index_head_dim`` 128, ``kv_lora_rank`` a multiple of 128, rope 64, ``q_lora_rank``
set) and the config keys SGLang reads that transformers does not save (``topk_method``,
``scoring_func``, ``moe_layer_freq``, ``indexer_rope_interleave``); no MTP layer
(``num_nextn_predict_layers`` 0).

Built by the shared builder (``kvguard.serve.tiny_builder``: the default model's corpus,
tokenizer and schedule), with two per-step hooks: the Kimi model's aux-loss-free router-bias
update, and :class:`IndexerDistiller`. transformers runs the indexer under ``no_grad`` (its scores
only pick the top-k), so the language-model loss never reaches it; the distiller adds, for every
indexer layer, ``KL(dense attention || indexer)``: the layer's attention probabilities over all
causal positions (no top-k), averaged over heads and detached, against the softmax of the
indexer's logits recomputed with gradients from the same detached inputs (DeepSeek-V3.2's
indexer warm-up objective).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvguard.serve import tiny_builder as tb

DEFAULT_STEPS = 800
DEFAULT_MINUTES = 15.0
BIAS_UPDATE_SPEED = 1e-3  # as for the Kimi model
# The KL term's weight in the loss. Only the indexer's parameters receive its gradient (their
# inputs are detached) and AdamW normalizes each parameter's step, so it mostly sets how much of
# the global gradient-clipping budget the term takes: small.
DISTILL_WEIGHT = 0.1


@dataclass(frozen=True)
class Spec(tb.Recipe):
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    q_lora_rank: int = 64
    kv_lora_rank: int = 128  # FP8 DSA rows need a multiple of 128
    qk_rope_head_dim: int = 64  # SGLang's DSA kernels and FP8 rows: 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    index_head_dim: int = 128  # asserted by SGLang's DSATokenToKVPool
    index_n_heads: int = 4
    index_topk: int = 32
    intermediate_size: int = 384  # the dense first layer's MLP
    moe_intermediate_size: int = 64
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 2048
    distill_weight: float = DISTILL_WEIGHT


FULL = Spec()
# Smaller everywhere SGLang allows; the DSA dimensions it asserts stay, so the tiny model serves.
TINY = Spec(
    **tb.TINY_RECIPE,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    q_lora_rank=32,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_n_heads=2,
    index_topk=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=4,
    max_position_embeddings=256,
)


def checkpoint_config(spec: Spec) -> dict[str, Any]:
    """``config.json`` with GLM-5's field names, plus the keys SGLang reads that transformers
    does not save."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tb.BOS_ID,
        "eos_token_id": tb.EOS_ID,
        "pad_token_id": tb.PAD_ID,
        "dtype": "bfloat16",
        "ep_size": 1,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "head_dim": spec.qk_rope_head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "index_head_dim": spec.index_head_dim,
        "index_n_heads": spec.index_n_heads,
        "index_topk": spec.index_topk,
        "indexer_rope_interleave": True,  # HF's indexer rope; SGLang's default is NeoX
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "kv_lora_rank": spec.kv_lora_rank,
        "max_position_embeddings": spec.max_position_embeddings,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": spec.n_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": spec.num_heads,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_heads,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": spec.q_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "rms_norm_eps": 1e-5,
        "rope_interleave": True,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "routed_scaling_factor": spec.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "use_cache": True,
        "v_head_dim": spec.v_head_dim,
        "vocab_size": spec.vocab_size,
    }


def make_model(spec: Spec) -> tuple[Any, dict[str, Any]]:
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    cfg_json = checkpoint_config(spec)
    config = GlmMoeDsaConfig.from_dict(copy.deepcopy(cfg_json))
    return GlmMoeDsaForCausalLM(config), cfg_json


# ----------------------------------------------------------------------- indexer distillation
def _rope(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int) -> Any:
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        apply_rotary_pos_emb_interleave,
    )

    return apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


def dense_attention_probs(attn: Any, h: Any, q_resid: Any, cos: Any, sin: Any) -> Any:
    """``[B, S, S]``: a GlmMoeDsaAttention's probabilities over all causal positions (no top-k
    selection), averaged over heads: its eager forward with a plain causal mask."""
    import torch

    B, S, _ = h.shape
    q = attn.q_b_proj(q_resid).view(B, S, -1, attn.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    kv_pass, k_rot = torch.split(
        attn.kv_a_proj_with_mqa(h), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1
    )
    k_pass = attn.kv_a_layernorm(kv_pass).view(B, 1, S, attn.kv_lora_rank)
    q_rot, k_rot = _rope(q_rot, k_rot.view(B, 1, S, -1), cos, sin, unsqueeze_dim=1)
    keys, _values = attn.expand_kv(k_pass, k_rot)
    scores = torch.matmul(torch.cat((q_pass, q_rot), dim=-1), keys.transpose(2, 3)) * attn.scaling
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).mean(1)


def indexer_logits(ix: Any, h: Any, q_resid: Any, cos: Any, sin: Any) -> Any:
    """``[B, S, S]``: a GlmMoeDsaIndexer's scores (its forward's math, with gradients), ``-inf``
    at non-causal positions; its top ``index_topk`` are what its forward selects."""
    import torch

    B, S, _ = h.shape
    rope, rest = ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [rope, rest], dim=-1)
    k = ix.k_norm(ix.wk(h)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, rest], dim=-1)
    q_rot, k_rot = _rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale
    w = ix.weights_proj(h.to(ix.weights_proj.weight.dtype)).float() * ix.n_heads**-0.5
    logits = torch.matmul(w.unsqueeze(-2), torch.relu(scores)).squeeze(-2)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf"))


def indexer_kl(p_attn: Any, logits: Any) -> Any:
    """Mean over queries of KL(p_attn || softmax(logits)) over causal positions."""
    import torch

    log_q = torch.log_softmax(logits, dim=-1).masked_fill(torch.isinf(logits), 0.0)
    return (torch.xlogy(p_attn, p_attn) - p_attn * log_q).sum(-1).mean()


def _sig(x: float) -> float:
    """Four significant digits (the KL of a barely trained model is ~1e-4)."""
    return float(f"{x:.4g}")


def topk_mass(p_attn: Any, picks: Any, k: int) -> float:
    """Mean attention probability on the picked positions, over queries at positions >= k (the
    earlier ones attend to everything)."""
    return float(p_attn.gather(-1, picks).sum(-1)[:, k:].mean())


class IndexerDistiller(tb.TrainHook):
    """KL(dense head-averaged attention || indexer softmax) per indexer layer, added to the loss
    with ``weight``; reports that KL on held-out windows for the trained indexer and for its
    initial weights, and the attention mass its top-k picks cover."""

    EVAL_WINDOWS = 8

    def __init__(self, model: Any, weight: float):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention

        self.weight = weight
        self.layers = [
            m
            for m in model.modules()
            if isinstance(m, GlmMoeDsaAttention) and m.indexer is not None
        ]
        self.initial = [copy.deepcopy(a.indexer) for a in self.layers]
        self.captured: dict[int, tuple[Any, Any]] = {}
        self.probing = False
        self.kl_history: list[float] = []
        for i, attn in enumerate(self.layers):
            attn.register_forward_pre_hook(self._capture(i), with_kwargs=True)

    def _capture(self, i: int) -> Any:
        def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            if module.training or self.probing:
                self.captured[i] = (kwargs["hidden_states"].detach(), kwargs["position_embeddings"])

        return hook

    def _terms(self, i: int, indexer: Any = None) -> tuple[Any, Any]:
        import torch

        attn = self.layers[i]
        h, (cos, sin) = self.captured[i]
        with torch.no_grad():
            q_resid = attn.q_a_layernorm(attn.q_a_proj(h))
            p_attn = dense_attention_probs(attn, h, q_resid, cos, sin)
        ix = attn.indexer if indexer is None else indexer
        return p_attn, indexer_logits(ix, h, q_resid, cos, sin)

    def extra_loss(self) -> Any:
        import torch

        kl = torch.stack([indexer_kl(*self._terms(i)) for i in range(len(self.layers))]).mean()
        self.captured.clear()
        self.kl_history.append(kl.item())
        return self.weight * kl

    def status(self) -> str:
        return f"indexer-kl {self.kl_history[-1]:.3f}" if self.kl_history else ""

    def report(self, model: Any, held: Any) -> dict[str, Any]:
        import torch

        k = self.layers[0].indexer.index_topk
        figures: dict[str, list[float]] = {
            n: [] for n in ("kl_trained", "kl_initial", "mass_trained", "mass_initial", "recent")
        }
        model.eval()
        self.probing = True
        try:
            with torch.no_grad():
                x = held[: self.EVAL_WINDOWS, :-1]
                model(input_ids=x)
                S = x.shape[1]
                pos = torch.arange(S)
                recent = torch.ones(S, S, dtype=torch.bool).tril() & (
                    pos[None, :] > pos[:, None] - k
                )
                for i in range(len(self.layers)):
                    p_attn, trained = self._terms(i)
                    _, initial = self._terms(i, self.initial[i])
                    figures["kl_trained"].append(float(indexer_kl(p_attn, trained)))
                    figures["kl_initial"].append(float(indexer_kl(p_attn, initial)))
                    figures["mass_trained"].append(topk_mass(p_attn, trained.topk(k).indices, k))
                    figures["mass_initial"].append(topk_mass(p_attn, initial.topk(k).indices, k))
                    figures["recent"].append(float((p_attn * recent).sum(-1)[:, k:].mean()))
        finally:
            self.probing = False
            self.captured.clear()
        mean = {n: _sig(sum(v) / len(v)) for n, v in figures.items()}
        last = self.kl_history[-10:]
        return {
            "indexer_distillation": {
                "weight": self.weight,
                "train_kl_first": _sig(self.kl_history[0]) if self.kl_history else None,
                "train_kl_mean_last10": _sig(sum(last) / len(last)) if last else None,
                "heldout_windows": int(x.shape[0]),
                "heldout_kl_trained_indexer": mean["kl_trained"],
                "heldout_kl_initial_indexer": mean["kl_initial"],
                "heldout_topk_attention_mass_trained_indexer": mean["mass_trained"],
                "heldout_topk_attention_mass_initial_indexer": mean["mass_initial"],
                "heldout_topk_attention_mass_most_recent_tokens": mean["recent"],
                "method": "KL(dense attention averaged over heads || softmax of the indexer's "
                "logits) over causal positions, mean over queries and indexer layers, with the "
                "final model's attention for both indexers; top-k attention mass: the dense "
                f"attention's probability on the index_topk ({k}) picked positions, for queries "
                f"at positions >= {k}; 'most recent tokens' picks the last {k}",
            }
        }


FAMILY = tb.Family(
    name="glm_model",
    title="kvguard's tiny GLM-5-architecture model",
    full=FULL,
    tiny=TINY,
    default_steps=DEFAULT_STEPS,
    default_minutes=DEFAULT_MINUTES,
    make_model=make_model,
    make_hooks=lambda model, spec: [
        tb.RouterBalancer(model, BIAS_UPDATE_SPEED),
        IndexerDistiller(model, spec.distill_weight),
    ],
    dtype_on_disk="bfloat16 (e_score_correction_bias float32)",
    report_extra=lambda spec: {
        "kv_cache_values_per_token_and_layer": spec.kv_lora_rank + spec.qk_rope_head_dim,
        "index_key_bytes_per_token_and_layer": spec.index_head_dim + 4,  # FP8 key + fp32 scale
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

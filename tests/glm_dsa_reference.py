"""Torch references for the GLM-5 (DSA) tests: transformers' indexer with the FP8 quantization
SGLang's fused GLM path applies (and patches/dsa_cpu.py follows), and the index-key byte layout
decoded as the note on DSA (shared/notes/glm-dsa-on-cpu.md) states it, independently of
dsa_cpu.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

FP8_MAX = 448.0


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / s quantized to e4m3 and read back as fp32, s) with s = max(amax, 1e-4) / 448 per
    row of the last dimension."""
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX
    q = (x * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return q, s


def _fp8_indexer_forward(
    self,
    hidden_states,
    q_resid,
    position_embeddings,
    attention_mask,
    position_ids,
    past_key_values=None,
):
    """transformers' GlmMoeDsaIndexer.forward with FP8 keys (from bf16) and queries, bf16 head
    weights: the logits of SGLang's fused GLM indexer."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        apply_rotary_pos_emb_interleave,
    )

    b, s, _ = hidden_states.shape
    rope = self.qk_rope_head_dim
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(
        q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2
    )
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    k8, s_k = fp8_rows(k.to(torch.bfloat16).float())  # [B, T, D], [B, T, 1]
    q8, s_q = fp8_rows(q.float())  # [B, S, H, D], [B, S, H, 1]
    scores = F.relu(torch.einsum("bshd,btd->bsht", q8, k8))
    w = F.linear(hidden_states.to(torch.bfloat16), self.weights_proj.weight.to(torch.bfloat16))
    w = w.float() * (self.n_heads**-0.5 * self.softmax_scale) * s_q[..., 0]
    index_scores = torch.einsum("bsh,bsht->bst", w, scores) * s_k[:, None, :, 0]
    if attention_mask.dtype == torch.bool:
        index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
    else:
        index_scores = index_scores + attention_mask
    topk = min(self.index_topk, index_scores.shape[-1])
    return index_scores.topk(topk, dim=-1).indices.to(torch.int32)


@contextlib.contextmanager
def fp8_indexer() -> Iterator[None]:
    """transformers' GLM-5 indexer computes SGLang's FP8 logits while this is open."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    real = m.GlmMoeDsaIndexer.forward
    m.GlmMoeDsaIndexer.forward = _fp8_indexer_forward
    try:
        yield
    finally:
        m.GlmMoeDsaIndexer.forward = real


def decode_index_page_bytes(
    buf: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 key codes [N, 128] uint8, fp32 scales [N]) at ``slots`` of an index-key buffer
    ``[pages, 64 * 132]``: page p = slot // 64 holds 64 keys of 128 bytes, token-major, then 64
    little-endian fp32 scales from byte 8192."""
    page, off = slots // 64, slots % 64
    codes = torch.stack([buf[p, o * 128 : (o + 1) * 128] for p, o in zip(page, off)])
    raw = torch.stack([buf[p, 8192 + 4 * o : 8192 + 4 * o + 4] for p, o in zip(page, off)])
    return codes, raw.contiguous().view(torch.float32).view(-1)


def _fp8_latent_expand_kv(real):
    def expand_kv(self, k_pass, k_rot):
        """SGLang's FP8 DSA row, read back: the latent per 128-value block as e4m3 with scale
        amax / 448, the rope part as bf16."""
        shape = k_pass.shape
        blocks = k_pass.float().reshape(-1, 128)
        s = blocks.abs().amax(-1, keepdim=True) / FP8_MAX
        q = (blocks * (1.0 / s)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        k_pass = (q * s).reshape(shape).to(k_pass.dtype)
        return real(self, k_pass, k_rot.to(torch.bfloat16).to(k_rot.dtype))

    return expand_kv


@contextlib.contextmanager
def fp8_latent() -> Iterator[None]:
    """transformers' GLM-5 attention reads its latent KV as SGLang's FP8 DSA pool stores it."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    real = m.GlmMoeDsaAttention.expand_kv
    m.GlmMoeDsaAttention.expand_kv = _fp8_latent_expand_kv(real)
    try:
        yield
    finally:
        m.GlmMoeDsaAttention.expand_kv = real

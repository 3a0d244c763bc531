"""MLA models (DeepSeek-V2/V3 architecture: Kimi K2, DeepSeek V3, ...) on CPU with SGLang's
``torch_native`` attention backend. Hook functions named in ``targets.py`` (MLA_TARGETS).

What SGLang 0.5.23 does, and what this file changes:

* Attention method. ``DeepseekV2AttentionMLA.dispatch_attn_forward_method`` asks
  ``AttentionBackendRegistry.get_handler(<backend name>)`` how to run each forward. There is no
  handler for ``torch_native``, so the Triton one answers: prefill without a cached prefix goes
  to the MHA path, which hands the backend ragged per-head K/V (qk_head_dim wide) and does not
  save them, while ``torch_native`` reads the pool's latent rows (kv_lora_rank + rope wide): SDPA
  fails on the first prefill (``[4, 48]`` vs ``[4, 80]``). ``around_get_handler`` answers
  ``torch_native`` with the absorbed-MLA method SGLang itself picks for decode
  (``_dispatch_mla_subtype``): every forward writes the latent row to the pool and attends over
  the latent rows, which is what ``torch_native`` implements, and ``forward_mla.py`` already has
  its CPU torch branches.
* Rotary embedding. On CPU ``get_rope_wrapper`` calls ``get_rope_cpu``, which asserts that the
  rope is DeepSeek's YaRN (``deepseek_yarn``, what DeepSeek's model code renames any rope scaling
  to). A checkpoint with no rope scaling (plain RoPE) stops there. ``around_get_rope_cpu`` sends
  every other rope to SGLang's generic ``get_rope``, whose embeddings run ``forward_native`` on a
  CPU without AMX (and SGLang's CPU kernel with it).

Both hooks leave every other backend, rope and device exactly as SGLang made them.
"""

from __future__ import annotations

TORCH_NATIVE = "torch_native"
_CPU_ROPE = "deepseek_yarn"  # the one rope type get_rope_cpu implements


# -- AttentionBackendRegistry.get_handler (AROUND) ----------------------------------------------
def around_get_handler(original, registry, backend_name, *args, **kwargs):
    if backend_name != TORCH_NATIVE:
        return original(registry, backend_name, *args, **kwargs)
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        _dispatch_mla_subtype,
    )

    return _dispatch_mla_subtype


# -- rotary_embedding.factory.get_rope_cpu (AROUND) --------------------------------------------
def around_get_rope_cpu(
    original,
    head_size,
    rotary_dim,
    max_position,
    base,
    is_neox_style=True,
    rope_scaling=None,
    dtype=None,
    partial_rotary_factor=1.0,
    device=None,
):
    """Same signature as ``get_rope_cpu``; DeepSeek YaRN stays on SGLang's CPU path."""
    if rope_scaling is not None and rope_scaling.get("rope_type") == _CPU_ROPE:
        return original(
            head_size,
            rotary_dim,
            max_position,
            base,
            is_neox_style,
            rope_scaling,
            dtype,
            partial_rotary_factor,
            device,
        )
    from sglang.srt.layers.rotary_embedding.factory import get_rope

    # get_rope builds its cos/sin cache on the default device: the CPU here
    return get_rope(
        head_size,
        rotary_dim,
        max_position,
        base,
        is_neox_style,
        rope_scaling,
        dtype,
        partial_rotary_factor,
    )

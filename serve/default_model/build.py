"""Build kvguard's embedded default model, offline and deterministically.

Usage::

    python -m kvguard.serve.default_model.build --out DIR [--steps N] [--minutes M] [--seed S]

A small ``LlamaForCausalLM`` (hidden 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, MLP 688,
tied embeddings; 3,950,848 parameters), built by the shared builder
(``kvguard.serve.tiny_builder``: stdlib corpus, byte-level BPE tokenizer, AdamW schedule,
bfloat16 checkpoint, ``build_report.json``). The reproducible default is DEFAULT_STEPS steps of
8 x 256 tokens (983,040 training tokens; ~4.2 minutes at ~0.52 s/step with 2 threads on the idle
2-core build machine, 3-10x that when the machine is shared); ``--minutes`` is only a safety
budget.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvguard.serve import tiny_builder as tb

DEFAULT_STEPS = 480
DEFAULT_MINUTES = 6.0


@dataclass(frozen=True)
class Spec(tb.Recipe):
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True


FULL = Spec()
TINY = Spec(
    **tb.TINY_RECIPE,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=128,
    max_position_embeddings=256,
)


def make_model(spec: Spec) -> tuple[Any, None]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tb.BOS_ID,
        eos_token_id=tb.EOS_ID,
        pad_token_id=tb.PAD_ID,
        attention_bias=False,
        mlp_bias=False,
    )
    return LlamaForCausalLM(config), None


FAMILY = tb.Family(
    name="default_model",
    title="kvguard's embedded default model",
    full=FULL,
    tiny=TINY,
    default_steps=DEFAULT_STEPS,
    default_minutes=DEFAULT_MINUTES,
    make_model=make_model,
)


def build(out: Path, **kw: Any) -> dict[str, Any]:
    """``tiny_builder.build`` for this family (keywords: seed, steps, minutes, tiny, threads,
    command, log, spec)."""
    return tb.build(FAMILY, out, **kw)


def main(argv: list[str] | None = None) -> int:
    return tb.main(FAMILY, argv)


if __name__ == "__main__":
    sys.exit(main())

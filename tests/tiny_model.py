"""A serving-test model: kvguard's embedded default model when it is installed, otherwise a tiny
random-weight Llama (byte-level BPE tokenizer, 2 layers, hidden 64) built here, offline, in
seconds. Random weights make the text meaningless; tests that need a trained model use the
default model's own builder instead."""

from __future__ import annotations

import hashlib
import inspect
import shutil
import tempfile
from pathlib import Path


def default_model() -> Path | None:
    try:
        from kvguard.serve.default_model import ensure_default_model
    except ImportError:
        return None
    try:
        return ensure_default_model()
    except FileNotFoundError:
        return None


def cached_build(name: str, source: str, build) -> Path:
    """``build(dir)``'s checkpoint, built once per machine under the temp dir and keyed by the
    source file that defines it (``source``: its ``__file__``); concurrent builders race safely."""
    digest = hashlib.sha256(Path(source).read_bytes()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / "kvguard-test-models"
    out = root / f"{name}-{digest}"
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix="building-"))
    build(staging)
    try:
        staging.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return out


def tiny_random_llama() -> Path:
    """Built once per machine and cached under the temp dir, keyed by this file's source."""
    return cached_build("random-llama", __file__, _build)


def _build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([inspect.getsource(inspect)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


def serving_model() -> tuple[Path, bool]:
    """(model directory, whether it is kvguard's default model)."""
    path = default_model()
    return (path, True) if path is not None else (tiny_random_llama(), False)


# -- GLM-5 architecture (GlmMoeDsaForCausalLM: MLA + DSA indexer + MoE) ------------------------
GLM_INDEX_TOPK = 16
GLM_PAGE_SIZE = 64  # SGLang's DSA pool asserts it
# What SGLang's DeepSeek model reads and transformers does not save (deepseek_v2.py), and no MTP
# layer (HF has none; kvguard refuses speculative decoding).
_GLM_SGLANG_KEYS = dict(
    topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, num_nextn_predict_layers=0
)


def tiny_random_glm_dsa() -> Path:
    """A random-init GLM-5-architecture checkpoint at toy size, with the default model's
    tokenizer; built once per machine (cached like :func:`tiny_random_llama`)."""
    return cached_build("random-glm-dsa", __file__, _build_glm_dsa)


def _build_glm_dsa(out: Path) -> None:
    import json

    import torch
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    tok_dir = Path(__file__).resolve().parents[1] / "serve" / "default_model" / "checkpoint"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out / name)
    torch.manual_seed(0)
    config = GlmMoeDsaConfig(
        vocab_size=4096,  # the default model's tokenizer
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,  # without it SGLang never calls the indexer (forward_mla.py)
        kv_lora_rank=128,  # a multiple of 128: SGLang's FP8 row has one scale per 128 values
        qk_rope_head_dim=64,  # the FP8 row's rope part is 0 or 64 values
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        index_topk=GLM_INDEX_TOPK,
        index_head_dim=128,  # SGLang's index-key cache asserts it
        index_n_heads=4,
        indexer_rope_interleave=True,  # HF's indexer rope; SGLang's default is NeoX
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        initializer_range=0.1,  # peaked logits: greedy argmax is not decided by rounding
        **_GLM_SGLANG_KEYS,
    )
    model = GlmMoeDsaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(_GLM_SGLANG_KEYS, indexer_rope_interleave=True)  # kept whatever HF saves
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

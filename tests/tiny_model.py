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


def tiny_random_llama() -> Path:
    """Built once per machine and cached under the temp dir, keyed by this file's source."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / "kvguard-test-models"
    out = root / f"random-llama-{digest}"
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix="building-"))
    _build(staging)
    try:
        staging.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return out


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

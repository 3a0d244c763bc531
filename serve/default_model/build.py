"""Build kvguard's embedded default model, offline and deterministically.

Usage::

    python -m kvguard.serve.default_model.build --out DIR [--minutes M] [--seed S]

What it does (nothing is downloaded; nothing loads from a model hub):

1. Corpus: the ``.py`` files of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``), sorted, skipping ``test``/``tests``/
   ``idlelib``/``lib2to3``/``site-packages``/``pydoc_data`` directories and the
   gencodec-generated charmap tables in ``encodings/`` (data, not code; they
   made greedy output drift into ``0x00c0: 0x0041, # LATIN ...`` tables).
   Every 50th file (index 0, 50, 100, ...) is held out for evaluation.
2. Tokenizer: byte-level BPE trained here with ``tokenizers`` (vocab 4096,
   specials ``<s>``=0, ``</s>``=1, ``<pad>``=2), saved as a Hugging Face fast
   tokenizer.  Encoding prepends ``<s>``; any UTF-8 text round-trips.
3. Model: a small ``LlamaForCausalLM`` (hidden 256, 4 layers, 4 heads, 2 KV
   heads, head_dim 64, MLP 688, tied embeddings; 3,950,848 parameters) trained
   from a fixed seed with AdamW (lr 3e-3, 20 warmup steps, cosine to 10%,
   batch 8 x 256 tokens) on non-overlapping 256-token windows in a seeded order.
4. Output: ``save_pretrained`` in bfloat16 (config.json, generation_config.json,
   model.safetensors) + tokenizer files + ``build_report.json``.

Reproducibility: the run is defined by its *step count* (``--steps``, default
``DEFAULT_STEPS`` = 480, i.e. 983,040 training tokens), not by wall-clock
time.  480 steps take ~4.2 minutes (~0.52 s/step) with 2 threads on the idle
2-core build machine, and 3-10x that when the machine is shared.
``--minutes`` (default 6) is only a safety budget on the training loop: if it
runs out first, training stops early, the report says ``"stopped_early":
true``, the exit status is 1 and the result is NOT the reproducible artifact
(pass a larger ``--minutes`` on a busy machine).  Given the same Python stdlib
(the corpus), torch build, CPU type and thread count (``--threads``, default
2), the weights are bit-for-bit identical.  Output is written to a staging
directory and swapped in at the end, so an existing ``--out`` stays intact
until a build finishes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvguard.serve.corpus import (
    GENERATED_HEADER,
    HELDOUT_EVERY,
    SKIP_DIRS,
    corpus_digest,
    list_corpus_files,
    read_text,
    split_files,
    stdlib_root,
)

# Keep the Rust side of `tokenizers` modest on a shared 2-core machine.
os.environ.setdefault("RAYON_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
BOS, EOS, PAD = SPECIAL_TOKENS
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

# The reproducible default: this many optimizer steps (about 4.2 minutes of
# wall clock with 2 threads on the idle 2-core build machine, ~0.52 s/step);
# the --minutes default leaves headroom above that.
DEFAULT_STEPS = 480
DEFAULT_SEED = 1234
DEFAULT_MINUTES = 6.0

SAMPLE_PROMPTS = ("def __init__(self", "import ", "class ")


@dataclass(frozen=True)
class Spec:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_files: int | None = None  # None: the whole stdlib corpus
    eval_windows: int = 64  # held-out ppl over eval_windows * seq_len tokens
    sample_new_tokens: int = 48


FULL = Spec()
# Test-only configuration: small enough to build in a couple of seconds.
TINY = Spec(
    vocab_size=512,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=128,
    max_position_embeddings=256,
    seq_len=64,
    batch_size=4,
    warmup_steps=1,
    max_files=60,
    eval_windows=4,
    sample_new_tokens=8,
)


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    assert tok.token_to_id(PAD) == PAD_ID
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {EOS} {BOS} $B:1",
        special_tokens=[(BOS, BOS_ID), (EOS, EOS_ID)],
    )
    return tok


def wrap_tokenizer(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


# OpenAI chat clients (/v1/chat/completions) need a template; a code model has no dialogue
# format, so messages become comment lines and the answer follows the last one.
CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:{% endif %}"
)


def _portable_tokenizer_config(out: Path) -> None:
    """transformers 5 writes ``tokenizer_class: TokenizersBackend``, which 4.x
    does not know; ``PreTrainedTokenizerFast`` loads the same tokenizer.json in
    both (in 5.x it is an alias of ``TokenizersBackend``). Adds the chat template."""
    p = out / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg["chat_template"] = CHAT_TEMPLATE
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def encode_stream(tok, texts: list[str]) -> list[int]:
    """Concatenate ``<s> text </s>`` for each document."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return ids


# --------------------------------------------------------------------------
# Model / training
# --------------------------------------------------------------------------


def make_config(spec: Spec):
    from transformers import LlamaConfig

    return LlamaConfig(
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
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
    )


def lr_at(step: int, total: int, spec: Spec) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, total - spec.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cos)


def heldout_perplexity(model, ids, seq_len: int, windows: int) -> tuple[float, int]:
    """exp(mean NLL) in float32 over the first ``windows`` non-overlapping
    (seq_len+1)-token windows of the held-out stream."""
    import torch

    ids = torch.as_tensor(ids, dtype=torch.long)
    n = min(windows, (ids.numel() - 1) // seq_len)
    if n <= 0:
        raise ValueError("held-out stream too short")
    total_nll, total_tok = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, 8):
            rows = [ids[j * seq_len : j * seq_len + seq_len + 1] for j in range(i, min(n, i + 8))]
            x = torch.stack(rows)
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total_nll += float(nll)
            total_tok += x[:, 1:].numel()
    return math.exp(total_nll / total_tok), total_tok


def greedy_samples(model, hf_tok, prompts, max_new_tokens: int) -> list[dict]:
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for p in prompts:
            enc = hf_tok(p, return_tensors="pt")
            gen = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=PAD_ID,
                eos_token_id=EOS_ID,
            )
            cont = hf_tok.decode(gen[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            out.append({"prompt": p, "completion": cont})
    return out


def dir_bytes(d: Path, exclude=("build_report.json",)) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file() and f.name not in exclude)


# What a build writes; an existing --out dir holding anything else is refused.
OUTPUT_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "build_report.json",
    }
)


def _check_replaceable(final: Path) -> None:
    if final.exists():
        if not final.is_dir():
            raise FileExistsError(f"--out {final} exists and is not a directory")
        other = sorted(p.name for p in final.iterdir() if p.name not in OUTPUT_FILES)
        if other:
            raise FileExistsError(
                f"--out {final} holds files a build does not write ({', '.join(other[:5])}); "
                "refusing to replace it"
            )


def _publish(staging: Path, final: Path) -> None:
    """Swap the finished build in, so readers never see a half-written model."""
    os.chmod(staging, 0o755)
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)


def build(
    out: Path,
    *,
    seed: int = DEFAULT_SEED,
    steps: int = DEFAULT_STEPS,
    minutes: float = DEFAULT_MINUTES,
    tiny: bool = False,
    threads: int = 2,
    command: str | None = None,
    log=print,
    spec: Spec | None = None,
) -> dict:
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM

    if spec is None:
        spec = TINY if tiny else FULL
    # Everything is written to a staging dir next to `out` and swapped in at
    # the end: a failed or interrupted build leaves an existing `out` intact.
    final = Path(out)
    _check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.building-"))
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    prev_det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    published = False
    try:
        t_start = time.time()
        # ---- corpus
        root = stdlib_root()
        files = list_corpus_files(root)
        if spec.max_files is not None:
            files = files[: spec.max_files]
        train_files, held_files = split_files(files)
        train_texts = [read_text(f) for f in train_files]
        held_texts = [read_text(f) for f in held_files]

        # ---- tokenizer
        tok = train_tokenizer(train_texts, spec.vocab_size)
        hf_tok = wrap_tokenizer(tok, spec.max_position_embeddings)
        train_ids = torch.tensor(encode_stream(tok, train_texts), dtype=torch.long)
        held_ids = encode_stream(tok, held_texts)
        t_data = time.time() - t_start
        log(
            f"corpus: {len(train_files)} train / {len(held_files)} held-out files, "
            f"{train_ids.numel()} train tokens, {len(held_ids)} held-out tokens ({t_data:.1f}s)"
        )

        # ---- model
        torch.manual_seed(seed)
        config = make_config(spec)
        model = LlamaForCausalLM(config)
        model.to(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model: {n_params} parameters")

        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": spec.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=spec.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            foreach=False,
        )

        # ---- deterministic data order: non-overlapping windows, seeded shuffle
        L = spec.seq_len
        n_windows = (train_ids.numel() - 1) // L
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(n_windows, generator=gen)
        cursor = 0
        epoch = 0

        model.train()
        losses: list[float] = []
        deadline = time.time() + minutes * 60.0
        t_train0 = time.time()
        done = 0
        stopped_early = False
        for step in range(steps):
            if time.time() > deadline:
                stopped_early = True
                log(
                    f"WARNING: wall-clock budget ({minutes} min) exhausted after {step} steps; "
                    f"result is not the reproducible {steps}-step artifact"
                )
                break
            if cursor + spec.batch_size > n_windows:
                epoch += 1
                order = torch.randperm(n_windows, generator=gen)
                cursor = 0
            idx = order[cursor : cursor + spec.batch_size]
            cursor += spec.batch_size
            x = torch.stack([train_ids[i * L : i * L + L + 1] for i in idx.tolist()])
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, spec)
            logits = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            opt.step()
            losses.append(loss.item())
            done = step + 1
            if step % 20 == 0 or step == steps - 1:
                log(
                    f"step {step:4d}  loss {losses[-1]:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                    f"{time.time() - t_train0:.0f}s"
                )
        train_seconds = time.time() - t_train0

        # ---- fp32 master-weight perplexity (before bf16 rounding)
        ppl_master, _ = heldout_perplexity(model, held_ids, L, spec.eval_windows)

        # ---- save in bfloat16
        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            do_sample=False,
        )
        model.to(torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True)
        hf_tok.save_pretrained(out)
        _portable_tokenizer_config(out)

        # ---- evaluate the saved checkpoint (bf16 weights upcast to float32)
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        ppl, eval_tokens = heldout_perplexity(reloaded, held_ids, L, spec.eval_windows)
        eval_bytes = len(
            tok.decode(held_ids[1 : eval_tokens + 1], skip_special_tokens=True).encode()
        )
        samples = greedy_samples(reloaded, hf_tok, SAMPLE_PROMPTS, spec.sample_new_tokens)
        for s in samples:
            log(f"sample {s['prompt']!r} -> {s['completion']!r}")

        weights = out / "model.safetensors"
        report = {
            "command": command or "(called as a function)",
            "seed": seed,
            "tiny": tiny,
            "threads": threads,
            "parameters": n_params,
            "bytes_on_disk": dir_bytes(out),
            "model_safetensors_bytes": weights.stat().st_size,
            "model_safetensors_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
            "tokenizer_json_sha256": hashlib.sha256(
                (out / "tokenizer.json").read_bytes()
            ).hexdigest(),
            "dtype_on_disk": "bfloat16",
            "training_steps": done,
            "planned_steps": steps,
            "stopped_early": stopped_early,
            "training_seconds": round(train_seconds, 2),
            "training_tokens": done * spec.batch_size * L,
            "epochs_started": epoch + 1,
            "minutes_budget": minutes,
            "final_loss_mean_last10": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
            "loss_first": round(losses[0], 4) if losses else None,
            "heldout_perplexity": round(ppl, 4),
            "heldout_perplexity_fp32_master_weights": round(ppl_master, 4),
            "heldout_bits_per_byte": round(math.log2(ppl) * eval_tokens / eval_bytes, 4),
            "heldout_eval": {
                "dtype": "float32",
                "tokens": eval_tokens,
                "windows": min(spec.eval_windows, (len(held_ids) - 1) // L),
                "seq_len": L,
                "method": "first N non-overlapping (seq_len+1)-token windows of the "
                "concatenated <s> doc </s> stream of held-out files",
            },
            "corpus": {
                "stdlib": str(root),
                "files_total": len(files),
                "train_files": len(train_files),
                "heldout_files": len(held_files),
                "heldout_rule": f"index % {HELDOUT_EVERY} == 0 in the sorted file list",
                "skip_dirs": sorted(SKIP_DIRS),
                "skip_files_starting_with": GENERATED_HEADER.decode(),
                "train_tokens": int(train_ids.numel()),
                "heldout_tokens": len(held_ids),
                "sha256": corpus_digest(root, files),
            },
            "spec": asdict(spec),
            "samples_greedy": samples,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "tokenizers": tokenizers.__version__,
                "machine": platform.machine(),
            },
            "total_build_seconds": round(time.time() - t_start, 2),
        }
        (out / "build_report.json").write_text(json.dumps(report, indent=2) + "\n")
        _publish(out, final)
        published = True
        return report
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)
        if not published:
            shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvguard.serve.default_model.build",
        description="Build kvguard's embedded default model (offline, deterministic).",
    )
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help="wall-clock safety budget for training (default %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps (default {DEFAULT_STEPS}; 3 with --tiny); "
        "the step count, not time, defines the artifact",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--tiny", action="store_true", help="test-only tiny configuration")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.tiny else DEFAULT_STEPS)
    argv_used = sys.argv[1:] if argv is None else argv
    command = "python -m kvguard.serve.default_model.build " + shlex.join(argv_used)
    report = build(
        args.out,
        seed=args.seed,
        steps=steps,
        minutes=args.minutes,
        tiny=args.tiny,
        threads=args.threads,
        command=command,
    )
    summary = {
        k: report[k]
        for k in (
            "parameters",
            "bytes_on_disk",
            "training_steps",
            "training_seconds",
            "heldout_perplexity",
        )
    }
    print(json.dumps(summary))
    return 1 if report["stopped_early"] else 0


if __name__ == "__main__":
    sys.exit(main())

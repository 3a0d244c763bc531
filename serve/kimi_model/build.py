"""Build kvguard's tiny Kimi-K2-architecture model, offline and deterministically.

Usage::

    python -m kvguard.serve.kimi_model.build --out DIR [--steps N] [--minutes M] [--seed S]

Kimi K2 is the DeepSeek-V3 text architecture: MLA attention (queries through a low-rank
``q_lora_rank`` bottleneck; keys and values through one compressed latent per token,
``kv_lora_rank`` + a shared ``qk_rope_head_dim`` rotary part, which is what the KV cache stores)
and a mixture of experts (sigmoid router with an aux-loss-free ``e_score_correction_bias``, routed
top-k plus one shared expert, the first layer dense). This builder makes the same architecture at
toy size, with the field names and kinds of values a real Kimi K2 ``config.json`` carries
(``DeepseekV3ForCausalLM``, YaRN rope scaling with its ``beta_fast``/``beta_slow``/``mscale``/
``mscale_all_dim``, ``topk_method: noaux_tc``, ``n_group``/``topk_group``,
``routed_scaling_factor``, ...), so that SGLang runs the code paths it runs for the real model.

What it does (nothing is downloaded; nothing loads from a model hub), reusing the default model's
recipe (``kvguard.serve.default_model.build``) wherever the architecture does not matter:

1. Corpus and tokenizer: exactly the default model's (the Python standard library source, every
   50th file held out; byte-level BPE, vocab 4096, ``<s>``=0, ``</s>``=1, ``<pad>``=2).
2. Model: ``DeepseekV3ForCausalLM`` from transformers, hidden 128, 4 layers (layer 0 dense, 1-3
   MoE), 4 heads, q_lora_rank 64, kv_lora_rank 64, qk_rope_head_dim 16, qk_nope_head_dim 32,
   v_head_dim 32, 8 routed experts (top-2, moe_intermediate_size 64) + 1 shared expert; untied
   embeddings (as in Kimi K2); ~2.1M parameters. Trained from a fixed seed with AdamW (the default
   model's schedule) on seeded non-overlapping 256-token windows. The router bias is updated the
   aux-loss-free way DeepSeek-V3 does it (after each step, ``bias += speed * sign(mean load -
   expert load)``), so ``e_score_correction_bias`` holds real, non-zero values.
3. Output: bfloat16 ``model.safetensors`` (``e_score_correction_bias`` float32, as transformers
   keeps it), a ``config.json`` written in the real checkpoint's form (``rope_scaling`` and
   ``rope_theta`` keys, sorted), tokenizer files, ``build_report.json``.

Reproducibility: as for the default model, the step count (``--steps``, default DEFAULT_STEPS)
defines the artifact, ``--minutes`` is only a safety budget (training stopped by it exits 1 and is
not the artifact), and with the same stdlib, torch build, CPU type and thread count the weights
are bit-for-bit identical. Output is staged and swapped in at the end.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvguard.serve.corpus import (
    HELDOUT_EVERY,
    corpus_digest,
    list_corpus_files,
    read_text,
    split_files,
    stdlib_root,
)
from kvguard.serve.default_model import build as base

DEFAULT_STEPS = 800
DEFAULT_SEED = 1234
DEFAULT_MINUTES = 10.0
# DeepSeek-V3's bias update speed for aux-loss-free load balancing (its paper's gamma).
BIAS_UPDATE_SPEED = 1e-3
SAMPLE_PROMPTS = base.SAMPLE_PROMPTS


@dataclass(frozen=True)
class Spec:
    vocab_size: int = 4096
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
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_files: int | None = None  # None: the whole stdlib corpus
    eval_windows: int = 64
    sample_new_tokens: int = 48

    @property
    def max_position_embeddings(self) -> int:
        return int(self.yarn_factor * self.original_max_position_embeddings)


FULL = Spec()
# Test-only configuration: builds in seconds (same architecture, smaller everything).
TINY = Spec(
    vocab_size=512,
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
    seq_len=64,
    batch_size=4,
    warmup_steps=1,
    max_files=60,
    eval_windows=4,
    sample_new_tokens=8,
)


def checkpoint_config(spec: Spec) -> dict:
    """``config.json`` as a Kimi K2 checkpoint writes it (its field names, its kinds of values)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": base.BOS_ID,
        "eos_token_id": base.EOS_ID,
        "pad_token_id": base.PAD_ID,
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


class RouterBalancer:
    """DeepSeek-V3's aux-loss-free balancing: count each router's expert choices over a step,
    then move every expert's selection bias towards the mean load by a fixed speed."""

    def __init__(self, model, speed: float):
        self.speed = speed
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts = [None] * len(self.routers)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._counter(i))

    def _counter(self, i: int):
        def hook(module, inputs, output):
            _logits, _weights, indices = output
            counts = indices.reshape(-1).bincount(minlength=module.num_experts).float()
            self.counts[i] = counts if self.counts[i] is None else self.counts[i] + counts

        return hook

    def step(self) -> None:
        import torch

        with torch.no_grad():
            for router, counts in zip(self.routers, self.counts):
                if counts is not None:
                    router.e_score_correction_bias += self.speed * torch.sign(
                        counts.mean() - counts
                    )
        self.counts = [None] * len(self.routers)

    def max_abs_bias(self) -> float:
        return max(float(r.e_score_correction_bias.abs().max()) for r in self.routers)


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
    from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    if spec is None:
        spec = TINY if tiny else FULL
    final = Path(out)
    base._check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.building-"))
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    prev_det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    published = False
    try:
        t_start = time.time()
        # ---- corpus and tokenizer: the default model's
        root = stdlib_root()
        files = list_corpus_files(root)
        if spec.max_files is not None:
            files = files[: spec.max_files]
        train_files, held_files = split_files(files)
        train_texts = [read_text(f) for f in train_files]
        held_texts = [read_text(f) for f in held_files]
        tok = base.train_tokenizer(train_texts, spec.vocab_size)
        hf_tok = base.wrap_tokenizer(tok, spec.max_position_embeddings)
        train_ids = torch.tensor(base.encode_stream(tok, train_texts), dtype=torch.long)
        held_ids = base.encode_stream(tok, held_texts)
        log(
            f"corpus: {len(train_files)} train / {len(held_files)} held-out files, "
            f"{train_ids.numel()} train tokens, {len(held_ids)} held-out tokens "
            f"({time.time() - t_start:.1f}s)"
        )

        # ---- model
        torch.manual_seed(seed)
        cfg_json = checkpoint_config(spec)
        config = DeepseekV3Config.from_dict(copy.deepcopy(cfg_json))  # it edits rope_scaling
        model = DeepseekV3ForCausalLM(config)
        model.to(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model: {n_params} parameters")
        balancer = RouterBalancer(model, BIAS_UPDATE_SPEED)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
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

        # ---- training: the default model's data order and schedule
        L = spec.seq_len
        n_windows = (train_ids.numel() - 1) // L
        gen = torch.Generator().manual_seed(seed)
        order = torch.randperm(n_windows, generator=gen)
        cursor = epoch = done = 0
        losses: list[float] = []
        stopped_early = False
        deadline = time.time() + minutes * 60.0
        t_train0 = time.time()
        model.train()
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
                g["lr"] = base.lr_at(step, steps, spec)
            logits = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            opt.step()
            balancer.step()
            losses.append(loss.item())
            done = step + 1
            if step % 20 == 0 or step == steps - 1:
                log(
                    f"step {step:4d}  loss {losses[-1]:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                    f"max|bias| {balancer.max_abs_bias():.3f}  {time.time() - t_train0:.0f}s"
                )
        train_seconds = time.time() - t_train0
        ppl_master, _ = base.heldout_perplexity(model, held_ids, L, spec.eval_windows)

        # ---- save in bfloat16, config.json in the real checkpoint's form
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=base.BOS_ID,
            eos_token_id=base.EOS_ID,
            pad_token_id=base.PAD_ID,
            do_sample=False,
        )
        model.to(torch.bfloat16)
        for router in balancer.routers:  # kept in float32, as DeepSeek-V3 checkpoints store it
            router.e_score_correction_bias.data = router.e_score_correction_bias.float()
        model.save_pretrained(out, safe_serialization=True)
        (out / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
        hf_tok.save_pretrained(out)
        base._portable_tokenizer_config(out)

        # ---- evaluate the saved checkpoint (bf16 weights upcast to float32)
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        ppl, eval_tokens = base.heldout_perplexity(reloaded, held_ids, L, spec.eval_windows)
        eval_bytes = len(
            tok.decode(held_ids[1 : eval_tokens + 1], skip_special_tokens=True).encode()
        )
        samples = base.greedy_samples(reloaded, hf_tok, SAMPLE_PROMPTS, spec.sample_new_tokens)
        for s in samples:
            log(f"sample {s['prompt']!r} -> {s['completion']!r}")
        weights = out / "model.safetensors"
        report = {
            "command": command or "(called as a function)",
            "seed": seed,
            "tiny": tiny,
            "threads": threads,
            "parameters": n_params,
            "bytes_on_disk": base.dir_bytes(out),
            "model_safetensors_bytes": weights.stat().st_size,
            "model_safetensors_sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
            "tokenizer_json_sha256": hashlib.sha256(
                (out / "tokenizer.json").read_bytes()
            ).hexdigest(),
            "dtype_on_disk": "bfloat16 (e_score_correction_bias float32)",
            "kv_cache_values_per_token_and_layer": spec.kv_lora_rank + spec.qk_rope_head_dim,
            "training_steps": done,
            "planned_steps": steps,
            "stopped_early": stopped_early,
            "training_seconds": round(train_seconds, 2),
            "training_tokens": done * spec.batch_size * L,
            "epochs_started": epoch + 1,
            "minutes_budget": minutes,
            "router_bias_update_speed": BIAS_UPDATE_SPEED,
            "router_bias_max_abs": round(balancer.max_abs_bias(), 4),
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
                "train_tokens": int(train_ids.numel()),
                "heldout_tokens": len(held_ids),
                "sha256": corpus_digest(root, files),
            },
            "spec": {**asdict(spec), "max_position_embeddings": spec.max_position_embeddings},
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
        base._publish(out, final)
        published = True
        return report
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)
        if not published:
            shutil.rmtree(out, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvguard.serve.kimi_model.build",
        description="Build kvguard's tiny Kimi-K2-architecture model (offline, deterministic).",
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
    report = build(
        args.out,
        seed=args.seed,
        steps=steps,
        minutes=args.minutes,
        tiny=args.tiny,
        threads=args.threads,
        command="python -m kvguard.serve.kimi_model.build " + shlex.join(argv_used),
    )
    keys = ("parameters", "bytes_on_disk", "training_steps", "training_seconds")
    print(json.dumps({k: report[k] for k in keys + ("heldout_perplexity",)}))
    return 1 if report["stopped_early"] else 0


if __name__ == "__main__":
    sys.exit(main())

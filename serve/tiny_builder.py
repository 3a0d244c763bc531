"""One builder for kvguard's tiny embedded models, offline and deterministic.

Each family (``serve/<name>/build.py``) is a small description, a :class:`Family`: its spec (the
architecture, on top of the shared :class:`Recipe`), how to make its model and ``config.json``,
and optional :class:`TrainHook` s (Kimi's router-bias update, GLM's indexer distillation).
Everything else is here, the same for every family (nothing is downloaded; nothing loads from a
model hub):

1. Corpus: ``kvguard.serve.corpus``, the running interpreter's standard library source, sorted,
   every 50th file held out for evaluation.
2. Tokenizer: byte-level BPE trained here with ``tokenizers`` (vocab from the spec, specials
   ``<s>``=0, ``</s>``=1, ``<pad>``=2), saved as a Hugging Face fast tokenizer; encoding prepends
   ``<s>``; any UTF-8 text round-trips.
3. Training: from a fixed seed, AdamW (betas 0.9/0.95, weight decay on matrices only), linear
   warmup then cosine to ``min_lr_ratio``, gradient clipping, on non-overlapping ``seq_len``-token
   windows in a seeded order.
4. Output: ``save_pretrained`` in bfloat16, tokenizer files and ``build_report.json``, written to
   a staging directory and swapped in at the end, so an existing ``--out`` stays intact until a
   build finishes.

Reproducibility: a build is defined by its *step count* (``--steps``), not by wall-clock time.
``--minutes`` is only a safety budget on the training loop: if it runs out first, training stops
early, the report says ``"stopped_early": true``, the exit status is 1 and the result is NOT the
reproducible artifact. Given the same Python stdlib (the corpus), torch build, CPU type and thread
count (``--threads``, default 2), the weights are bit-for-bit identical.
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    import torch

# Keep the Rust side of `tokenizers` modest on a shared 2-core machine.
os.environ.setdefault("RAYON_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
BOS, EOS, PAD = SPECIAL_TOKENS
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
DEFAULT_SEED = 1234
SAMPLE_PROMPTS = ("def __init__(self", "import ", "class ")


@dataclass(frozen=True)
class Recipe:
    """The training recipe every family shares; a family's spec adds its architecture fields and
    a ``max_position_embeddings`` (a field or a property)."""

    vocab_size: int = 4096
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


# The recipe of every family's test-only TINY spec: builds in seconds.
TINY_RECIPE: dict[str, Any] = dict(
    vocab_size=512,
    seq_len=64,
    batch_size=4,
    warmup_steps=1,
    max_files=60,
    eval_windows=4,
    sample_new_tokens=8,
)


class TrainHook:
    """A family's additions to the shared training loop; this base adds nothing."""

    def extra_loss(self) -> torch.Tensor | None:
        """Called after each training forward: a term added to the language-model loss."""
        return None

    def after_step(self) -> None:
        """Called after each optimizer step."""

    def status(self) -> str:
        """Appended to the step log line."""
        return ""

    def report(self, model: Any, held: torch.Tensor) -> dict[str, Any]:
        """Figures for build_report.json, after training (fp32 weights; ``held``: the first
        held-out evaluation windows, ``[n, seq_len + 1]`` token ids)."""
        return {}

    def before_save(self, model: Any) -> None:
        """Called after the model is cast to bfloat16, before it is saved."""


class RouterBalancer(TrainHook):
    """DeepSeek-V3's aux-loss-free balancing of a sigmoid ``noaux_tc`` router (every module with an
    ``e_score_correction_bias``): count each router's expert choices over a step, then move every
    expert's selection bias towards the mean load by a fixed speed. The bias is saved in float32,
    as DeepSeek-V3 checkpoints store it."""

    def __init__(self, model: Any, speed: float):
        self.speed = speed
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.counts: list[Any] = [None] * len(self.routers)
        for i, router in enumerate(self.routers):
            router.register_forward_hook(self._counter(i))

    def _counter(self, i: int) -> Callable[..., None]:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            _logits, _weights, indices = output
            counts = indices.reshape(-1).bincount(minlength=module.num_experts).float()
            self.counts[i] = counts if self.counts[i] is None else self.counts[i] + counts

        return hook

    def after_step(self) -> None:
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

    def status(self) -> str:
        return f"max|bias| {self.max_abs_bias():.3f}"

    def report(self, model: Any, held: torch.Tensor) -> dict[str, Any]:
        return {
            "router_bias_update_speed": self.speed,
            "router_bias_max_abs": round(self.max_abs_bias(), 4),
        }

    def before_save(self, model: Any) -> None:
        for router in self.routers:
            router.e_score_correction_bias.data = router.e_score_correction_bias.float()


@dataclass(frozen=True)
class Family:
    """What one model family's ``build.py`` describes; the builder does the rest."""

    name: str  # the package under kvguard.serve: "default_model", "kimi_model", ...
    title: str  # for --help: "kvguard's embedded default model"
    full: Any  # a Recipe subclass: the committed artifact's spec
    tiny: Any  # the same architecture at test size (TINY_RECIPE)
    default_steps: int
    default_minutes: float
    # spec -> (the model, freshly initialized; its config.json, or None for save_pretrained's)
    make_model: Callable[[Any], tuple[Any, dict[str, Any] | None]]
    make_hooks: Callable[[Any, Any], list[TrainHook]] = lambda model, spec: []
    dtype_on_disk: str = "bfloat16"
    report_extra: Callable[[Any], dict[str, Any]] = lambda spec: {}

    @property
    def module(self) -> str:
        return f"kvguard.serve.{self.name}.build"


# --------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
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


def wrap_tokenizer(tok: Any, model_max_length: int) -> Any:
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
    """transformers 5 writes ``tokenizer_class: TokenizersBackend``, which 4.x does not know;
    ``PreTrainedTokenizerFast`` loads the same tokenizer.json in both (in 5.x it is an alias of
    ``TokenizersBackend``). Adds the chat template."""
    p = out / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg["chat_template"] = CHAT_TEMPLATE
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def encode_stream(tok: Any, texts: list[str]) -> list[int]:
    """Concatenate ``<s> text </s>`` for each document."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(BOS_ID)
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return ids


# --------------------------------------------------------------------------- training and eval
def lr_at(step: int, total: int, spec: Recipe) -> float:
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, total - spec.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cos)


def heldout_windows(ids: Sequence[int], seq_len: int, windows: int) -> torch.Tensor:
    """The first ``windows`` non-overlapping (seq_len+1)-token windows of a held-out stream."""
    import torch

    t = torch.as_tensor(ids, dtype=torch.long)
    n = min(windows, (t.numel() - 1) // seq_len)
    if n <= 0:
        raise ValueError("held-out stream too short")
    return torch.stack([t[j * seq_len : j * seq_len + seq_len + 1] for j in range(n)])


def heldout_perplexity(
    model: Any, ids: Sequence[int], seq_len: int, windows: int
) -> tuple[float, int]:
    """exp(mean NLL) in float32 over the first ``windows`` non-overlapping (seq_len+1)-token
    windows of the held-out stream."""
    import torch

    rows = heldout_windows(ids, seq_len, windows)
    total_nll, total_tok = 0.0, 0
    model.eval()
    with torch.no_grad():
        for x in rows.split(8):
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
            )
            total_nll += float(nll)
            total_tok += x[:, 1:].numel()
    return math.exp(total_nll / total_tok), total_tok


def greedy_samples(
    model: Any, hf_tok: Any, prompts: Sequence[str], max_new_tokens: int
) -> list[dict[str, str]]:
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


def train(
    model: Any,
    train_ids: torch.Tensor,
    spec: Recipe,
    hooks: list[TrainHook],
    *,
    seed: int,
    steps: int,
    minutes: float,
    log: Callable[..., Any],
) -> dict[str, Any]:
    """The shared loop: seeded window order, AdamW, warmup + cosine, clipping, the hooks."""
    import torch

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
    # Deterministic data order: non-overlapping windows, seeded shuffle, reshuffled per epoch.
    L = spec.seq_len
    n_windows = (train_ids.numel() - 1) // L
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_windows, generator=gen)
    cursor = epoch = done = 0
    losses: list[float] = []
    stopped_early = False
    deadline = time.time() + minutes * 60.0
    t0 = time.time()
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
            g["lr"] = lr_at(step, steps, spec)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
        )
        total = loss
        for hook in hooks:
            extra = hook.extra_loss()
            if extra is not None:
                total = total + extra
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        for hook in hooks:
            hook.after_step()
        losses.append(loss.item())
        done = step + 1
        if step % 20 == 0 or step == steps - 1:
            extra_status = "".join(f"  {s}" for s in (h.status() for h in hooks) if s)
            log(
                f"step {step:4d}  loss {losses[-1]:.4f}  lr {opt.param_groups[0]['lr']:.2e}"
                f"{extra_status}  {time.time() - t0:.0f}s"
            )
    return {
        "training_steps": done,
        "planned_steps": steps,
        "stopped_early": stopped_early,
        "training_seconds": round(time.time() - t0, 2),
        "training_tokens": done * spec.batch_size * L,
        "epochs_started": epoch + 1,
        "minutes_budget": minutes,
        "final_loss_mean_last10": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
        "loss_first": round(losses[0], 4) if losses else None,
    }


# ---------------------------------------------------------------------------------- output dir
def dir_bytes(d: Path, exclude: Sequence[str] = ("build_report.json",)) -> int:
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


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------- build
def build(
    family: Family,
    out: Path,
    *,
    seed: int = DEFAULT_SEED,
    steps: int | None = None,
    minutes: float | None = None,
    tiny: bool = False,
    threads: int = 2,
    command: str | None = None,
    log: Callable[..., Any] = print,
    spec: Any = None,
) -> dict[str, Any]:
    """Build ``family`` into ``out``; returns (and writes) the build report."""
    import tokenizers
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = spec if spec is not None else (family.tiny if tiny else family.full)
    steps = family.default_steps if steps is None else steps
    minutes = family.default_minutes if minutes is None else minutes
    # Everything is written to a staging dir next to `out` and swapped in at the end: a failed
    # or interrupted build leaves an existing `out` intact.
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
        root = stdlib_root()
        files = list_corpus_files(root)
        if spec.max_files is not None:
            files = files[: spec.max_files]
        train_files, held_files = split_files(files)
        train_texts = [read_text(f) for f in train_files]
        held_texts = [read_text(f) for f in held_files]
        tok = train_tokenizer(train_texts, spec.vocab_size)
        hf_tok = wrap_tokenizer(tok, spec.max_position_embeddings)
        train_ids = torch.tensor(encode_stream(tok, train_texts), dtype=torch.long)
        held_ids = encode_stream(tok, held_texts)
        log(
            f"corpus: {len(train_files)} train / {len(held_files)} held-out files, "
            f"{train_ids.numel()} train tokens, {len(held_ids)} held-out tokens "
            f"({time.time() - t_start:.1f}s)"
        )

        torch.manual_seed(seed)
        model, cfg_json = family.make_model(spec)
        model.to(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"model: {n_params} parameters")
        hooks = family.make_hooks(model, spec)
        L = spec.seq_len
        trained = train(
            model, train_ids, spec, hooks, seed=seed, steps=steps, minutes=minutes, log=log
        )
        # figures on the fp32 master weights (before bf16 rounding)
        held = heldout_windows(held_ids, L, spec.eval_windows)
        hook_figures: dict[str, Any] = {}
        for hook in hooks:
            hook_figures.update(hook.report(model, held))
        ppl_master, _ = heldout_perplexity(model, held_ids, L, spec.eval_windows)

        model.generation_config = GenerationConfig(
            bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
        )
        model.to(torch.bfloat16)
        for hook in hooks:
            hook.before_save(model)
        model.save_pretrained(out, safe_serialization=True)
        if cfg_json is not None:  # the family's config.json, in the released checkpoints' form
            (out / "config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")
        hf_tok.save_pretrained(out)
        _portable_tokenizer_config(out)

        # evaluate the saved checkpoint (bf16 weights upcast to float32)
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
            "family": family.name,
            "seed": seed,
            "tiny": tiny,
            "threads": threads,
            "parameters": n_params,
            "bytes_on_disk": dir_bytes(out),
            "model_safetensors_bytes": weights.stat().st_size,
            "model_safetensors_sha256": _sha256(weights),
            "tokenizer_json_sha256": _sha256(out / "tokenizer.json"),
            "dtype_on_disk": family.dtype_on_disk,
            **family.report_extra(spec),
            **trained,
            **hook_figures,
            "heldout_perplexity": round(ppl, 4),
            "heldout_perplexity_fp32_master_weights": round(ppl_master, 4),
            "heldout_bits_per_byte": round(math.log2(ppl) * eval_tokens / eval_bytes, 4),
            "heldout_eval": {
                "dtype": "float32",
                "tokens": eval_tokens,
                "windows": held.shape[0],
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
        _publish(out, final)
        published = True
        return report
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)
        if not published:
            shutil.rmtree(out, ignore_errors=True)


def main(family: Family, argv: list[str] | None = None) -> int:
    """The command line every family's ``build.py`` runs."""
    ap = argparse.ArgumentParser(
        prog=f"python -m {family.module}",
        description=f"Build {family.title} (offline, deterministic).",
    )
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument(
        "--minutes",
        type=float,
        default=family.default_minutes,
        help="wall-clock safety budget for training (default %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps (default {family.default_steps}; 3 with --tiny); "
        "the step count, not time, defines the artifact",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--tiny", action="store_true", help="test-only tiny configuration")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (3 if args.tiny else family.default_steps)
    argv_used = sys.argv[1:] if argv is None else argv
    report = build(
        family,
        args.out,
        seed=args.seed,
        steps=steps,
        minutes=args.minutes,
        tiny=args.tiny,
        threads=args.threads,
        command=f"python -m {family.module} " + shlex.join(argv_used),
    )
    keys = ("parameters", "bytes_on_disk", "training_steps", "training_seconds")
    print(json.dumps({k: report[k] for k in keys + ("heldout_perplexity",)}))
    return 1 if report["stopped_early"] else 0

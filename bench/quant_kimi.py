"""Quantization measurements for the Kimi K2 architecture (MLA + MoE) on CPU: FP8 MLA KV cache
and INT4 W4A16 experts (compressed-tensors, Kimi K2 Thinking's format), against BF16.

Usage::

    python -m kvguard.bench.quant_kimi [--model DIR] [--eval-windows 32] [--out FILE]

What is measured (each serving configuration in its own SGLang engine, torch_native attention,
the helpers of ``kvguard.bench.quant``):

* KV pool tokens at a fixed memory budget: SGLang's own ``MLATokenToKVPool`` built for the
  model's shapes in BF16 and in FP8 (what kvguard serves on CPU); bytes per token read off the
  allocated buffers, and a pool of the budget's size allocated to confirm it fits.
* Weight bytes on disk: the routed experts (what ``--targets experts`` quantizes), every MLP
  linear (``--targets mlp``), and the whole checkpoint, BF16 vs INT4.
* Held-out perplexity: SGLang prompt logprobs over windows of the held-out stdlib files (the
  models' shared held-out split); the BF16 figure cross-checked with transformers in float32.
* Agreement with BF16: next-token top-1 under teacher forcing on the same windows, and the
  per-position match rate of greedy continuations.
* FP8 MLA KV with the guard in paranoid mode: requests aborted (a violation aborts its request).
* Decode tokens/s: one stream and 8 concurrent requests, best of repeats (``decode_speed``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kvguard.bench.quant import (
    agreement,
    decode_speed,
    engine,
    greedy,
    heldout_windows,
    hf_perplexity,
    prompts,
    sglang_perplexity,
    write_kv_scales,
)


def mla_pool_tokens(model_dir: Path, budget_bytes: int) -> dict:
    """Token slots of SGLang's BF16 and FP8 MLA pools within ``budget_bytes``."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    cfg = json.loads((model_dir / "config.json").read_text())
    page = 16

    def pool(dtype, size):
        return MLATokenToKVPool(
            size=size,
            page_size=page,
            dtype=dtype,
            kv_lora_rank=cfg["kv_lora_rank"],
            qk_rope_head_dim=cfg["qk_rope_head_dim"],
            layer_num=cfg["num_hidden_layers"],
            device="cpu",
            enable_memory_saver=False,
        )

    def nbytes(p):
        return sum(b.numel() * b.element_size() for b in p.kv_buffer)

    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        per_slot = nbytes(pool(dtype, page)) // (2 * page)  # the pool holds size + page_size slots
        tokens = (budget_bytes // per_slot - page) // page * page
        full = pool(dtype, tokens)
        assert nbytes(full) <= budget_bytes, (name, nbytes(full), budget_bytes)
        out[name] = {
            "bytes_per_token": per_slot,
            "tokens": tokens,
            "storage": str(full.kv_buffer[0].dtype).replace("torch.", ""),
        }
        del full
    return out


def weight_bytes(model_dir: Path) -> dict[str, int]:
    """On-disk bytes: routed experts, every MLP linear, every tensor."""
    from safetensors import safe_open

    out = {"experts": 0, "mlp": 0, "all": 0}
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors file handle, not a dict)
            t = f.get_tensor(key)
            n = t.numel() * t.element_size()
            out["all"] += n
            proj = any(f"{p}_proj." in key for p in ("gate", "up", "down"))
            if proj and ".mlp." in key:
                out["mlp"] += n
                out["experts"] += n if ".mlp.experts." in key else 0
    return out


def mla_kv_scales_file(model_dir: Path, windows: list[list[int]], out: Path) -> dict[int, float]:
    """Per-layer FP8 scale of the MLA latent row, max |value| / 448 over calibration windows:
    the kv_a_layernorm output and (an upper bound for the rotated) rope part, the largest norm
    of a rotated pair. SGLang's ``--quantization-param-path`` format."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = model.config
    amax: dict[int, float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def latent_hook(_m, _inp, out, i=i):
            amax[i] = max(amax.get(i, 0.0), float(out.abs().max()))

        def rope_hook(_m, _inp, out, i=i):
            rope = out[..., cfg.kv_lora_rank :].float()
            pair = rope.view(*rope.shape[:-1], -1, 2).norm(dim=-1)  # rotation keeps pair norms
            amax[i] = max(amax.get(i, 0.0), float(pair.max()))

        hooks += [
            attn.kv_a_layernorm.register_forward_hook(latent_hook),
            attn.kv_a_proj_with_mqa.register_forward_hook(rope_hook),
        ]
    return write_kv_scales(model, windows, hooks, amax, out)


def measure(a, work: Path) -> str:
    import torch

    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the engines' scheduler processes inherit it
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault(
        "SGLANG_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kvguard-sglang-cache")
    )
    from kvguard.quant.quantize import calibration_batches, quantize_checkpoint

    if a.model is None:
        from kvguard.serve.kimi_model import ensure_kimi_model

        a.model = ensure_kimi_model()
    model = Path(a.model)
    log = lambda *m: print(*m, file=sys.stderr, flush=True)
    quants = {}
    for targets in ("experts", "mlp"):
        log(f"quantizing {model} (--targets {targets}) ...")
        quants[targets] = quantize_checkpoint(
            model, work / targets, a.group_size, targets=targets, log=lambda *m: None
        )
    windows = heldout_windows(model, a.eval_windows, a.seq_len)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    gen_prompts = prompts(windows, a.gen_prompts, a.prompt_len)
    kv = mla_pool_tokens(model, a.budget_mib << 20)
    wb = {
        name: weight_bytes(path)
        for name, path in (("bf16", model), ("experts", work / "experts"), ("mlp", work / "mlp"))
    }
    log("calibrating FP8 KV scales ...")
    calib = [row.tolist() for b in calibration_batches(model, 16, a.seq_len) for row in b]
    scales = mla_kv_scales_file(model, calib, work / "kv_scales.json")

    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    configs = [  # (name, checkpoint, engine arguments, guard mode)
        ("BF16", model, {}, "off"),
        ("FP8 MLA KV (scale 1.0)", model, fp8, "off"),
        (
            "FP8 MLA KV (calibrated scales)",
            model,
            {**fp8, "quantization_param_path": str(work / "kv_scales.json")},
            "off",
        ),
        ("FP8 MLA KV (scale 1.0), guard paranoid", model, fp8, "paranoid"),
        (f"INT4 experts (g{a.group_size})", work / "experts", {}, "off"),
        (f"INT4 experts + MLP linears (g{a.group_size})", work / "mlp", {}, "off"),
        ("INT4 experts + FP8 MLA KV", work / "experts", fp8, "off"),
    ]
    rows, base = [], None
    for name, path, kw, mode in configs:
        log(f"engine: {name} ...")
        os.environ["KVGUARD_MODE"] = mode  # read by the engine's scheduler process at start
        t = time.time()
        with engine(path, **kw) as e:
            ppl, top1 = sglang_perplexity(e, windows, vocab)
            gen = greedy(e, gen_prompts, a.gen_tokens)  # asserts no request was aborted
            again = greedy(e, gen_prompts, a.gen_tokens)  # prefix-cache re-reads
            single, batched = decode_speed(
                e, [t for w in windows for t in w], a.prompt_len, a.speed_tokens, 8, a.repeats
            )
        base = base or (gen, top1)
        agree, same = agreement(gen, base[0])
        top1_agree = sum(int(x == y) for x, y in zip(top1, base[1])) / len(top1)
        rows.append(
            dict(
                name=name,
                ppl=ppl,
                top1=top1_agree,
                agree=agree,
                same=same,
                stable=gen == again,
                single=single,
                batched=batched,
                guard=mode,
                requests=len(windows) + 2 * len(gen_prompts) + a.repeats * 9,
            )
        )
        log(
            f"  {name}: ppl {ppl:.3f} top1 {top1_agree:.4f} single {single:.1f} tok/s "
            f"({time.time() - t:.0f}s)"
        )
    hf_ppl = hf_perplexity(model, windows)
    return report(a, model, quants, kv, wb, rows, hf_ppl, scales, len(windows))


def report(a, model, quants, kv, wb, rows, hf_ppl, scales, n_windows) -> str:
    import sglang
    import torch

    bf, f8 = kv["bf16"], kv["fp8_e4m3"]
    cfg = json.loads((model / "config.json").read_text())
    cmd = "python -m kvguard.bench.quant_kimi " + " ".join(a.argv)
    b = rows[0]
    lines = [
        "# Kimi K2 architecture (MLA + MoE) on CPU: FP8 MLA KV cache and INT4 experts",
        "",
        f"Generated by `{cmd.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), torch "
        f"{torch.__version__}, SGLang {sglang.__version__}, {a.threads} torch threads; guard off "
        "except where a row says paranoid.",
        f"Model: `{model}` (DeepseekV3ForCausalLM, {cfg['num_hidden_layers']} layers, "
        f"kv_lora_rank {cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']}, "
        f"{cfg['n_routed_experts']} routed experts top-{cfg['num_experts_per_tok']} + "
        f"{cfg['n_shared_experts']} shared). INT4: `python -m kvguard.quant.quantize "
        f"--group-size {a.group_size} --targets experts|mlp` (compressed-tensors pack-quantized "
        "W4A16, symmetric int4, round to nearest; "
        f"{quants['experts']['seconds']} s / {quants['mlp']['seconds']} s).",
        "",
        "## Memory",
        "",
        "| | BF16 | FP8 e4m3 / INT4 | ratio | target |",
        "|---|---:|---:|---:|---|",
        f"| KV bytes per token (all layers, one latent row each) | {bf['bytes_per_token']} "
        f"| {f8['bytes_per_token']} | {bf['bytes_per_token'] / f8['bytes_per_token']:.3f}x smaller | |",
        f"| KV pool tokens in {a.budget_mib} MiB (SGLang's MLATokenToKVPool) | {bf['tokens']} "
        f"| {f8['tokens']} | **{f8['tokens'] / bf['tokens']:.3f}x** | >= 1.99x |",
        f"| Routed expert weight bytes (on disk), `--targets experts` | {wb['bf16']['experts']} "
        f"| {wb['experts']['experts']} | **{wb['experts']['experts'] / wb['bf16']['experts']:.3f}x** | |",
        f"| MLP linear weight bytes (experts, shared, dense), `--targets mlp` (the linears "
        "too narrow for SGLang's GPU W4A16 linear kernel stay BF16) "
        f"| {wb['bf16']['mlp']} "
        f"| {wb['mlp']['mlp']} | {wb['mlp']['mlp'] / wb['bf16']['mlp']:.3f}x | |",
        f"| Whole checkpoint, `--targets experts` / `mlp` | {wb['bf16']['all']} "
        f"| {wb['experts']['all']} / {wb['mlp']['all']} "
        f"| {wb['experts']['all'] / wb['bf16']['all']:.3f}x / {wb['mlp']['all'] / wb['bf16']['all']:.3f}x | |",
        "",
        "## Quality and speed",
        "",
        f"Perplexity: {n_windows} held-out windows of {a.seq_len + 1} tokens, SGLang prompt "
        "logprobs. Next-token top-1: on the same windows (teacher forcing), the fraction of "
        "positions whose most likely next token equals the BF16 engine's. Greedy agreement: "
        f"continuations of {a.gen_prompts} held-out prompts ({a.prompt_len} tokens), "
        f"{a.gen_tokens} new tokens, per-position match rate vs the BF16 engine (identical "
        "sequences in brackets); every configuration ran them twice (the second time through "
        "the prefix cache) with identical results where the table says so. Decode: one stream "
        f"of {a.speed_tokens} tokens and 8 concurrent requests, best of {a.repeats}; engines run "
        f"with OMP_NUM_THREADS={a.threads}; load average when done: "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared 2-core machine: the speeds "
        "are indicative, differences under ~20% are noise).",
        "",
        "| configuration | held-out ppl | vs BF16 | next-token top-1 = BF16 | greedy agreement "
        "| prefix-cache pass identical | decode tok/s (1 stream) | tok/s (8 requests) |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['ppl']:.3f} | {100 * (r['ppl'] / b['ppl'] - 1):+.2f}% "
            f"| {r['top1']:.4f} | {r['agree']:.3f} ({r['same']}/{a.gen_prompts}) "
            f"| {'yes' if r['stable'] else 'no'} | {r['single']:.1f} | {r['batched']:.1f} |"
        )
    paranoid = [r for r in rows if r["guard"] == "paranoid"]
    lines += [
        "",
        f"Cross-check: transformers (float32, same windows) gives BF16-checkpoint perplexity "
        f"{hf_ppl:.3f} (SGLang BF16: {b['ppl']:.3f}).",
        "",
        "Notes:",
        "- FP8 MLA KV: SGLang's own `MLATokenToKVPool` with FP8 storage (1 byte per value; K and "
        "V are the same latent row, so one scale per layer). On read the rows a batch needs are "
        "dequantized once through a 256-entry table (byte -> value x scale). 'calibrated' passes "
        "max |latent value| / 448 per layer (training-split calibration windows; the rope part "
        "bounded by its largest rotated-pair norm) through `--quantization-param-path`: "
        + ", ".join(f"L{i} {s:.4f}" for i, s in scales.items())
        + ".",
    ]
    for r in paranoid:
        lines.append(
            f"- Guard paranoid on the FP8 MLA pool ({r['name']}): {r['requests']} requests served "
            "with every step's reads and writes checked and checksummed; a violation aborts its "
            "request, and none was: every greedy request finished by length and every prompt "
            "logprob came back."
        )
    lines += [
        f"- INT4: compressed-tensors pack-quantized W4A16 (int32 words of 8 codes + one bf16 "
        f"scale per {a.group_size} weights: 0.25 + 1/{a.group_size} of BF16 = "
        f"{0.25 + 1 / a.group_size:.3f}x, plus a 16-byte shape per linear). Kimi K2 Thinking "
        "quantizes the routed experts only (`--targets experts`); attention, shared experts, the "
        "dense layer, router, embeddings and lm_head stay BF16. CPU kernel: torch's INT4 GEMM "
        "(`_weight_int4pack_mm_for_cpu`) per expert inside SGLang's native MoE loop.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvguard.bench.quant_kimi")
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="BF16 DeepseekV3 checkpoint (default: kvguard's Kimi model)",
    )
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--budget-mib", type=int, default=256, help="KV budget for the pool-size row")
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--gen-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=1, help="torch/OpenMP threads (bench process and engines)"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("quant_kimi_results.md"))
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else argv
    work = Path(tempfile.mkdtemp(prefix="kvguard-bench-quant-kimi-"))
    try:
        text = measure(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quantization measurements for the MLA + MoE families on CPU: the FP8 latent KV cache and INT4
W4A16 experts (compressed-tensors, Kimi K2 Thinking's format), apart and served together,
against BF16.

Usage::

    python -m kvguard.bench.quant_mla --family kimi|glm [--model DIR] [--eval-windows 32]
        [--out FILE]

Families (each with kvguard's tiny trained model of that architecture):

* ``kimi``: Kimi K2 (``DeepseekV3ForCausalLM``: MLA + MoE), SGLang's ``MLATokenToKVPool``,
  page 16; FP8 latent rows with one scale per layer (1.0, or calibrated through
  ``--quantization-param-path``).
* ``glm``: GLM-5 (``GlmMoeDsaForCausalLM``: MLA + DeepSeek Sparse Attention + MoE), SGLang's
  ``DSATokenToKVPool``, page 64; FP8 latent rows ``[R fp8 | R/128 fp32 scales | rope bf16]``
  (per-block scales, nothing to calibrate), plus each indexer layer's FP8 index keys (132 bytes
  per token, whatever the latent dtype).

What is measured (each serving configuration in its own SGLang engine, torch_native attention,
the helpers of ``kvguard.bench.quant``):

* KV pool tokens at a fixed memory budget: the family's SGLang pool built for the model's shapes
  in BF16 and in FP8; bytes per token read off the allocated buffers (latent rows and index keys
  apart), and a pool of the budget's size allocated to confirm it fits.
* Weight bytes on disk: the routed experts (what ``--targets experts`` quantizes), every MLP
  linear (``--targets mlp``), and the whole checkpoint, BF16 vs INT4.
* Held-out perplexity: SGLang prompt logprobs over windows of the held-out stdlib files (the
  models' shared held-out split); the BF16 figure cross-checked with transformers in float32.
* Agreement with BF16: next-token top-1 under teacher forcing on the same windows, and the
  per-position match rate of greedy continuations.
* INT4 experts + FP8 KV (the seed's stack) with the guard in its default mode and in paranoid
  mode: requests aborted (a violation aborts its request), and the guard each engine reported.
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
from kvguard.patches.guard_status import scheduler_statuses

FAMILIES = ("kimi", "glm")
PAGE = {"kimi": 16, "glm": 64}  # SGLang's DSA pool asserts 64-token pages
KV_NAME = {"kimi": "MLA", "glm": "DSA"}
POOL_CLASS = {"kimi": "MLATokenToKVPool", "glm": "DSATokenToKVPool"}
# DeepSeek V3.2's latent shape (the production DSA models'), for the per-token ratio at scale
DSA_REFERENCE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
# the pool-token target; DSA's FP8 layout (bf16 rope, FP8 index keys in both pools) fixes its ratio
TARGET = {"kimi": ">= 1.99x", "glm": ""}


def ensure_model(family: str) -> Path:
    if family == "kimi":
        from kvguard.serve.kimi_model import ensure_kimi_model

        return ensure_kimi_model()
    from kvguard.serve.glm_model import ensure_glm_model

    return ensure_glm_model()


# ------------------------------------------------------------------------------------- pools
def build_pool(family: str, cfg: dict, dtype, size: int):
    """SGLang's own pool for ``family`` with ``cfg``'s shapes, ``size`` token slots (the pool
    allocates ``size + page`` of them), on the CPU, as SGLang's KV configurator builds it."""
    import torch
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    shapes = dict(
        size=size,
        page_size=PAGE[family],
        dtype=dtype,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        layer_num=cfg["num_hidden_layers"],
        device="cpu",
        enable_memory_saver=False,
    )
    if family == "kimi":
        return MLATokenToKVPool(**shapes)
    r, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    dim = r + rope  # SGLang's calculate_mla_kv_cache_dim, with no DSA kernel backend chosen
    if dtype == torch.float8_e4m3fn:
        block, rope_dtype = DSATokenToKVPool.quant_block_size, DSATokenToKVPool.rope_storage_dtype
        assert r % block == 0, f"kv_lora_rank {r}: SGLang's FP8 DSA row needs a multiple of {block}"
        dim = r + r // block * 4 + rope * rope_dtype.itemsize
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):  # one process, no DCP
        return DSATokenToKVPool(
            **shapes, kv_cache_dim=dim, index_head_dim=cfg.get("index_head_dim", 128)
        )


def pool_bytes(pool) -> dict[str, int]:
    """Allocated bytes: the latent rows, and (DSA) the index keys and their scales."""
    latent = sum(b.numel() * b.element_size() for b in pool.kv_buffer)
    index = sum(
        b.numel() * b.element_size() for b in getattr(pool, "index_k_with_scale_buffer", [])
    )
    return {"latent": latent, "index": index, "total": latent + index}


def pool_tokens(family: str, cfg: dict, budget_bytes: int) -> dict:
    """Token slots of the family's BF16 and FP8 pools within ``budget_bytes``; bytes per token
    (latent rows, index keys, total) over all layers."""
    import torch

    page = PAGE[family]
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        small = pool_bytes(build_pool(family, cfg, dtype, page))
        per = {k: v // (2 * page) for k, v in small.items()}  # the pool holds size + page slots
        assert all(v % (2 * page) == 0 for v in small.values()), small
        tokens = (budget_bytes // per["total"] - page) // page * page
        full = build_pool(family, cfg, dtype, tokens)
        got = pool_bytes(full)["total"]
        assert got <= budget_bytes, (name, got, budget_bytes)
        out[name] = {
            "bytes_per_token": per["total"],
            "latent_bytes_per_token": per["latent"],
            "index_bytes_per_token": per["index"],
            "tokens": tokens,
            "storage": str(full.kv_buffer[0].dtype).replace("torch.", ""),
        }
        del full
    return out


def reference_bytes_per_token() -> dict[str, dict[str, int]]:
    """Per token and layer, SGLang's DSA pool at DeepSeek V3.2's latent shape."""
    import torch

    cfg = {**DSA_REFERENCE, "num_hidden_layers": 1}
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        b = pool_bytes(build_pool("glm", cfg, dtype, PAGE["glm"]))
        out[name] = {k: v // (2 * PAGE["glm"]) for k, v in b.items()}
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


# ----------------------------------------------------------------------------------- measure
def configurations(a, model: Path, work: Path) -> list[tuple[str, Path, dict, str]]:
    """(name, checkpoint, engine arguments, guard) per engine; the first is the BF16 baseline."""
    kv, fp8 = KV_NAME[a.family], {"kv_cache_dtype": "fp8_e4m3"}
    fp8_name = f"FP8 {kv} KV" + (" (scale 1.0)" if a.family == "kimi" else "")
    experts, g = work / "experts", a.group_size
    rows = [("BF16", model, {}, "off"), (fp8_name, model, fp8, "off")]
    if a.family == "kimi":  # one scale per layer; DSA's FP8 rows carry per-block scales
        calibrated = {**fp8, "quantization_param_path": str(work / "kv_scales.json")}
        rows.append((f"FP8 {kv} KV (calibrated scales)", model, calibrated, "off"))
    return rows + [
        (f"INT4 experts (g{g})", experts, {}, "off"),
        (f"INT4 experts + MLP linears (g{g})", work / "mlp", {}, "off"),
        (f"INT4 experts + {fp8_name}", experts, fp8, "off"),
        (f"INT4 experts + {fp8_name}, guard default", experts, fp8, "default"),
        (f"INT4 experts + {fp8_name}, guard paranoid", experts, fp8, "paranoid"),
    ]


def set_guard(mode: str) -> None:
    """``KVGUARD_MODE`` for the next engine (its scheduler processes read it at start);
    ``default`` unsets it: the guard then runs at ``GuardConfig``'s default mode (verified)."""
    if mode == "default":
        os.environ.pop("KVGUARD_MODE", None)
    else:
        os.environ["KVGUARD_MODE"] = mode


def measure(a, work: Path) -> str:
    import torch

    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the engines' scheduler processes inherit it
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault(
        "SGLANG_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kvguard-sglang-cache")
    )
    from kvguard.quant.quantize import calibration_batches, quantize_checkpoint

    model = Path(a.model) if a.model is not None else ensure_model(a.family)
    log = lambda *m: print(*m, file=sys.stderr, flush=True)
    quants = {}
    for targets in ("experts", "mlp"):
        log(f"quantizing {model} (--targets {targets}) ...")
        quants[targets] = quantize_checkpoint(
            model, work / targets, a.group_size, targets=targets, log=lambda *m: None
        )
    cfg = json.loads((model / "config.json").read_text())
    windows = heldout_windows(model, a.eval_windows, a.seq_len)
    gen_prompts = prompts(windows, a.gen_prompts, a.prompt_len)
    kv = pool_tokens(a.family, cfg, a.budget_mib << 20)
    ref = reference_bytes_per_token() if a.family == "glm" else None
    wb = {
        name: weight_bytes(path)
        for name, path in (("bf16", model), ("experts", work / "experts"), ("mlp", work / "mlp"))
    }
    scales = None
    if a.family == "kimi":
        log("calibrating FP8 KV scales ...")
        calib = [row.tolist() for b in calibration_batches(model, 16, a.seq_len) for row in b]
        scales = mla_kv_scales_file(model, calib, work / "kv_scales.json")

    rows, base = [], None
    for name, path, kw, mode in configurations(a, model, work):
        log(f"engine: {name} ...")
        set_guard(mode)
        t = time.time()
        with engine(path, page_size=PAGE[a.family], **kw) as e:
            guard = scheduler_statuses(e)[0] or {}
            assert bool(guard.get("active")) == (mode != "off"), (name, guard)
            ppl, top1 = sglang_perplexity(e, windows, cfg["vocab_size"])
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
                guard=guard.get("mode", "off"),
                kernels=guard.get("kernels"),
                requests=len(windows) + 2 * len(gen_prompts) + a.repeats * 9,
            )
        )
        log(
            f"  {name}: ppl {ppl:.3f} top1 {top1_agree:.4f} greedy {agree:.3f} "
            f"single {single:.1f} tok/s ({time.time() - t:.0f}s)"
        )
    os.environ["KVGUARD_MODE"] = "off"
    hf_ppl = hf_perplexity(model, windows)
    return report(a, model, cfg, quants, kv, ref, wb, rows, hf_ppl, scales, len(windows))


# ------------------------------------------------------------------------------------ report
def describe(family: str, cfg: dict) -> str:
    arch = cfg["architectures"][0]
    attn = f"kv_lora_rank {cfg['kv_lora_rank']} + rope {cfg['qk_rope_head_dim']}"
    if family == "glm":
        attn += f", DSA indexer top-{cfg['index_topk']} ({cfg['index_n_heads']} heads)"
    moe = (
        f"{cfg['n_routed_experts']} routed experts top-{cfg['num_experts_per_tok']} + "
        f"{cfg['n_shared_experts']} shared"
    )
    return f"{arch}, {cfg['num_hidden_layers']} layers, {attn}, {moe}"


def memory_rows(a, kv, ref, wb) -> list[str]:
    bf, f8 = kv["bf16"], kv["fp8_e4m3"]
    ratio = lambda x, y: f"{x / y:.3f}x"
    rows = []
    if a.family == "glm":
        rows += [
            f"| KV latent bytes per token (all layers) | {bf['latent_bytes_per_token']} "
            f"| {f8['latent_bytes_per_token']} "
            f"| {ratio(bf['latent_bytes_per_token'], f8['latent_bytes_per_token'])} smaller | |",
            f"| DSA index-key bytes per token (all indexer layers; FP8 in both) "
            f"| {bf['index_bytes_per_token']} | {f8['index_bytes_per_token']} | 1.000x | |",
        ]
    what = "latent + index keys" if a.family == "glm" else "one latent row each"
    rows += [
        f"| KV bytes per token (all layers, {what}) | {bf['bytes_per_token']} "
        f"| {f8['bytes_per_token']} | {ratio(bf['bytes_per_token'], f8['bytes_per_token'])} "
        "smaller | |",
        f"| KV pool tokens in {a.budget_mib} MiB (SGLang's {POOL_CLASS[a.family]}, page "
        f"{PAGE[a.family]}) | {bf['tokens']} | {f8['tokens']} "
        f"| **{ratio(f8['tokens'], bf['tokens'])}** | {TARGET[a.family]} |",
    ]
    if ref is not None:
        rb, rf = ref["bf16"], ref["fp8_e4m3"]
        rows.append(
            f"| same pool per token and layer at DeepSeek V3.2's shape (kv_lora_rank "
            f"{DSA_REFERENCE['kv_lora_rank']} + rope {DSA_REFERENCE['qk_rope_head_dim']}; "
            f"latent + index keys) | {rb['latent']} + {rb['index']} = {rb['total']} "
            f"| {rf['latent']} + {rf['index']} = {rf['total']} "
            f"| {ratio(rb['total'], rf['total'])} | |"
        )
    e, m, b = wb["experts"], wb["mlp"], wb["bf16"]
    return rows + [
        f"| Routed expert weight bytes (on disk), `--targets experts` | {b['experts']} "
        f"| {e['experts']} | **{ratio(e['experts'], b['experts'])}** | |",
        "| MLP linear weight bytes (experts, shared, dense), `--targets mlp` (the linears too "
        f"narrow for SGLang's GPU W4A16 linear kernel stay BF16) | {b['mlp']} | {m['mlp']} "
        f"| {ratio(m['mlp'], b['mlp'])} | |",
        f"| Whole checkpoint, `--targets experts` / `mlp` | {b['all']} | {e['all']} / {m['all']} "
        f"| {ratio(e['all'], b['all'])} / {ratio(m['all'], b['all'])} | |",
    ]


def report(a, model, cfg, quants, kv, ref, wb, rows, hf_ppl, scales, n_windows) -> str:
    import sglang
    import torch

    kvn, b = KV_NAME[a.family], rows[0]
    title = {
        "kimi": "Kimi K2 architecture (MLA + MoE)",
        "glm": "GLM-5 architecture (MLA + DSA + MoE)",
    }
    cmd = "python -m kvguard.bench.quant_mla " + " ".join(a.argv)
    lines = [
        f"# {title[a.family]} on CPU: FP8 {kvn} KV cache and INT4 experts, apart and together",
        "",
        f"Generated by `{cmd.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), torch "
        f"{torch.__version__}, SGLang {sglang.__version__}, {a.threads} torch threads; guard off "
        "except where a row names it.",
        f"Model: `{model}` ({describe(a.family, cfg)}). INT4: `python -m kvguard.quant.quantize "
        f"--group-size {a.group_size} --targets experts|mlp` (compressed-tensors pack-quantized "
        "W4A16, symmetric int4, round to nearest; "
        f"{quants['experts']['seconds']} s / {quants['mlp']['seconds']} s).",
        "",
        "## Memory",
        "",
        "| | BF16 | FP8 e4m3 / INT4 | ratio | target |",
        "|---|---:|---:|---:|---|",
        *memory_rows(a, kv, ref, wb),
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
        "| configuration | guard (as the engine reported it) | held-out ppl | vs BF16 "
        "| next-token top-1 = BF16 | greedy agreement | prefix-cache pass identical "
        "| decode tok/s (1 stream) | tok/s (8 requests) |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['guard']} | {r['ppl']:.3f} "
            f"| {100 * (r['ppl'] / b['ppl'] - 1):+.2f}% | {r['top1']:.4f} "
            f"| {r['agree']:.3f} ({r['same']}/{a.gen_prompts}) "
            f"| {'yes' if r['stable'] else 'no'} | {r['single']:.1f} | {r['batched']:.1f} |"
        )
    lines += [
        "",
        f"Cross-check: transformers (float32, same windows) gives BF16-checkpoint perplexity "
        f"{hf_ppl:.3f} (SGLang BF16: {b['ppl']:.3f})"
        + (
            "; transformers' indexer scores unquantized keys, SGLang's (GPU kernels and "
            "kvguard's CPU path alike) FP8 index keys, so past index_topk the two pick slightly "
            "different positions."
            if a.family == "glm"
            else "."
        ),
        "",
        "Notes:",
    ]
    if a.family == "kimi":
        lines.append(
            "- FP8 MLA KV: SGLang's own `MLATokenToKVPool` with FP8 storage (1 byte per value; K "
            "and V are the same latent row, so one scale per layer). On read the rows a batch "
            "needs are dequantized once through a 256-entry table (byte -> value x scale). "
            "'calibrated' passes max |latent value| / 448 per layer (training-split calibration "
            "windows; the rope part bounded by its largest rotated-pair norm) through "
            "`--quantization-param-path`: "
            + ", ".join(f"L{i} {s:.4f}" for i, s in (scales or {}).items())
            + "."
        )
    else:
        bf, f8 = kv["bf16"], kv["fp8_e4m3"]
        ref_ratio = ref["bf16"]["total"] / ref["fp8_e4m3"]["total"]
        lines.append(
            "- FP8 DSA KV: SGLang's own `DSATokenToKVPool` with FP8 storage: each latent row "
            f"packs [{cfg['kv_lora_rank']} fp8 values | one fp32 scale per 128 of them | "
            f"{cfg['qk_rope_head_dim']} rope values in bf16] (SGLang's scaled layout; the rope "
            "part is never FP8), so there is nothing to calibrate. Every indexer "
            "layer also stores, per token, a 128-byte FP8 index key and its fp32 scale, in BF16 "
            "and FP8 pools alike: "
            f"{f8['index_bytes_per_token']} of the FP8 pool's {f8['bytes_per_token']} bytes per "
            f"token here (BF16: {bf['index_bytes_per_token']} of {bf['bytes_per_token']}). So "
            "the pool-token ratio is well under 2x by construction: "
            f"{bf['bytes_per_token'] / f8['bytes_per_token']:.3f}x for this model (its rope "
            "half as wide as its latent), "
            f"{ref_ratio:.3f}x at DeepSeek V3.2's latent shape (the row above)."
        )
    for r in (r for r in rows if r["guard"] != "off"):
        lines.append(
            f"- Guard {r['guard']} ({r['name']}; kernels {r['kernels']}): {r['requests']} "
            "requests served with the guard checking every step; a violation aborts its "
            "request, and none was: every greedy request finished by length and every prompt "
            "logprob came back."
        )
    lines.append(
        f"- INT4: compressed-tensors pack-quantized W4A16 (int32 words of 8 codes + one bf16 "
        f"scale per {a.group_size} weights: 0.25 + 1/{a.group_size} of BF16 = "
        f"{0.25 + 1 / a.group_size:.3f}x, plus a 16-byte shape per linear). Kimi K2 Thinking "
        "quantizes the routed experts only (`--targets experts`); attention"
        + (" (with the DSA indexer)" if a.family == "glm" else "")
        + ", shared experts, the dense layer, router, embeddings and lm_head stay BF16. "
        "CPU kernel: torch's INT4 GEMM (`_weight_int4pack_mm_for_cpu`) per expert inside "
        "SGLang's native MoE loop."
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvguard.bench.quant_mla")
    p.add_argument("--family", choices=FAMILIES, required=True)
    p.add_argument(
        "--model", type=Path, default=None, help="BF16 checkpoint (default: the family's model)"
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
    p.add_argument(
        "--out", type=Path, default=None, help="default: bench/quant_<family>_results.md"
    )
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else argv
    out = a.out or Path(__file__).with_name(f"quant_{a.family}_results.md")
    work = Path(tempfile.mkdtemp(prefix=f"kvguard-bench-quant-{a.family}-"))
    try:
        text = measure(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

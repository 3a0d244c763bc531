"""Quantization measurements on CPU: FP8 KV cache, INT4 weights, both, against BF16.

Usage::

    python -m kvguard.bench.quant [--model DIR] [--group-size auto] [--method gptq]
        [--out bench/quant_results.md]

What is measured (each serving configuration in its own SGLang engine, torch_native attention):
* KV pool tokens at a fixed memory budget: SGLang's own MHA pools (BF16, and the CPU FP8 pool
  kvguard enables) are built for the model's shapes; bytes per token slot are read off the
  allocated buffers and a pool of the budget's size is allocated to confirm it fits.
* Linear weight bytes: the 7 projections of every decoder layer, BF16 checkpoint vs the INT4
  GPTQ checkpoint (qweight + qzeros + scales + g_idx), on disk.
* Held-out perplexity: SGLang prompt logprobs (``return_logprob``, ``logprob_start_len=0``) over
  windows of the default model's held-out stdlib files; for BF16 the same windows are also scored
  by transformers in float32, as a cross-check of the SGLang pipeline.
* Agreement with BF16 (the SGLang BF16 engine): next-token top-1 under teacher forcing on the
  perplexity windows, and the per-position match rate of greedy continuations.
* Decode tokens/s: one stream (time between first and last streamed token) and 8 concurrent
  requests (generated tokens / wall time), best of repeats, on whatever CPU this runs on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INT4_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


# -------------------------------------------------------------------------------- held-out data
def heldout_windows(model_dir: Path, num: int, seq_len: int) -> list[list[int]]:
    """The first ``num`` (seq_len+1)-token windows of the held-out stream, built exactly as the
    default model's build report does (``<s> file </s>`` per held-out file)."""
    from transformers import AutoTokenizer

    from kvguard.serve.corpus import list_corpus_files, read_text, split_files

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.model_max_length = 1 << 30  # whole files are tokenized, then cut into windows
    _train, held = split_files(list_corpus_files())
    ids: list[int] = []
    for path in held:
        ids += [tok.bos_token_id] + tok(read_text(path), add_special_tokens=False)["input_ids"]
        ids.append(tok.eos_token_id)
        if len(ids) > num * seq_len + 1:
            break
    n = min(num, (len(ids) - 1) // seq_len)
    return [ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]


def prompts(windows: list[list[int]], num: int, length: int) -> list[list[int]]:
    step = max(1, len(windows) // num)
    return [w[:length] for w in windows[::step][:num]]


# ------------------------------------------------------------------------------------- sizes
def kv_pool_tokens(model_dir: Path, budget_bytes: int) -> dict:
    """Token slots of SGLang's BF16 and CPU-FP8 MHA pools within ``budget_bytes``."""
    import torch
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import CPUFP8KVCacheMethod
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    cfg = json.loads((model_dir / "config.json").read_text())
    dims = dict(
        head_num=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        layer_num=cfg["num_hidden_layers"],
        device="cpu",
        enable_memory_saver=False,
    )
    page = 16

    def pool(dtype, size):
        qm = CPUFP8KVCacheMethod() if dtype == torch.float8_e4m3fn else None
        return MHATokenToKVPool(size=size, page_size=page, dtype=dtype, quant_method=qm, **dims)

    def nbytes(p):
        return sum(b.numel() * b.element_size() for b in p.k_buffer + p.v_buffer)

    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        per_slot = nbytes(pool(dtype, page)) // (2 * page)  # the pool holds size + page_size slots
        tokens = (budget_bytes // per_slot - page) // page * page
        full = pool(dtype, tokens)
        assert nbytes(full) <= budget_bytes, (name, nbytes(full), budget_bytes)
        out[name] = {
            "bytes_per_token": per_slot,
            "tokens": tokens,
            "storage": str(full.k_buffer[0].dtype).replace("torch.", ""),
        }
        del full
    return out


def linear_weight_bytes(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors file handle, not a dict)
            parts = key.split(".")
            if (
                len(parts) >= 2
                and parts[-2] in LINEARS
                and (parts[-1] == "weight" or parts[-1] in INT4_SUFFIXES)
            ):
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    return total


# ----------------------------------------------------------------------------------- engines
@contextmanager
def engine(model_dir: Path, **kw):
    import sglang as sgl

    args = dict(
        model_path=str(model_dir),
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        max_total_tokens=16384,
        page_size=16,
        skip_server_warmup=True,
        log_level="error",
        random_seed=0,
    )
    args.update(kw)
    e = sgl.Engine(**args)
    try:
        yield e
    finally:
        e.shutdown()


def sglang_perplexity(e, windows: list[list[int]], vocab: int) -> tuple[float, list[int]]:
    """(perplexity, the argmax next-token prediction at every scored position)."""
    outs = e.generate(
        input_ids=windows,
        sampling_params={"max_new_tokens": 1, "temperature": 0},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=1,
    )
    nll, count, top1 = 0.0, 0, []
    for w, o in zip(windows, outs):
        lps = o["meta_info"]["input_token_logprobs"]
        assert len(lps) == len(w) and lps[0][0] is None, (len(lps), len(w))
        for (lp, tid, _t), want in zip(lps[1:], w[1:]):
            # SGLang 0.5.23 reports the id vocab_size-1 as 0 ("x < vocab_size - 1 else 0" in
            # logprob_result_processor.py); the logprob itself is the real token's.
            assert tid == want or (tid == 0 and want == vocab - 1), (tid, want)
            nll -= lp
            count += 1
        top1 += [t[0][1] for t in o["meta_info"]["input_top_logprobs"][1:]]
    return math.exp(nll / count), top1


def greedy(e, ids: list[list[int]], n: int) -> list[list[int]]:
    outs = e.generate(
        input_ids=ids, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    )
    bad = [
        o["meta_info"]["finish_reason"]
        for o in outs
        if o["meta_info"]["finish_reason"]["type"] != "length"
    ]
    assert not bad, bad
    return [o["output_ids"] for o in outs]


def decode_speed(
    e, source: list[int], length: int, n: int, batch: int, repeats: int
) -> tuple[float, float]:
    """(single-stream decode tok/s, batch-of-``batch`` generated tok/s): best of ``repeats``, as
    the least disturbed run on a shared machine. Prompts are ``length``-token slices of
    ``source`` at distinct offsets, so no run reuses a cached prefix."""
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    assert len(source) >= length + repeats * (batch + 1), "source too short for distinct prompts"
    single, batched = [], []
    for r in range(repeats):
        off = r * (batch + 1)
        stamps = []
        for chunk in e.generate(
            input_ids=source[off : off + length], sampling_params=params, stream=True
        ):
            stamps.append((time.perf_counter(), len(chunk["output_ids"])))
        (t0, n0), (t1, n1) = stamps[0], stamps[-1]
        single.append((n1 - n0) / (t1 - t0))
        rows = [source[off + i : off + i + length] for i in range(1, batch + 1)]
        t = time.perf_counter()
        outs = e.generate(input_ids=rows, sampling_params=params)
        batched.append(sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t))
    return max(single), max(batched)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    same = sum(int(x == y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(max(len(ra), len(rb)) for ra, rb in zip(a, b))
    return same / total, sum(int(ra == rb) for ra, rb in zip(a, b))


def hf_perplexity(model_dir: Path, windows: list[list[int]]) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), 8):
            x = torch.tensor(windows[i : i + 8])
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
                )
            )
            count += x[:, 1:].numel()
    return math.exp(nll / count)


def kv_scales_file(model_dir: Path, windows: list[list[int]], out: Path) -> dict[int, float]:
    """Per-layer FP8 KV scales, max(|K| after RoPE, |V|) / 448 over calibration windows, written in
    SGLang's ``--quantization-param-path`` format (one factor per layer, used for K and V)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    amax: dict[int, float] = {}
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rot = model.model.rotary_emb
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hooks = []
    for i, layer in enumerate(model.model.layers):

        def k_hook(_m, _inp, k, i=i):
            b, t, _ = k.shape
            kh = k.view(b, t, -1, hd).transpose(1, 2)
            cos, sin = rot(kh, torch.arange(t).unsqueeze(0))
            kr, _ = apply_rotary_pos_emb(kh, kh, cos, sin)
            amax[i] = max(amax.get(i, 0.0), float(kr.abs().max()))

        def v_hook(_m, _inp, v, i=i):
            amax[i] = max(amax.get(i, 0.0), float(v.abs().max()))

        hooks += [
            layer.self_attn.k_proj.register_forward_hook(k_hook),
            layer.self_attn.v_proj.register_forward_hook(v_hook),
        ]
    return write_kv_scales(model, windows, hooks, amax, out)


def write_kv_scales(model, windows: list[list[int]], hooks: list, amax: dict[int, float],
                    out: Path) -> dict[int, float]:  # fmt: skip
    """Run the calibration windows through ``model`` (whose forward ``hooks`` record each
    layer's max |KV value| in ``amax``), remove the hooks, and write the per-layer FP8 scales
    (max / 448) in SGLang's ``--quantization-param-path`` format. Returns the scales."""
    import torch

    with torch.no_grad():
        for i in range(0, len(windows), 8):
            model(input_ids=torch.tensor(windows[i : i + 8]))
    for h in hooks:
        h.remove()
    scales = {i: a / 448.0 for i, a in sorted(amax.items())}
    doc = {
        "model_type": model.config.model_type,
        "kv_cache": {
            "dtype": "float8_e4m3fn",
            "scaling_factor": {"0": {str(i): s for i, s in scales.items()}},
        },
    }
    out.write_text(json.dumps(doc, indent=2))
    return scales


# ------------------------------------------------------------------------------------- main
def auto_group_sizes(model_dir: Path) -> tuple[int, int | None]:
    """(128, None) when 128 divides every in_features; else (128, the largest multiple of 8 that
    does) so that only the layers 128 does not fit get smaller groups."""
    cfg = json.loads((model_dir / "config.json").read_text())
    ks = {cfg["hidden_size"], cfg["intermediate_size"]}
    if all(k % 128 == 0 for k in ks):
        return 128, None
    misfit = [k for k in ks if k % 128]
    for g in range(128, 0, -8):
        if all(k % g == 0 for k in misfit):
            return 128, g
    raise SystemExit(f"no group size fits in_features {sorted(ks)}")


def uniform_group_size(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    g = math.gcd(cfg["hidden_size"], cfg["intermediate_size"])
    return max(d for d in range(8, min(g, 128) + 1, 8) if g % d == 0)


def run(a) -> str:
    work = Path(tempfile.mkdtemp(prefix="kvguard-bench-quant-"))
    try:
        return measure(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(a, work: Path) -> str:
    import torch

    torch.set_num_threads(a.threads)
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the engines' scheduler processes inherit it
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault(
        "SGLANG_CACHE_DIR", os.path.join(tempfile.gettempdir(), "kvguard-sglang-cache")
    )
    os.environ.setdefault("KVGUARD_MODE", "off")  # measure the features, not the guard
    from kvguard.quant.quantize import calibration_batches, quantize_checkpoint

    if a.model is None:
        from kvguard.serve.default_model import ensure_default_model

        a.model = ensure_default_model()
    model = Path(a.model)
    if a.group_size == "auto":
        gs, fallback = auto_group_sizes(model)
    else:
        gs, fallback = int(a.group_size), a.fallback_group_size
    log = lambda *m: print(*m, file=sys.stderr, flush=True)

    log(f"quantizing {model} ({a.method}, group {gs}, fallback {fallback}) ...")
    int4 = work / "int4"
    qrep = quantize_checkpoint(
        model,
        int4,
        gs,
        a.method,
        a.calib_samples,
        a.calib_seq_len,
        log=lambda *m: None,
        fallback_group_size=fallback,
    )
    uniform = None
    if fallback is not None:  # what one group size for every layer would cost (bytes only)
        ug = uniform_group_size(model)
        quantize_checkpoint(model, work / "uniform", ug, "rtn", log=lambda *m: None)
        uniform = (ug, linear_weight_bytes(work / "uniform"))
    windows = heldout_windows(model, a.eval_windows, a.seq_len)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    gen_prompts = prompts(windows, a.gen_prompts, a.prompt_len)
    kv = kv_pool_tokens(model, a.budget_mib << 20)
    wb = {"bf16": linear_weight_bytes(model), "int4": linear_weight_bytes(int4)}
    log("calibrating FP8 KV scales ...")
    calib = [row.tolist() for b in calibration_batches(model, 16, a.seq_len) for row in b]
    scales = kv_scales_file(model, calib, work / "kv_scales.json")

    configs = [
        ("BF16", model, {}),
        ("FP8 KV (scale 1.0)", model, {"kv_cache_dtype": "fp8_e4m3"}),
        (
            "FP8 KV (calibrated scales)",
            model,
            {"kv_cache_dtype": "fp8_e4m3", "quantization_param_path": str(work / "kv_scales.json")},
        ),
        (f"INT4 ({a.method}, {qlabel(gs, fallback)})", int4, {}),
        ("INT4 + FP8 KV", int4, {"kv_cache_dtype": "fp8_e4m3"}),
    ]
    rows, base = [], None
    for name, path, kw in configs:
        log(f"engine: {name} ...")
        t = time.time()
        with engine(path, **kw) as e:
            ppl, top1 = sglang_perplexity(e, windows, vocab)
            gen = greedy(e, gen_prompts, a.gen_tokens)
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
                single=single,
                batched=batched,
            )
        )
        log(
            f"  {name}: ppl {ppl:.3f} top1 {top1_agree:.4f} greedy {agree:.3f} "
            f"single {single:.1f} tok/s ({time.time() - t:.0f}s)"
        )
    hf_ppl = hf_perplexity(model, windows)
    return report(
        a, model, (gs, fallback), qrep, kv, wb, uniform, rows, hf_ppl, scales, len(windows)
    )


def qlabel(gs: int, fallback: int | None) -> str:
    return f"g{gs}" if fallback is None else f"g{gs}, g{fallback} where {gs} does not fit"


def report(a, model, groups, qrep, kv, wb, uniform, rows, hf_ppl, scales, n_windows) -> str:
    import sglang
    import torch

    bf, f8 = kv["bf16"], kv["fp8_e4m3"]
    gs, fallback = groups
    qflags = f"--group-size {gs}" + (f" --fallback-group-size {fallback}" if fallback else "")
    overrides = "; ".join(
        f"`{k}` -> {v['group_size']}" for k, v in qrep["group_size_overrides"].items()
    )
    cmd = "python -m kvguard.bench.quant " + " ".join(a.argv)
    lines = [
        "# Quantization on CPU: FP8 KV cache and INT4 weights",
        "",
        f"Generated by `{cmd.strip()}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), torch {torch.__version__}, "
        f"SGLang {sglang.__version__}, {a.threads} torch threads; guard off (features only).",
        f"Model: `{model}` ({json.loads((model / 'config.json').read_text()).get('num_hidden_layers')} layers). "
        f"INT4: `python -m kvguard.quant.quantize --method {a.method} {qflags}` "
        f"(GPTQ checkpoint, symmetric, desc_act false; {qrep['seconds']} s"
        + (f"; per-module group overrides: {overrides}" if overrides else "")
        + ").",
        "",
        "## Memory",
        "",
        "| | BF16 | FP8 e4m3 / INT4 | ratio | target |",
        "|---|---:|---:|---:|---|",
        f"| KV bytes per token (all layers, K+V) | {bf['bytes_per_token']} | {f8['bytes_per_token']} | "
        f"{bf['bytes_per_token'] / f8['bytes_per_token']:.3f}x smaller | |",
        f"| KV pool tokens in {a.budget_mib} MiB | {bf['tokens']} | {f8['tokens']} | "
        f"**{f8['tokens'] / bf['tokens']:.3f}x** | >= 1.99x |",
        f"| Linear weight bytes (7 projections x layers, on disk), INT4 {qlabel(gs, fallback)} "
        f"| {wb['bf16']} | {wb['int4']} | **{wb['int4'] / wb['bf16']:.3f}x** | <= 0.3x |",
    ]
    if uniform is not None:
        lines.append(
            f"| same, one group size for every layer (g{uniform[0]}, the largest that fits all; "
            f"not served below) | {wb['bf16']} | {uniform[1]} | {uniform[1] / wb['bf16']:.3f}x | |"
        )
    lines += [
        "",
        "## Quality and speed",
        "",
        f"Perplexity: {n_windows} held-out windows of {a.seq_len + 1} tokens, SGLang prompt "
        "logprobs. Next-token top-1: on the same windows (teacher forcing), the fraction of "
        "positions whose most likely next token equals the BF16 engine's. Greedy agreement: "
        f"continuations of {a.gen_prompts} held-out prompts ({a.prompt_len} tokens), "
        f"{a.gen_tokens} new tokens, per-position match rate vs the BF16 engine (identical "
        "sequences in brackets; after a first difference the sequences drift apart, so this "
        f"compounds). Decode: one stream of {a.speed_tokens} tokens (first to last streamed "
        "token) and 8 concurrent requests (generated tokens / wall time incl. prefill), best of "
        f"{a.repeats}; engines run with OMP_NUM_THREADS={a.threads}; load average when done: "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} (a shared 2-core machine: the speeds "
        "are indicative, differences under ~20% are noise).",
        "",
        "| configuration | held-out ppl | vs BF16 | next-token top-1 = BF16 | greedy agreement "
        "| decode tok/s (1 stream) | tok/s (8 requests) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    b = rows[0]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['ppl']:.3f} | {100 * (r['ppl'] / b['ppl'] - 1):+.2f}% "
            f"| {r['top1']:.4f} | {r['agree']:.3f} ({r['same']}/{a.gen_prompts}) "
            f"| {r['single']:.1f} | {r['batched']:.1f} |"
        )
    lines += [
        "",
        f"Cross-check: transformers (float32, same windows) gives BF16-checkpoint perplexity {hf_ppl:.3f} "
        f"(SGLang BF16: {b['ppl']:.3f}).",
        "",
        "Notes:",
        "- FP8 KV stores K and V as float8_e4m3fn (1 byte/element, no scale buffers). On read, the "
        "rows a batch needs are gathered and dequantized through a 256-entry table per layer "
        "(byte -> value x scale), then SGLang's torch_native SDPA runs on that copy. 'scale 1.0' "
        "is SGLang's default when a model ships no KV scales; 'calibrated' passes "
        "max(|K after RoPE|, |V|)/448 per layer (training-split calibration windows) through "
        "`--quantization-param-path`: "
        + ", ".join(f"L{i} {s:.4f}" for i, s in scales.items())
        + ".",
        f"- INT4 weight bytes count qweight + qzeros + scales (fp16) + g_idx; at group size g the "
        f"floor is 0.25 + 1.25/g of BF16 (g={gs}: {0.25 + 1.25 / gs:.3f}x) plus g_idx. Embeddings, "
        f"norms and lm_head stay BF16. CPU kernel: torch's INT4 GEMM "
        f"(`_weight_int4pack_mm_for_cpu`) for group sizes 32-256, dequantize-and-matmul otherwise.",
    ]
    if fallback is not None and fallback < 32:
        lines.append(
            f"- The layers on group size {fallback} (in_features not divisible by any group size "
            ">= 32) run the dequantize-and-matmul path, the rest torch's INT4 GEMM: that is the "
            "INT4 single-stream gap. With MLP widths a multiple of 128 every layer would take the "
            "INT4 GEMM, and the uniform g128 byte ratio would be ~0.26x."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvguard.bench.quant")
    p.add_argument(
        "--model", type=Path, default=None, help="BF16 HF Llama (default: kvguard's default model)"
    )
    p.add_argument(
        "--group-size",
        default="auto",
        help="INT4 group size, or auto: 128, with the largest fitting multiple of 8 as "
        "fallback for layers 128 does not divide",
    )
    p.add_argument("--fallback-group-size", type=int, default=None)
    p.add_argument("--method", choices=("rtn", "gptq"), default="gptq")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument(
        "--budget-mib", type=int, default=256, help="KV memory budget for the pool-size row"
    )
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--gen-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--threads", type=int, default=1, help="torch/OpenMP threads (bench process and engines)"
    )
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("quant_results.md"))
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else argv
    text = run(a)
    a.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""BF16/FP16 Hugging Face checkpoint -> INT4 W4A16 checkpoint (group-quantized).

Usage::

    python -m kvguard.quant.quantize --model DIR --out DIR [--group-size G] [--method rtn|gptq]
        [--targets experts|mlp]

Llama checkpoints are written as GPTQ (below). DeepSeek-V3-layout MoE checkpoints (Kimi K2, GLM-5)
are written as compressed-tensors ``pack-quantized`` W4A16, symmetric, group 32 by default: the
format Kimi K2 Thinking ships (``kvguard.quant.pack_quantized``; ``--targets`` picks the routed
experts only, or all MLP linears; round to nearest).

Output format: ``quant_method: gptq``, 4 bits, symmetric, ``desc_act: false``, checkpoint format
``gptq`` (v1: qzeros store zero - 1), per linear layer ``qweight``/``qzeros``/``scales``/``g_idx``
(layout in ``kvguard.kernels.w4a16_ref``). Why GPTQ: it is the format SGLang's CPU route already
loads (``CPUGPTQConfig`` creates and shards these parameters; kvguard only swaps the kernel, see
``patches/int4_cpu_linear.py``), it is what a GPTQ calibration produces natively, and on GPUs
the same files are served by SGLang's gptq_marlin (symmetric, no act-order: Marlin-compatible).

``--fallback-group-size G`` quantizes the layers ``--group-size`` does not divide with G instead,
recorded as GPTQModel-style ``dynamic`` overrides in ``quantization_config`` (SGLang honours them
on CUDA, and on CPU through kvguard's hook). Marlin has no kernel for groups under 32, so on a GPU
such a checkpoint needs ``--quantization gptq`` (kvguard's Triton W4A16 kernel) if G < 32.

Quantized: every ``q/k/v/o_proj`` and ``gate/up/down_proj`` of the decoder layers. Kept as they
are: embeddings, norms, ``lm_head`` (the usual GPTQ choice). Methods:
* ``rtn``: round to nearest per group (no data).
* ``gptq``: GPTQ with a calibration set of Python standard-library source (files of the
  default model's *training* split, never its held-out files), sequential per layer.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from kvguard.kernels.w4a16_ref import PACK, pack_cols, pack_rows, quantize_rtn
from kvguard.quant import pack_quantized

DENSE_ARCHS = ("LlamaForCausalLM",)
SUPPORTED_ARCHS = DENSE_ARCHS + pack_quantized.MOE_ARCHS
DEFAULT_GROUP_SIZE = 128  # GPTQ (dense); MoE checkpoints default to pack_quantized's 32
LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
SOURCE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class QuantizeError(ValueError):
    """The input checkpoint or the requested settings cannot be quantized."""


# -- reading ------------------------------------------------------------------------------------------
def read_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise QuantizeError(
            f"{model_dir}: no config.json (expected a Hugging Face checkpoint folder)"
        )
    cfg = json.loads(cfg_path.read_text())
    if "quantization_config" in cfg:
        method = cfg["quantization_config"].get("quant_method", "?")
        raise QuantizeError(
            f"{model_dir} is already quantized (quant_method {method!r}); "
            "start from the BF16/FP16 checkpoint"
        )
    archs = cfg.get("architectures") or []
    if not any(a in SUPPORTED_ARCHS for a in archs):
        raise QuantizeError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}: "
            f"kvguard quantizes {', '.join(SUPPORTED_ARCHS)} checkpoints"
        )
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype not in SOURCE_DTYPES:
        raise QuantizeError(
            f"unsupported checkpoint dtype {dtype!r}: expected one of {', '.join(SOURCE_DTYPES)}"
        )
    return cfg


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / s for s in shards]
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        found = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".gguf"))
        hint = f" (found {', '.join(found)}: convert to safetensors first)" if found else ""
        raise QuantizeError(f"{model_dir}: no model.safetensors or safetensors index{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def linear_names(cfg: dict) -> list[str]:
    return [f"model.layers.{i}.{lin}" for i in range(cfg["num_hidden_layers"]) for lin in LINEARS]


def plan_group_sizes(
    tensors: dict[str, torch.Tensor], names: list[str], group_size: int, fallback: int | None = None
) -> dict[str, int]:
    """Group size per quantized layer. Each needs group | in_features, 8 | in_features and
    8 | out_features. Layers that ``group_size`` does not fit take ``fallback`` if given
    (recorded as GPTQ ``dynamic`` overrides); otherwise that is an error naming them."""
    for flag, g in (("--group-size", group_size), ("--fallback-group-size", fallback)):
        if g is not None and (g <= 0 or g % PACK):
            raise QuantizeError(
                f"{flag} must be a positive multiple of {PACK}, got {g} "
                "(per-channel quantization, -1, is not supported)"
            )
    plan, bad, ks = {}, [], set()
    for name in names:
        w = tensors.get(f"{name}.weight")
        if w is None:
            raise QuantizeError(f"checkpoint has no {name}.weight (not a standard Llama layout)")
        n, k = w.shape
        ks.add(k)
        if n % PACK:
            raise QuantizeError(f"{name}: out_features {n} is not a multiple of {PACK}")
        if k % group_size == 0:
            plan[name] = group_size
        elif fallback is not None and k % fallback == 0:
            plan[name] = fallback
        else:
            bad.append(f"{name} (in_features {k})")
    if bad:
        g = 0
        for k in ks:
            g = math.gcd(g, k)
        valid = [d for d in range(PACK, g + 1, PACK) if g % d == 0]
        tried = f"group size {group_size}" + (f" (fallback {fallback})" if fallback else "")
        raise QuantizeError(
            f"{tried} does not divide the in_features of {len(bad)} layer(s): "
            + "; ".join(bad[:4])
            + ("; ..." if len(bad) > 4 else "")
            + f". Group sizes that fit every layer of this model: {valid or 'none'}; or keep "
            "--group-size and pass --fallback-group-size for the layers it does not fit"
        )
    return plan


# SGLang fuses q/k/v and gate/up into one layer (qkv_proj, gate_up_proj); a dynamic override must
# match the fused name as well as the Hugging Face one. Members of a fused layer share in_features.
_FUSED = {
    "self_attn.q_proj": "self_attn.(q_proj|k_proj|v_proj|qkv_proj)",
    "self_attn.k_proj": "self_attn.(q_proj|k_proj|v_proj|qkv_proj)",
    "self_attn.v_proj": "self_attn.(q_proj|k_proj|v_proj|qkv_proj)",
    "mlp.gate_proj": "mlp.(gate_proj|up_proj|gate_up_proj)",
    "mlp.up_proj": "mlp.(gate_proj|up_proj|gate_up_proj)",
}


def dynamic_overrides(plan: dict[str, int], group_size: int) -> dict[str, dict]:
    """GPTQModel-style ``dynamic`` rules ("+:regex" matched against module names, as SGLang and
    GPTQModel do) for the layers whose group size differs from the default."""
    rules: dict[tuple[str, int], set[str]] = {}
    for name, g in plan.items():
        if g == group_size:
            continue
        layer, suffix = name.split(".")[2], name.split(".", 3)[3]
        module = _FUSED.get(suffix, suffix).replace(".", r"\.")
        rules.setdefault((module, g), set()).add(layer)
    out = {}
    for (module, g), layers in sorted(rules.items()):
        idx = "(" + "|".join(sorted(layers, key=int)) + ")"
        out[rf"+:model\.layers\.{idx}\.{module}$"] = {"group_size": g}
    return out


# -- calibration data ---------------------------------------------------------------------------------
def calibration_batches(
    model_dir: Path, num_samples: int, seq_len: int, batch_size: int = 8
) -> list[torch.Tensor]:
    """``num_samples`` windows of ``seq_len`` tokens from stdlib files of the training split."""
    from transformers import AutoTokenizer

    from kvguard.serve.corpus import list_corpus_files, read_text, split_files

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.model_max_length = 1 << 30  # whole files are tokenized, then cut into windows
    train, _held = split_files(list_corpus_files())
    ids: list[int] = []
    need = num_samples * seq_len
    stride = max(1, len(train) // 200)  # spread over the library, ~200 files at most
    for path in train[::stride]:
        ids.extend(tok(read_text(path))["input_ids"])
        if len(ids) >= 4 * need:
            break
    if len(ids) < need:
        raise QuantizeError(f"calibration corpus too small: {len(ids)} tokens < {need}")
    step = len(ids) // num_samples
    windows = torch.tensor([ids[i * step : i * step + seq_len] for i in range(num_samples)])
    return list(windows.split(batch_size))


def gptq_layers(
    model_dir: Path, plan: dict[str, int], num_samples: int, seq_len: int, damp: float, log=print
) -> dict[str, tuple]:
    from transformers import AutoModelForCausalLM

    from kvguard.quant.gptq import calibrate_and_quantize

    batches = calibration_batches(model_dir, num_samples, seq_len)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return calibrate_and_quantize(model, batches, plan, damp, log=log)


# -- writing ------------------------------------------------------------------------------------------
def gptq_tensors(codes, zeros, scales, group_size: int) -> dict[str, torch.Tensor]:
    """(codes [K, N], zeros [G, N], scales [G, N]) -> the four GPTQ v1 tensors of one layer."""
    k = codes.shape[0]
    return {
        "qweight": pack_rows(codes),
        "qzeros": pack_cols(zeros - 1),  # format "gptq" (v1) stores zero - 1
        "scales": scales.to(torch.float16),
        "g_idx": (torch.arange(k, dtype=torch.int32) // group_size),
    }


def quantization_config(
    group_size: int, method: str, damp: float, dynamic: dict | None = None
) -> dict:
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "sym": True,
        "desc_act": False,
        "static_groups": False,
        "true_sequential": True,
        "lm_head": False,
        "damp_percent": damp,
        "checkpoint_format": "gptq",
        "meta": {"quantizer": [f"kvguard-{method}"]},
    }
    if dynamic:
        qc["dynamic"] = dynamic
    return qc


def quantize_checkpoint(
    model: Path,
    out: Path,
    group_size: int | None = None,
    method: str = "rtn",
    num_samples: int = 128,
    seq_len: int = 256,
    damp: float = 0.01,
    log=print,
    fallback_group_size: int | None = None,
    targets: str = "experts",
) -> dict:
    """Write the INT4 checkpoint; returns a small report (also saved as quant_report.json)."""
    model, out = Path(model), Path(out)
    if method not in ("rtn", "gptq"):
        raise QuantizeError(f"unknown --method {method!r}: choose rtn or gptq")
    if out.resolve() == model.resolve():
        raise QuantizeError("--out must differ from --model")
    cfg = read_config(model)
    tensors = read_tensors(model)
    if any(a in pack_quantized.MOE_ARCHS for a in cfg.get("architectures") or []):
        return _quantize_moe(
            model, out, cfg, tensors, group_size, method, fallback_group_size, targets, log
        )
    if group_size is None:
        group_size = DEFAULT_GROUP_SIZE
    names = linear_names(cfg)
    plan = plan_group_sizes(tensors, names, group_size, fallback_group_size)
    t0 = time.time()
    if method == "gptq":
        solved = gptq_layers(model, plan, num_samples, seq_len, damp, log)
    else:
        solved = {
            n: quantize_rtn(tensors[f"{n}.weight"].t().to(torch.float32), plan[n]) for n in names
        }
    result: dict[str, torch.Tensor] = {}
    src_bytes = q_bytes = 0
    for key, t in tensors.items():
        base = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and base in solved:
            src_bytes += t.numel() * t.element_size()
            for suffix, qt in gptq_tensors(*solved[base], plan[base]).items():
                result[f"{base}.{suffix}"] = qt.contiguous()
                q_bytes += qt.numel() * qt.element_size()
        else:
            result[key] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in model.iterdir():  # tokenizer, generation config, ... (not weights, not config.json)
        if (
            f.is_file()
            and f.name != "config.json"
            and not f.name.startswith("model.safetensors")
            and f.suffix not in (".bin", ".pt", ".gguf")
            and f.name != "quant_report.json"
        ):
            shutil.copy2(f, out / f.name)
    dynamic = dynamic_overrides(plan, group_size)
    cfg["quantization_config"] = quantization_config(group_size, method, damp, dynamic)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    qc = {k: v for k, v in cfg["quantization_config"].items() if k != "meta"}
    (out / "quantize_config.json").write_text(json.dumps(qc, indent=2) + "\n")
    report = {
        "source": str(model),
        "method": method,
        "group_size": group_size,
        "group_size_overrides": dynamic,
        "layers_quantized": len(solved),
        "linear_weight_bytes_source": src_bytes,
        "linear_weight_bytes_int4": q_bytes,
        "ratio": q_bytes / max(src_bytes, 1),
        "seconds": round(time.time() - t0, 2),
    }
    if method == "gptq":
        report.update(calib_samples=num_samples, calib_seq_len=seq_len, damp=damp)
    (out / "quant_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(
        f"wrote {out}: {len(solved)} linear layers, {method}, group {group_size}, "
        f"linear weights {src_bytes} -> {q_bytes} bytes ({report['ratio']:.3f}x)"
    )
    return report


def _quantize_moe(model, out, cfg, tensors, group_size, method, fallback_group_size, targets, log):
    if method != "rtn":
        raise QuantizeError(
            f"--method {method}: MoE checkpoints are quantized round-to-nearest (--method rtn); "
            "GPTQ calibration here is per dense Llama layer"
        )
    if fallback_group_size is not None:
        raise QuantizeError("--fallback-group-size applies to GPTQ (dense) checkpoints only")
    if group_size is None:
        group_size = pack_quantized.DEFAULT_GROUP_SIZE
    try:
        return pack_quantized.quantize_moe_checkpoint(
            model, out, cfg, tensors, group_size=group_size, targets=targets, log=log
        )
    except pack_quantized.PackQuantizeError as e:
        raise QuantizeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvguard.quant.quantize", description=__doc__.split("\n")[0]
    )
    p.add_argument(
        "--model",
        required=True,
        type=Path,
        help="BF16/FP16 HF Llama, DeepseekV3 or GlmMoeDsa checkpoint",
    )
    p.add_argument("--out", required=True, type=Path, help="output folder (INT4 checkpoint)")
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help=f"default {DEFAULT_GROUP_SIZE} (GPTQ), {pack_quantized.DEFAULT_GROUP_SIZE} (MoE)",
    )
    p.add_argument(
        "--targets",
        choices=pack_quantized.TARGETS,
        default="experts",
        help="MoE checkpoints: routed experts only (Kimi K2 Thinking's choice) or every MLP linear",
    )
    p.add_argument(
        "--fallback-group-size",
        type=int,
        default=None,
        help="group size for layers --group-size does not fit (GPTQ 'dynamic' override)",
    )
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn")
    p.add_argument("--calib-samples", type=int, default=128, help="gptq: calibration windows")
    p.add_argument("--calib-seq-len", type=int, default=256, help="gptq: tokens per window")
    p.add_argument(
        "--damp", type=float, default=0.01, help="gptq: Hessian dampening (of mean diag)"
    )
    a = p.parse_args(argv)
    try:
        quantize_checkpoint(
            a.model,
            a.out,
            a.group_size,
            a.method,
            a.calib_samples,
            a.calib_seq_len,
            a.damp,
            fallback_group_size=a.fallback_group_size,
            targets=a.targets,
        )
    except QuantizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

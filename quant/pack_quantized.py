"""BF16 DeepSeek-V3-layout MoE checkpoint (Kimi K2; GLM-5's GlmMoeDsa, whose expert and attention
names are the same) -> INT4 W4A16 in the format Kimi K2 Thinking ships: compressed-tensors
``pack-quantized``, 4-bit ``int``, symmetric, ``strategy: group``, group size 32, one config group
targeting ``Linear``, the layers kept in BF16 listed in ``ignore``.

Reached through ``python -m kvguard.quant.quantize`` (it dispatches MoE checkpoints here).

Per quantized linear ``<name>`` (HF ``Linear.weight`` W of shape [N, K], out x in):

* ``<name>.weight_packed`` int32 [N, K/8]: 4-bit codes ``q + 8`` (q in -8..7), code of input
  feature ``8i + j`` in bits 4j..4j+3 of word i (compressed-tensors' ``pack_to_int32``).
* ``<name>.weight_scale`` [N, K/group] in the checkpoint's dtype (bfloat16).
* ``<name>.weight_shape`` int64 [2]: (N, K).
* ``W[n, k] = q[n, k] * weight_scale[n, k // group]``; scale = max|W over the group| / 7.5 (as
  compressed-tensors' symmetric minmax observer computes it), q = clamp(round(W / scale), -8, 7).

What is quantized (``--targets``):

* ``experts`` (default, what Kimi K2 Thinking ships): the routed experts' gate/up/down projections.
  Kept in BF16: attention (MLA's ``kv_b_proj`` is split into per-head absorbed matrices at load),
  the shared experts, the dense first layer's MLP, the router, embeddings and ``lm_head``.
* ``mlp``: the routed experts, the shared experts and the dense MLP linears (attention, router,
  embeddings and ``lm_head`` stay BF16). A linear whose shape SGLang's GPU kernel for W4A16
  linears (Marlin) cannot take (out_features % 64, in_features % 128) stays BF16 too and is named
  in ``ignore``, so that the checkpoint loads on a GPU as well.

The routed experts need the GPU MoE kernel's shapes (hidden % 128, moe_intermediate_size %
max(64, group)); the report says whether they have them (``experts_fit_gpu_moe_marlin``). CPUs
serve any shape whose in_features the group size divides.

SGLang reads this with ``CompressedTensorsConfig``: on CUDA the experts repack to Marlin
(``CompressedTensorsWNA16MoE``; ``--moe-runner-backend triton`` for the Triton kernel, which
accepts symmetric group 32/128), linears through ``CompressedTensorsWNA16``. On CPU kvguard's
``patches/int4_cpu_moe.py`` serves both.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import torch

from kvguard.kernels.w4a16_ref import PACK, pack_rows, quantize_rtn, unpack_rows

MOE_ARCHS = ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")  # the DSA indexer is self_attn
TARGETS = ("experts", "mlp")
DEFAULT_GROUP_SIZE = 32  # Kimi K2 Thinking's
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")

_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj$")
_SHARED = re.compile(r"^model\.layers\.\d+\.mlp\.shared_experts\.(gate|up|down)_proj$")
_DENSE = re.compile(r"^model\.layers\.\d+\.mlp\.(gate|up|down)_proj$")

# compressed-tensors matches these against SGLang's module names (``re:`` = regular expression);
# SGLang's fused names (gate_up_proj, fused_qkv_a_proj_with_mqa) are covered by the same rules.
IGNORE = {
    "experts": [
        "lm_head",
        r"re:.*self_attn.*",
        r"re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
    "mlp": ["lm_head", r"re:.*self_attn.*"],
}


class PackQuantizeError(ValueError):
    """The checkpoint or the settings cannot be written as pack-quantized W4A16."""


def marlin_linear_fits(weight: torch.Tensor) -> bool:
    """SGLang's Marlin W4A16 linear: out_features % 64 and in_features % 128 (marlin_utils)."""
    n, k = weight.shape
    return n % 64 == 0 and k % 128 == 0


def marlin_moe_fits(cfg: dict, group_size: int) -> bool:
    """SGLang's MoE Marlin kernel: hidden % 128, intermediate % max(64, group), group in
    32/64/128 (``check_moe_marlin_supports_layer``)."""
    return (
        cfg["hidden_size"] % 128 == 0
        and cfg["moe_intermediate_size"] % max(64, group_size) == 0
        and group_size in (32, 64, 128)
    )


def quantized_linears(tensors: dict[str, torch.Tensor], targets: str) -> list[str]:
    """Module names (``<name>.weight`` in ``tensors``) that ``targets`` quantizes, sorted. Under
    ``mlp``, non-expert linears the GPU linear kernel cannot take are left out."""
    if targets not in TARGETS:
        raise PackQuantizeError(f"--targets {targets!r}: choose one of {', '.join(TARGETS)}")
    rules = [_EXPERT] if targets == "experts" else [_EXPERT, _SHARED, _DENSE]
    names = sorted(
        key[: -len(".weight")]
        for key, t in tensors.items()
        if key.endswith(".weight")
        and any(r.match(key[: -len(".weight")]) for r in rules)
        and (_EXPERT.match(key[: -len(".weight")]) or marlin_linear_fits(t))
    )
    if not any(_EXPERT.match(n) for n in names):
        raise PackQuantizeError(
            "no routed expert weights (model.layers.<i>.mlp.experts.<e>.<gate|up|down>_proj"
            ".weight) in the checkpoint: not a DeepSeek-V3-architecture MoE layout"
        )
    return names


def check_group_size(tensors: dict[str, torch.Tensor], names: list[str], group_size: int) -> None:
    if group_size <= 0 or group_size % PACK:
        raise PackQuantizeError(f"--group-size must be a positive multiple of {PACK}")
    bad = [
        f"{n} (in_features {tensors[n + '.weight'].shape[1]})"
        for n in names
        if tensors[n + ".weight"].shape[1] % group_size
    ]
    if bad:
        raise PackQuantizeError(
            f"group size {group_size} does not divide the in_features of {len(bad)} layer(s): "
            + "; ".join(bad[:4])
            + ("; ..." if len(bad) > 4 else "")
        )


def pack_weight(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One linear's W [N, K] -> its three pack-quantized tensors (scales in W's dtype)."""
    n, k = weight.shape
    codes, _zeros, scales = quantize_rtn(
        weight.t().to(torch.float32), group_size, sym=True, scale_dtype=weight.dtype
    )  # codes [K, N] = q + 8, scales [G, N]
    return {
        "weight_packed": pack_rows(codes).t().contiguous(),
        "weight_scale": scales.t().to(weight.dtype).contiguous(),
        "weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }


def unpack_weight(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 W [N, K] three pack-quantized tensors encode (the reference for tests)."""
    codes = unpack_rows(packed.t().contiguous()).t()  # [N, K] in 0..15
    group = torch.arange(codes.shape[1]) // group_size
    return ((codes - 8).to(torch.float32) * scale.to(torch.float32)[:, group]).contiguous()


def quantization_config(group_size: int, targets: str, keep: list[str] | None = None) -> dict:
    """``quantization_config`` as a compressed-tensors W4A16 checkpoint (Kimi K2 Thinking) has
    it; ``keep``: further module names left in BF16."""
    return {
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": group_size,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                },
            }
        },
        "format": "pack-quantized",
        "ignore": list(IGNORE[targets]) + sorted(keep or []),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def quantize_moe_checkpoint(
    model: Path,
    out: Path,
    cfg: dict,
    tensors: dict[str, torch.Tensor],
    group_size: int = DEFAULT_GROUP_SIZE,
    targets: str = "experts",
    log=print,
) -> dict:
    """Write the pack-quantized checkpoint to ``out``; returns the report (quant_report.json)."""
    names = quantized_linears(tensors, targets)
    check_group_size(tensors, names, group_size)
    rules = [_EXPERT] if targets == "experts" else [_EXPERT, _SHARED, _DENSE]
    keep = sorted(  # MLP linears of the targets left BF16 for the GPU kernel's shapes
        key[: -len(".weight")]
        for key in tensors
        if key.endswith(".weight")
        and any(r.match(key[: -len(".weight")]) for r in rules)
        and key[: -len(".weight")] not in names
    )
    t0 = time.time()
    result: dict[str, torch.Tensor] = {}
    quantized = set(names)
    src_bytes = q_bytes = 0
    for key, t in tensors.items():
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base in quantized:
            src_bytes += t.numel() * t.element_size()
            for suffix, qt in pack_weight(t, group_size).items():
                result[f"{base}.{suffix}"] = qt
                q_bytes += qt.numel() * qt.element_size()
        else:
            result[key] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in model.iterdir():  # tokenizer, generation config, ... (not weights, not config.json)
        if (
            f.is_file()
            and f.name not in ("config.json", "quant_report.json", "build_report.json")
            and not f.name.startswith("model.safetensors")
            and f.suffix not in (".bin", ".pt", ".gguf")
        ):
            shutil.copy2(f, out / f.name)
    cfg = dict(cfg, quantization_config=quantization_config(group_size, targets, keep))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    all_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    report = {
        "source": str(model),
        "format": "compressed-tensors pack-quantized W4A16 (symmetric int4, group)",
        "method": "rtn",
        "group_size": group_size,
        "targets": targets,
        "layers_quantized": len(names),
        "kept_bf16_for_gpu_linear_kernel": keep,
        "experts_fit_gpu_moe_marlin": marlin_moe_fits(cfg, group_size),
        "quantized_weight_bytes_source": src_bytes,
        "quantized_weight_bytes_int4": q_bytes,
        "ratio": q_bytes / max(src_bytes, 1),
        "checkpoint_tensor_bytes_source": all_bytes,
        "checkpoint_tensor_bytes_int4": sum(t.numel() * t.element_size() for t in result.values()),
        "seconds": round(time.time() - t0, 2),
    }
    (out / "quant_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(
        f"wrote {out}: {len(names)} linears ({targets}), pack-quantized W4A16 group {group_size}, "
        f"their weights {src_bytes} -> {q_bytes} bytes ({report['ratio']:.3f}x)"
    )
    return report

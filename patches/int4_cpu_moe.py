"""INT4 W4A16 compressed-tensors checkpoints (``pack-quantized``, symmetric int4, group; what Kimi
K2 Thinking ships and ``kvguard.quant.quantize`` writes for MoE models) on a CPU without AMX.

SGLang 0.5.23 loads such a checkpoint with ``CompressedTensorsConfig``. Its MoE scheme
(``CompressedTensorsWNA16MoE``) creates the experts' parameters and their weight loaders (which
recognise the scheme by its class name), then repacks them for Marlin, a CUDA kernel (on CPU the
JIT build of ``gptq_marlin_repack`` fails); its linear scheme (``CompressedTensorsWNA16``) is
only built after asking ``torch.cuda.get_device_capability()``. There is no CPU path. On CPU the
hooks here keep SGLang's scheme objects, parameters and loading, and replace what runs after it
(on CUDA every hook calls SGLang's code unchanged):

* Experts: after loading, each expert's codes are repacked once for torch's own INT4 CPU GEMM
  (``aten._weight_int4pack_mm_for_cpu``: uint8 [N, K/2] + [G, N, 2] scale/offset,
  ``moe_process_weights``); no Marlin runner is made (``moe_create_runner``); the forward
  (``moe_apply``) is SGLang's ``moe_forward_native`` (what unquantized MoE runs on CPU: tokens
  sorted by expert, one gate_up GEMM, SiLU-and-mul, one down GEMM per expert, weighted sum over
  the top-k) with those INT4 GEMMs.
* Linears (``--targets mlp``): SGLang's own ``CompressedTensorsWNA16`` without the CUDA check
  (``around_get_linear_scheme``), the same repack and GEMM (``linear_process_weights``,
  ``linear_apply``).
* Rows a checkpoint does not fill (SGLang pads intermediate sizes on CPU) are allocated
  uninitialized; ``fill_zero_codes`` makes them decode to weight 0 (every code 8).

The packed layout SGLang loads (checkpoint ``weight_packed`` [N, K/8] transposed by the loader):
int32 [K/8, N], code of row 8i + j in bits 4j..4j+3 of word i, code = q + 8, weight = q * scale.
That is GPTQ's ``qweight`` layout with zero 8, so ``kvguard.kernels.w4a16_ref`` unpacks it.
Output rows (N) that are not a multiple of 16 (torch's INT4 kernel needs it) keep the packed
codes and are dequantized per call instead.
"""

from __future__ import annotations

import structlog
import torch

from kvguard.kernels.w4a16_ref import unpack_rows

log = structlog.get_logger("kvguard")

INT4PACK_GROUP_SIZES = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu accepts
_CODE_ZERO_WORD = -2004318072  # int32 0x88888888: eight codes 8, i.e. weight 0


class Int4MoEConfigError(ValueError):
    """A compressed-tensors INT4 checkpoint this CPU path cannot serve."""


def _on_cpu() -> bool:
    return not torch.cuda.is_available()


def _check_scheme(num_bits: int, symmetric: bool, strategy: str, group_size: int, actorder):
    if num_bits != 4 or not symmetric or strategy != "group" or actorder not in (None, "static"):
        raise Int4MoEConfigError(
            "compressed-tensors W4A16 on CPU: symmetric 4-bit group quantization without "
            f"activation reordering only (got num_bits={num_bits}, symmetric={symmetric}, "
            f"strategy={strategy!r}, actorder={actorder!r})"
        )
    if group_size <= 0 or group_size % 8:
        raise Int4MoEConfigError(f"compressed-tensors W4A16 on CPU: group size {group_size}")


# -- the INT4 GEMM ----------------------------------------------------------------------------------
class Int4Weight:
    """One [N, K] weight: torch's INT4 CPU GEMM when it applies, else packed codes dequantized
    per call. ``packed`` int32 [K/8, N] (codes q + 8), ``scales`` [G, N]."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, group_size: int):
        self.k, self.n = packed.shape[0] * 8, packed.shape[1]
        self.group_size = group_size
        self.dtype = scales.dtype
        self.int4pack = (
            group_size in INT4PACK_GROUP_SIZES
            and self.n % 16 == 0
            and self.k % group_size == 0
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        )
        if self.int4pack:
            codes = unpack_rows(packed).t().contiguous()  # [N, K] in 0..15
            self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            s = scales.to(torch.float32)
            # the kernel computes (code - 8) * scale + offset: symmetric int4 has offset 0
            self.scale_offset = torch.stack([s, torch.zeros_like(s)], dim=-1).to(self.dtype)
        else:
            self.weight, self.scale = packed.contiguous(), scales.contiguous()

    def nbytes(self) -> int:
        if self.int4pack:
            return self.weight.nbytes + self.scale_offset.nbytes
        return self.weight.nbytes + self.scale.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for x [M, K] in the scales' dtype."""
        if x.dtype != self.dtype:
            raise Int4MoEConfigError(
                f"W4A16 on CPU: activations are {x.dtype}, scales {self.dtype}; serve with "
                "--dtype matching the checkpoint"
            )
        if self.int4pack:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), self.weight, self.group_size, self.scale_offset
            )
        codes = unpack_rows(self.weight)  # [K, N]
        group = torch.arange(self.k) // self.group_size
        w = (codes - 8).to(torch.float32) * self.scale.to(torch.float32)[group]
        return (x.to(torch.float32) @ w).to(x.dtype)


# -- CompressedTensorsWNA16MoE.create_weights / CompressedTensorsWNA16.create_weights (AFTER) ----------
def fill_zero_codes(result, scheme, layer, *args, **kwargs):
    if _on_cpu():
        for name in ("w13_weight_packed", "w2_weight_packed", "weight_packed"):
            if hasattr(layer, name):
                getattr(layer, name).data.fill_(_CODE_ZERO_WORD)
    return result


# -- CompressedTensorsWNA16MoE: experts -------------------------------------------------------------
def moe_process_weights(original, scheme, layer, *args, **kwargs):
    if not _on_cpu():
        return original(scheme, layer, *args, **kwargs)
    if getattr(layer, "int4_cpu_experts", None) is not None:
        return None
    _check_scheme(scheme.num_bits, scheme.sym, scheme.strategy, scheme.group_size, scheme.actorder)
    if getattr(layer, "moe_ep_size", 1) > 1:
        raise Int4MoEConfigError("W4A16 MoE on CPU: expert parallelism is not supported")
    g = scheme.group_size
    experts = []
    for e in range(layer.w13_weight_packed.shape[0]):
        w13 = Int4Weight(layer.w13_weight_packed.data[e], layer.w13_weight_scale.data[e], g)
        w2 = Int4Weight(layer.w2_weight_packed.data[e], layer.w2_weight_scale.data[e], g)
        experts.append((w13, w2))
    layer.int4_cpu_experts = experts
    for name in ("w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale"):
        delattr(layer, name)  # the repacked copies replace them
    log.info(
        "kvguard_int4_cpu_moe",
        experts=len(experts),
        group_size=g,
        int4_gemm=all(w.int4pack for pair in experts for w in pair),
        bytes=sum(w.nbytes() for pair in experts for w in pair),
    )
    return None


def moe_create_runner(original, scheme, layer, moe_runner_config, *args, **kwargs):
    if not _on_cpu():
        return original(scheme, layer, moe_runner_config, *args, **kwargs)
    scheme.moe_runner_config = moe_runner_config  # what apply_weights reads; no Marlin runner
    return None


def moe_apply(original, scheme, layer, dispatch_output, *args, **kwargs):
    if not _on_cpu():
        return original(scheme, layer, dispatch_output, *args, **kwargs)
    from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput

    cfg = scheme.moe_runner_config
    if cfg.apply_router_weight_on_input or cfg.activation != "silu" or cfg.gemm1_alpha is not None:
        raise Int4MoEConfigError(
            "W4A16 MoE on CPU: SiLU experts with router weights on the output only"
        )
    x = dispatch_output.hidden_states
    topk_weights, topk_ids, _ = dispatch_output.topk_output
    out = moe_forward_int4(x, topk_weights, topk_ids, layer.int4_cpu_experts)
    return StandardCombineInput(hidden_states=out)


def moe_forward_int4(x, topk_weights, topk_ids, experts) -> torch.Tensor:
    """SGLang's ``moe_forward_native`` with each expert's two GEMMs in INT4."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = flat.argsort()
    sorted_tokens = x[order // top_k]
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    outputs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        w13, w2 = experts[e]
        gate_up = w13.matmul(sorted_tokens[start : start + n])
        d = gate_up.shape[-1] // 2
        hidden = torch.nn.functional.silu(gate_up[:, :d]) * gate_up[:, d:]
        outputs.append(w2.matmul(hidden))
        start += n
    out = torch.cat(outputs) if outputs else sorted_tokens.new_empty(0, x.shape[-1])
    unsorted = torch.empty_like(out)
    unsorted[order] = out
    return (
        unsorted.view(*topk_ids.shape, -1)
        .type(topk_weights.dtype)
        .mul_(topk_weights.unsqueeze(-1))
        .sum(dim=1)
        .type(x.dtype)
    )


# -- CompressedTensorsConfig.get_linear_scheme (AROUND) ------------------------------------------------
def around_get_linear_scheme(original, config, layer, layer_name=None, *args, **kwargs):
    if not _on_cpu():
        return original(config, layer, layer_name, *args, **kwargs)
    scheme_dict = config.get_scheme_dict(layer, layer_name, *args, **kwargs)
    weights = (scheme_dict or {}).get("weights")
    if (
        weights is None
        or scheme_dict.get("input_activations") is not None
        or config.quant_format != "pack-quantized"
        or weights.type != "int"
    ):
        return original(config, layer, layer_name, *args, **kwargs)
    _check_scheme(
        weights.num_bits, weights.symmetric, weights.strategy, weights.group_size, weights.actorder
    )
    from sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16 import (
        CompressedTensorsWNA16,
    )

    # SGLang's own scheme (parameters, loaders), without its CUDA capability check
    return CompressedTensorsWNA16(
        strategy=weights.strategy,
        num_bits=weights.num_bits,
        group_size=weights.group_size,
        symmetric=weights.symmetric,
        actorder=weights.actorder,
    )


# -- CompressedTensorsWNA16: linears ------------------------------------------------------------------
def linear_process_weights(original, scheme, layer, *args, **kwargs):
    if not _on_cpu():
        return original(scheme, layer, *args, **kwargs)
    # checkpoint layout [N, K/8] (packed along K) -> [K/8, N]; scales [N, G] -> [G, N]
    packed = layer.weight_packed.data.t().contiguous()
    scales = layer.weight_scale.data.t().contiguous()
    layer.int4_cpu_weight = Int4Weight(packed, scales, scheme.group_size)
    del layer.weight_packed, layer.weight_scale
    return None


def linear_apply(original, scheme, layer, x, bias=None, *args, **kwargs):
    if not _on_cpu():
        return original(scheme, layer, x, bias, *args, **kwargs)
    w = layer.int4_cpu_weight
    y = w.matmul(x.reshape(-1, w.k))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], w.n)

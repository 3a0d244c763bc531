"""INT4 (W4A16) GPTQ checkpoints on CPUs without Intel AMX, and on GPUs SGLang has no kernel for.

SGLang 0.5.23 routes ``quant_method: gptq`` on CPU to ``CPUGPTQConfig``, whose linear scheme
(``GPTQIntelAMXLinearScheme``) creates the checkpoint's parameters (qweight, qzeros, scales,
g_idx, with the tensor-parallel weight loaders) and then hands them to a *kernel* object chosen
by ``_init_kernel``: AMX-only (``sgl_kernel.int4_scaled_mm_cpu``). On CUDA, the plain GPTQ
scheme's ``_init_kernel`` raises ("non-Marlin GPTQ CUDA kernel has been removed"), which is what
non-Marlin GPUs and ``--quantization gptq`` reach. The hooks here swap in
``W4A16LinearKernel`` at exactly that seam; parameter creation and loading stay SGLang's.
``CPUGPTQConfig.get_quant_method`` also ignores GPTQ's per-module ``dynamic`` overrides (e.g. a
smaller group size for layers the default one does not divide, as ``serve/quantize.py
--fallback-group-size`` writes); ``around_cpu_get_quant_method`` routes such configs through
SGLang's own per-module override helper, as the CUDA GPTQ config does.

``W4A16LinearKernel`` after loading, per layer:
* CPU, group size 32/64/128/256: repack once for torch's own INT4 CPU GEMM
  (``aten._weight_int4pack_mm_for_cpu``: uint8 [N, K/2] + [G, N, 2] scale/offset in the
  activation dtype, computing ``(q - 8) * scale + offset``, so ``offset = (8 - zero) * scale``).
* otherwise (other group sizes; CUDA): keep the GPTQ tensors and call
  ``kvguard.kernels.w4a16.w4a16_matmul`` (Triton on CUDA, dequantize-and-matmul on CPU).
"""

from __future__ import annotations

import structlog
import torch

from kvguard.kernels.w4a16 import w4a16_matmul
from kvguard.kernels.w4a16_ref import check_gptq_shapes, unpack_cols, unpack_rows

log = structlog.get_logger("kvguard")

INT4PACK_GROUP_SIZES = (32, 64, 128, 256)  # what aten._weight_int4pack_mm_for_cpu accepts


class Int4ConfigError(ValueError):
    """A GPTQ checkpoint this kernel cannot serve."""


def _has_int4pack_cpu() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


class W4A16LinearKernel:
    """Kernel object for SGLang's GPTQ linear schemes (``process_weights_after_loading``, ``apply``)."""

    def __init__(self, quant_config):
        if quant_config.weight_bits != 4:
            raise Int4ConfigError(
                f"W4A16 kernel: 4-bit GPTQ only, got {quant_config.weight_bits} bits"
            )
        if quant_config.group_size == -1:
            raise Int4ConfigError(
                "W4A16 kernel: per-channel GPTQ (group_size -1) is not supported; "
                "quantize with a group size (e.g. 128)"
            )
        self.quant_config = quant_config
        self.group_size = quant_config.group_size
        self.zero_offset = 0 if quant_config.checkpoint_format == "gptq_v2" else 1
        self.use_shuffle = True  # set by GPTQLinearScheme.create_weights; unused here

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        qweight, qzeros, scales = layer.qweight.data, layer.qzeros.data, layer.scales.data
        try:
            k, n = check_gptq_shapes(qweight, qzeros, scales, self.group_size)
        except ValueError as e:
            raise Int4ConfigError(f"GPTQ tensors of {type(layer).__name__}: {e}") from None
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None:
            self._check_g_idx(g_idx.data, scales, k)
            del layer.g_idx
        use_int4pack = (
            qweight.device.type == "cpu"
            and self.group_size in INT4PACK_GROUP_SIZES
            and k % self.group_size == 0
            and _has_int4pack_cpu()
        )
        layer.w4a16_int4pack = use_int4pack
        layer.w4a16_shape = (k, n)
        if not use_int4pack:
            for name in ("qweight", "qzeros", "scales"):
                setattr(
                    layer, name, torch.nn.Parameter(getattr(layer, name).data, requires_grad=False)
                )
            return
        codes = unpack_rows(qweight).t().contiguous()  # [N, K] in 0..15
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        zeros = unpack_cols(qzeros) + self.zero_offset  # [G, N]
        s = scales.to(torch.float32)
        scale_offset = torch.stack([s, (8 - zeros).to(torch.float32) * s], dim=-1)
        del layer.qweight, layer.qzeros, layer.scales
        layer.int4_weight = torch.nn.Parameter(packed, requires_grad=False)
        layer.int4_scale_offset = torch.nn.Parameter(
            scale_offset.to(scales.dtype).contiguous(), requires_grad=False
        )

    def _check_g_idx(self, g_idx: torch.Tensor, scales: torch.Tensor, k: int) -> None:
        """g_idx must be k // group_size (no act-order). Rows SGLang padded (on CPU it pads
        intermediate sizes, e.g. 688 -> 768, and zeroes the padding) may read 0: their groups
        have zero scales, so they decode to zero weights whatever their g_idx."""
        want = torch.arange(k, device=g_idx.device) // self.group_size
        bad = (g_idx.to(torch.int64) != want).nonzero().flatten()
        if bad.numel() and not bool((scales[want[bad]] == 0).all()):
            raise Int4ConfigError(
                f"W4A16 kernel: g_idx of a layer with in_features {k} is not k // "
                f"{self.group_size} (first mismatch at row {int(bad[0])}): act-order (desc_act) "
                "GPTQ checkpoints are not supported; quantize with desc_act false"
            )

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        if not layer.w4a16_int4pack:
            return w4a16_matmul(
                x,
                layer.qweight,
                layer.qzeros,
                layer.scales,
                self.group_size,
                self.zero_offset,
                bias,
            )
        k, n = layer.w4a16_shape
        x2 = x.reshape(-1, k)
        if x2.dtype != layer.int4_scale_offset.dtype:
            raise Int4ConfigError(
                f"W4A16 CPU kernel: activations are {x2.dtype}, scales "
                f"{layer.int4_scale_offset.dtype}; serve with --dtype matching"
            )
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2.contiguous(), layer.int4_weight, self.group_size, layer.int4_scale_offset
        )
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], n)


# -- GPTQIntelAMXLinearScheme._init_kernel (AROUND): SGLang's CPU GPTQ scheme -----------------------
def around_cpu_init_kernel(original, scheme, quant_config):
    from sglang.srt.utils.common import cpu_has_amx_support

    if cpu_has_amx_support():
        return original(scheme, quant_config)  # SGLang's AMX kernel
    return W4A16LinearKernel(quant_config)


# -- GPTQLinearScheme._init_kernel (AROUND): plain GPTQ on CUDA, whose kernel SGLang removed ----------
def around_init_kernel(original, scheme, quant_config):
    try:
        return original(scheme, quant_config)
    except RuntimeError:
        if not torch.cuda.is_available():
            raise
        log.info("kvguard_w4a16_triton", reason="no non-Marlin GPTQ kernel in SGLang")
        return W4A16LinearKernel(quant_config)


# -- CPUGPTQConfig.get_quant_method (AROUND): honour GPTQ "dynamic" per-module overrides on CPU -------
def around_cpu_get_quant_method(original, config, layer, prefix="", *args, **kwargs):
    if not getattr(config, "dynamic", None):
        return original(config, layer, prefix, *args, **kwargs)
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.gptq.gptq import GPTQLinearMethod
    from sglang.srt.layers.quantization.utils import get_linear_quant_method

    if not isinstance(layer, LinearBase):
        return original(config, layer, prefix, *args, **kwargs)
    # a per-module copy of the config with the overrides applied (or an unquantized method for
    # "-:" rules); the layer's scheme is then built from that copy in create_weights
    return get_linear_quant_method(config, layer, prefix=prefix, linear_method_cls=GPTQLinearMethod)

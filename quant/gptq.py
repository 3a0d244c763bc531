"""GPTQ (Frantar et al., 2022, arXiv:2210.17323) for one linear layer, and the calibration pass
that feeds it, for Hugging Face Llama models on CPU.

``gptq_quantize(weight, hessian, group_size)`` quantizes W [N, K] (HF ``Linear.weight``) column by
column in K, pushing each column's rounding error onto the not yet quantized columns through
the inverse Hessian of the layer's inputs (H = 2 X^T X), in blocks ("lazy batch" updates).
Symmetric 4-bit, one scale per (group of ``group_size`` input features, output feature),
no act-order (desc_act false), groups computed from the error-updated weights when the group's
first column is reached (static_groups false). Output: the same (codes, zeros, scales) triple as
``kvguard.kernels.w4a16_ref.quantize_rtn``.

``calibrate_and_quantize(model, batches, group_sizes)`` runs the usual sequential order: within
each decoder layer [q,k,v], [o], [gate,up], [down]; every group sees inputs produced by the
already-quantized parts of the model (true_sequential). Inputs are captured by re-running the
model on the calibration batches and stopping at the group (a few dozen small forwards).
"""

from __future__ import annotations

import contextlib

import torch

from kvguard.kernels.w4a16_ref import group_params

SEQUENTIAL_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    damp: float = 0.01,
    block: int = 128,
):
    """GPTQ of W [N, K] given H [K, K]. Returns (codes int32 [K, N], zeros int32 [G, N],
    scales float32 [G, N]) in the GPTQ checkpoint orientation (K first)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {k}")
    w = weight.detach().to(torch.float64).clone()
    h = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    block = group_size * max(1, -(-block // group_size))  # a multiple of group_size: no straddling
    codes = torch.zeros(n, k, dtype=torch.int32)
    scales = torch.zeros(k // group_size, n, dtype=torch.float32)
    zeros = torch.zeros(k // group_size, n, dtype=torch.int32)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:
                grp = w1[:, i : i + group_size].t().unsqueeze(0).to(torch.float32)  # [1, gs, N]
                s, z = group_params(grp, sym=True)
                g = col // group_size
                scales[g], zeros[g] = s[0], z[0].to(torch.int32)
                s64, z64 = s[0].to(torch.float64), z[0].to(torch.float64)
            q = torch.clamp(torch.round(w1[:, i] / s64) + z64, 0, 15)
            codes[:, col] = q.to(torch.int32)
            dq = (q - z64) * s64
            e = (w1[:, i] - dq) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return codes.t().contiguous(), zeros, scales


class _Stop(Exception):
    pass


def _hessians(model, modules: list[torch.nn.Module], batches: list[torch.Tensor]) -> torch.Tensor:
    """H = 2/n sum X^T X of the input shared by ``modules`` (one capture, first module)."""
    k = modules[0].in_features
    state = {"h": torch.zeros(k, k, dtype=torch.float64), "n": 0}

    def capture(_mod, args):
        x = args[0].detach().reshape(-1, k).to(torch.float64)
        state["h"] += 2.0 * x.t() @ x
        state["n"] += x.shape[0]
        raise _Stop

    handle = modules[0].register_forward_pre_hook(capture)
    try:
        with torch.no_grad():
            for ids in batches:
                with contextlib.suppress(_Stop):  # the hook stops the forward once it has its input
                    model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return state["h"] / max(state["n"], 1)


def calibrate_and_quantize(
    model, batches: list[torch.Tensor], group_sizes: dict[str, int], damp: float = 0.01, log=print
) -> dict[str, tuple]:
    """Sequential GPTQ over a float32 HF Llama ``model``; ``group_sizes`` maps module names
    (``model.layers.0.mlp.down_proj``) to their group size. Returns {module name: (codes, zeros,
    scales)}; the model's linear weights are replaced by their dequantized values on the way."""
    layers = model.model.layers
    out: dict[str, tuple] = {}
    for li, layer in enumerate(layers):
        for names in SEQUENTIAL_GROUPS:
            mods = [layer.get_submodule(n) for n in names]
            h = _hessians(model, mods, batches)
            for name, mod in zip(names, mods):
                full = f"model.layers.{li}.{name}"
                group_size = group_sizes[full]
                codes, zeros, scales = gptq_quantize(mod.weight, h, group_size, damp)
                group = torch.arange(codes.shape[0]) // group_size
                deq = (codes - zeros[group]).to(torch.float32) * scales[group]  # [K, N]
                with torch.no_grad():
                    before = mod.weight.detach().to(torch.float64)
                    mod.weight.copy_(deq.t().to(mod.weight.dtype))
                out[full] = (codes, zeros, scales)
                rel = float((deq.t().double() - before).norm() / before.norm().clamp_min(1e-12))
                log(f"gptq {full}: K={codes.shape[0]} N={codes.shape[1]} weight rel. err {rel:.4f}")
    return out

"""INT4 weights: quant/quantize.py (RTN and GPTQ -> GPTQ checkpoint), quant/gptq.py, the CPU
linear kernel patched into SGLang (patches/int4_cpu_linear.py), and quantize -> serve end to end."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from quant_helpers import (  # noqa: E402
    agreement,
    hf_greedy,
    prompt_ids,
    sglang_engine,
    sglang_greedy,
    tiny_trained_model,
)

from kvguard.kernels import w4a16_ref as ref  # noqa: E402
from kvguard.patches.int4_cpu_linear import Int4ConfigError, W4A16LinearKernel  # noqa: E402
from kvguard.quant import quantize as Q  # noqa: E402
from kvguard.quant.gptq import gptq_quantize  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


# ------------------------------------------------------------------------ the CPU linear kernel
def _layer(k, n, gs, zero_offset=1, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    codes, zeros, scales = ref.quantize_rtn(torch.randn(k, n, generator=g), gs, sym=False)
    layer = torch.nn.Module()
    p = lambda t: torch.nn.Parameter(t, requires_grad=False)
    layer.qweight = p(ref.pack_rows(codes))
    layer.qzeros = p(ref.pack_cols(zeros - zero_offset))
    layer.scales = p(scales.to(dtype))  # SGLang creates scales in the model dtype
    layer.g_idx = p(torch.arange(k, dtype=torch.int32) // gs)
    want = (layer.qweight.data.clone(), layer.qzeros.data.clone(), layer.scales.data.clone())
    return layer, want


def _cfg(gs, fmt="gptq", bits=4):
    return SimpleNamespace(weight_bits=bits, group_size=gs, checkpoint_format=fmt, desc_act=False)


@pytest.mark.parametrize("gs,fmt", [(32, "gptq"), (64, "gptq_v2"), (128, "gptq"), (16, "gptq")])
def test_cpu_kernel_matches_reference(gs, fmt):
    k, n = 256, 96
    offset = 0 if fmt == "gptq_v2" else 1
    layer, (qw, qz, s) = _layer(k, n, gs, offset)
    kernel = W4A16LinearKernel(_cfg(gs, fmt))
    kernel.process_weights_after_loading(layer)
    assert layer.w4a16_int4pack == (gs in (32, 64, 128, 256))
    assert not hasattr(layer, "g_idx")
    x = torch.randn(2, 3, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16)
    got = kernel.apply(layer, x, bias)
    want = ref.w4a16_matmul_ref(x, qw, qz, s, gs, offset, bias)
    assert got.shape == (2, 3, n) and got.dtype == torch.bfloat16
    if layer.w4a16_int4pack:  # torch's INT4 GEMM: bf16 arithmetic inside
        err = (got.float() - want.float()).abs().max() / want.float().abs().max()
        assert float(err) < 1e-2
    else:  # dequantize-and-matmul: the reference itself
        assert torch.equal(got, want)


@pytest.mark.parametrize("k_real,k_padded,gs", [(80, 96, 16), (64, 128, 32)])
def test_cpu_kernel_accepts_sglang_padding(k_real, k_padded, gs):
    """On CPU SGLang pads intermediate sizes (688 -> 768 for the default model) and zeroes the
    padded rows of every parameter, g_idx included: those rows must decode to zero weights."""
    n = 48
    layer, (qw, qz, s) = _layer(k_real, n, gs)
    pad_rows = (k_padded - k_real) // 8, (k_padded - k_real) // gs
    layer.qweight.data = torch.cat([qw, torch.zeros(pad_rows[0], n, dtype=torch.int32)])
    layer.qzeros.data = torch.cat([qz, torch.zeros(pad_rows[1], n // 8, dtype=torch.int32)])
    layer.scales.data = torch.cat([s, torch.zeros(pad_rows[1], n, dtype=s.dtype)])
    layer.g_idx.data = torch.cat(
        [layer.g_idx.data, torch.zeros(k_padded - k_real, dtype=torch.int32)]
    )
    kernel = W4A16LinearKernel(_cfg(gs))
    kernel.process_weights_after_loading(layer)
    x = torch.randn(3, k_padded).to(torch.bfloat16)
    got = kernel.apply(layer, x)
    want = ref.w4a16_matmul_ref(x[:, :k_real], qw, qz, s, gs)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert float(err) < 1e-2


def test_cpu_kernel_rejects_what_it_cannot_serve():
    with pytest.raises(Int4ConfigError, match="4-bit"):
        W4A16LinearKernel(_cfg(128, bits=8))
    with pytest.raises(Int4ConfigError, match="per-channel"):
        W4A16LinearKernel(_cfg(-1))
    layer, _ = _layer(64, 16, 32)
    layer.g_idx.data = layer.g_idx.data.flip(0)  # act-order permutation
    with pytest.raises(Int4ConfigError, match="desc_act"):
        W4A16LinearKernel(_cfg(32)).process_weights_after_loading(layer)
    layer, _ = _layer(64, 16, 32)
    with pytest.raises(Int4ConfigError, match="group_size 48"):
        W4A16LinearKernel(_cfg(48)).process_weights_after_loading(layer)


# ------------------------------------------------------------------------------------ GPTQ solver
def test_gptq_beats_rtn_on_correlated_inputs():
    g = torch.Generator().manual_seed(5)
    k, n, gs = 128, 48, 32
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(2048, k, generator=g) @ mix  # correlated features, like real activations
    w = torch.randn(n, k, generator=g) * 0.05
    h = 2 * x.double().t() @ x.double() / x.shape[0]
    codes, zeros, scales = gptq_quantize(w, h, gs)
    group = torch.arange(k) // gs
    deq_gptq = (codes - zeros[group]).float() * scales[group]  # [K, N]
    c2, z2, s2 = ref.quantize_rtn(w.t(), gs)
    deq_rtn = (c2 - z2[group]).float() * s2[group]
    err = lambda d: float((x @ d - x @ w.t()).norm())
    assert err(deq_gptq) < 0.8 * err(deq_rtn)
    assert bool((zeros == 8).all()) and int(codes.min()) >= 0 and int(codes.max()) <= 15


# ---------------------------------------------------------------------------- quantize: errors
@pytest.fixture(scope="module")
def model_dir():
    return tiny_trained_model()


def _copy_ckpt(src, dst, edit=None):
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    if edit:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_quantize_clear_errors(model_dir, tmp_path):
    with pytest.raises(
        Q.QuantizeError, match=r"group size 128 does not divide .*\[8, 16, 32, 64\]"
    ):
        Q.quantize_checkpoint(model_dir, tmp_path / "a", group_size=128)
    with pytest.raises(Q.QuantizeError, match="multiple of 8"):
        Q.quantize_checkpoint(model_dir, tmp_path / "b", group_size=12)
    with pytest.raises(Q.QuantizeError, match="per-channel"):
        Q.quantize_checkpoint(model_dir, tmp_path / "c", group_size=-1)
    with pytest.raises(Q.QuantizeError, match="unknown --method"):
        Q.quantize_checkpoint(model_dir, tmp_path / "d", method="awq")
    quantized = _copy_ckpt(
        model_dir, tmp_path / "q", lambda c: c.update(quantization_config={"quant_method": "awq"})
    )
    with pytest.raises(Q.QuantizeError, match="already quantized"):
        Q.quantize_checkpoint(quantized, tmp_path / "e")
    gpt2 = _copy_ckpt(
        model_dir, tmp_path / "g", lambda c: c.update(architectures=["GPT2LMHeadModel"])
    )
    with pytest.raises(Q.QuantizeError, match="unsupported architecture"):
        Q.quantize_checkpoint(gpt2, tmp_path / "f")
    pickled = _copy_ckpt(model_dir, tmp_path / "p")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(Q.QuantizeError, match="convert to safetensors"):
        Q.quantize_checkpoint(pickled, tmp_path / "h")
    assert (
        Q.main(["--model", str(model_dir), "--out", str(tmp_path / "i"), "--group-size", "128"])
        == 2
    )


def test_rtn_checkpoint_layout(model_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "int4"
    report = Q.quantize_checkpoint(model_dir, out, group_size=32, method="rtn")
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert (
        qc["quant_method"],
        qc["bits"],
        qc["group_size"],
        qc["sym"],
        qc["desc_act"],
        qc["checkpoint_format"],
    ) == ("gptq", 4, 32, True, False, "gptq")
    assert (out / "tokenizer.json").is_file()
    src, dst = (
        load_file(str(model_dir / "model.safetensors")),
        load_file(str(out / "model.safetensors")),
    )
    name = "model.layers.1.mlp.down_proj"
    assert f"{name}.weight" not in dst and dst[f"{name}.qweight"].dtype == torch.int32
    assert dst[f"{name}.scales"].dtype == torch.float16
    w = src[f"{name}.weight"].float().t()  # [K, N]
    deq = ref.dequantize(dst[f"{name}.qweight"], dst[f"{name}.qzeros"], dst[f"{name}.scales"], 32)
    step = dst[f"{name}.scales"].float()[torch.arange(w.shape[0]) // 32]
    assert bool(((deq - w).abs() <= step).all())
    assert torch.equal(dst["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert report["layers_quantized"] == 2 * 7 and report["ratio"] < 0.4


def test_fallback_group_size_writes_dynamic_overrides(model_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "mixed"  # TINY: attention and gate/up have in_features 64, down_proj 128
    report = Q.quantize_checkpoint(
        model_dir, out, group_size=128, fallback_group_size=32, log=lambda *a: None
    )
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 128 and qc["dynamic"] == report["group_size_overrides"]
    import re

    def group_of(module):  # what SGLang's get_dynamic_override resolves for a module name
        for pat, over in qc["dynamic"].items():
            if re.match(pat.removeprefix("+:"), module):
                return over["group_size"]
        return qc["group_size"]

    assert group_of("model.layers.1.self_attn.qkv_proj") == 32  # SGLang's fused name
    assert group_of("model.layers.0.self_attn.o_proj") == 32
    assert group_of("model.layers.0.mlp.gate_up_proj") == 32
    assert group_of("model.layers.1.mlp.down_proj") == 128
    t = load_file(str(out / "model.safetensors"))
    assert t["model.layers.0.self_attn.q_proj.scales"].shape[0] == 64 // 32
    assert t["model.layers.0.mlp.down_proj.scales"].shape[0] == 128 // 128
    with pytest.raises(Q.QuantizeError, match=r"fallback 48"):
        Q.quantize_checkpoint(model_dir, tmp_path / "x", group_size=128, fallback_group_size=48)


def test_gptq_method_end_to_end(model_dir, tmp_path):
    out = tmp_path / "gptq"
    report = Q.quantize_checkpoint(
        model_dir, out, group_size=32, method="gptq", num_samples=8, seq_len=32, log=lambda *a: None
    )
    assert report["method"] == "gptq" and report["calib_samples"] == 8
    assert json.loads((out / "config.json").read_text())["quantization_config"]["meta"][
        "quantizer"
    ] == ["kvguard-gptq"]


# ------------------------------------------------------------------------ quantize -> serve (SGLang)
N_NEW = 16


@pytest.mark.engine
def test_engine_serves_int4_close_to_bf16(model_dir, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "int4"  # mixed group sizes: exercises the CPU "dynamic" override hook too
    Q.quantize_checkpoint(
        model_dir, out, group_size=128, method="rtn", fallback_group_size=32, log=lambda *a: None
    )
    ids = prompt_ids(model_dir)
    with sglang_engine(out) as engine:
        outs = sglang_greedy(engine, ids, N_NEW)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    got = [o["output_ids"] for o in outs]
    # Same weights in transformers (dequantized, scales rounded to bf16 as SGLang loads them)
    q = load_file(str(out / "model.safetensors"))
    deq = {}
    for key in q:
        if key.endswith(".qweight"):
            base = key[: -len(".qweight")]
            gs = q[key].shape[0] * 8 // q[f"{base}.scales"].shape[0]
            w = ref.dequantize(
                q[key], q[f"{base}.qzeros"], q[f"{base}.scales"].to(torch.bfloat16), gs
            )
            deq[f"{base}.weight"] = w.t().to(torch.bfloat16)
    same_weights = hf_greedy(model_dir, ids, N_NEW, state_dict=deq)
    bf16 = hf_greedy(model_dir, ids, N_NEW)
    assert agreement(got, same_weights) >= 0.9, (got, same_weights)
    assert agreement(got, bf16) >= 0.6, (got, bf16)


def test_kernel_selection_hooks(monkeypatch):
    import sglang.srt.utils.common as common

    from kvguard.patches import int4_cpu_linear as P

    amx_kernel = object()
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: False)
    kernel = P.around_cpu_init_kernel(lambda *a: amx_kernel, None, _cfg(128))
    assert isinstance(kernel, W4A16LinearKernel) and kernel.group_size == 128
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: True)  # SGLang's AMX kernel
    assert P.around_cpu_init_kernel(lambda *a: amx_kernel, None, _cfg(128)) is amx_kernel

    def removed(*a):
        raise RuntimeError("The non-Marlin GPTQ CUDA kernel has been removed.")

    if not torch.cuda.is_available():  # nothing to fall back to: SGLang's error stands
        with pytest.raises(RuntimeError, match="removed"):
            P.around_init_kernel(removed, None, _cfg(128))
    else:
        assert isinstance(P.around_init_kernel(removed, None, _cfg(128)), W4A16LinearKernel)

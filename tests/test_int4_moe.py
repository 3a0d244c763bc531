"""INT4 W4A16 experts for the Kimi K2 architecture: ``kvguard.quant.quantize`` writes the format
Kimi K2 Thinking ships (compressed-tensors pack-quantized, symmetric int4, group 32), SGLang's
compressed-tensors config reads it the way its GPU MoE/linear schemes need, and on CPU
``patches/int4_cpu_moe.py`` serves it.

* Format: the packed words are compressed-tensors' own ``pack_to_int32`` of the codes; scales are
  its symmetric minmax scales; SGLang's ``CompressedTensorsConfig`` picks its WNA16 MoE scheme
  (Marlin, and the Triton one accepts it) for the experts and leaves the ignored layers BF16.
* Kernel: the CPU MoE forward equals a float reference over the dequantized experts.
* End to end: quantize the committed Kimi model, serve it in SGLang on CPU: greedy output equal to
  transformers on the same (dequantized) weights, and close to the BF16 weights' output.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from kvguard.patches import int4_cpu_moe  # noqa: E402
from kvguard.quant import pack_quantized as PQ  # noqa: E402
from kvguard.quant import quantize as Q  # noqa: E402


def tiny_kimi() -> Path:
    """The Kimi builder's TINY spec, 3 steps; cached on disk, keyed by the builders' source."""
    from kvguard.serve import tiny_builder
    from kvguard.serve.kimi_model import build as B

    sources = Path(B.__file__).read_bytes() + Path(tiny_builder.__file__).read_bytes()
    digest = hashlib.sha256(sources).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / "kvguard-test-models"
    out = root / f"tiny-kimi-{digest}"
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix="building-"))
    B.build(staging, tiny=True, steps=3, log=lambda *a, **k: None)
    try:
        staging.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------ format
def test_packing_is_compressed_tensors_own():
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 128, generator=g) * 0.05).to(torch.bfloat16)
    t = PQ.pack_weight(w, 32)
    assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (48, 16)
    assert t["weight_scale"].dtype == torch.bfloat16 and t["weight_scale"].shape == (48, 4)
    assert t["weight_shape"].tolist() == [48, 128]
    # the symmetric minmax scale compressed-tensors computes: max|w| / 7.5 per group
    amax = w.float().view(48, 4, 32).abs().amax(-1)
    torch.testing.assert_close(t["weight_scale"], (amax / 7.5).to(torch.bfloat16))
    q = unpack_from_int32(t["weight_packed"], 4, torch.Size([48, 128]))  # int8 in -8..7
    assert torch.equal(pack_to_int32(q, 4), t["weight_packed"])
    deq = PQ.unpack_weight(t["weight_packed"], t["weight_scale"], 32)
    group = torch.arange(128) // 32
    assert torch.equal(deq, q.float() * t["weight_scale"].float()[:, group])
    assert float((deq - w.float()).abs().max()) <= float(t["weight_scale"].float().max()) / 2 + 1e-6


def _sglang_config(targets: str):
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    return CompressedTensorsConfig.from_config(PQ.quantization_config(32, targets))


@pytest.mark.parametrize("targets", PQ.TARGETS)
def test_sglang_reads_the_config_as_its_gpu_schemes_need(targets):
    """What SGLang's compressed-tensors config decides for each layer of a DeepSeek model
    (the names SGLang's modules have): the experts get the WNA16 MoE scheme (Marlin on CUDA;
    the Triton MoE kernel accepts it too), ignored layers stay unquantized."""
    cfg = _sglang_config(targets)
    assert cfg.quant_format == "pack-quantized"
    assert "FusedMoE" not in cfg.target_scheme_map
    cfg._add_fused_moe_to_target_scheme_map()  # what get_moe_scheme does first

    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE

    def scheme(name):  # matched by name and by module class, as for SGLang's own layers
        cls = FusedMoE if ".experts." in name else ReplicatedLinear
        return cfg.get_scheme_dict(cls.__new__(cls), name)

    expert = scheme("model.layers.1.mlp.experts.0.gate_proj")
    w = expert["weights"]
    assert cfg._is_wNa16_group_channel(w, expert["input_activations"])
    assert cfg._is_wna16_triton_moe_supported(w)
    assert (w.num_bits, w.group_size, w.symmetric, w.actorder) == (4, 32, True, None)
    for name in (
        "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa",
        "model.layers.1.self_attn.kv_b_proj",
        "model.layers.1.self_attn.o_proj",
        "lm_head",
    ):
        assert scheme(name) is None, name
    mlp = (
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.shared_experts.gate_up_proj",
    )
    for name in mlp:
        assert (scheme(name) is None) == (targets == "experts"), name


def test_quantize_command_writes_the_checkpoint(tmp_path):
    model = tiny_kimi()
    out = tmp_path / "int4"
    assert Q.main(["--model", str(model), "--out", str(out)]) == 0  # defaults: experts, group 32
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == PQ.quantization_config(32, "experts")
    report = json.loads((out / "quant_report.json").read_text())
    spec = json.loads((model / "build_report.json").read_text())["spec"]
    moe_layers = spec["num_layers"] - spec["first_k_dense_replace"]
    assert report["layers_quantized"] == 3 * moe_layers * spec["n_routed_experts"]
    assert 0.26 < report["ratio"] < 0.32  # 4 bits + one bf16 scale per 32 weights
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert "model.layers.1.mlp.experts.0.down_proj.weight_packed" in tensors
    assert "model.layers.1.mlp.experts.0.down_proj.weight" not in tensors
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in tensors  # BF16, as K2 ships
    assert (out / "tokenizer.json").is_file()
    assert not (out / "build_report.json").exists()
    assert report["kept_bf16_for_gpu_linear_kernel"] == []
    # --targets mlp: the tiny spec's MLP linears reading the hidden state (in_features 64) are
    # narrower than SGLang's GPU W4A16 linear kernel takes (in % 128): kept BF16 and named in
    # ignore; the rest (the dense down_proj, in_features 128) quantized with the experts
    mlp = Q.quantize_checkpoint(model, tmp_path / "mlp", targets="mlp", log=lambda *a: None)
    kept = mlp["kept_bf16_for_gpu_linear_kernel"]
    assert kept and all(".shared_experts." in k or ".layers.0.mlp." in k for k in kept)
    ignore = json.loads((tmp_path / "mlp" / "config.json").read_text())["quantization_config"]
    assert set(kept) <= set(ignore["ignore"])
    assert mlp["layers_quantized"] == report["layers_quantized"] + 1


def test_kimi_model_fits_sglangs_gpu_kernels():
    """The committed Kimi model's experts have the shapes SGLang's MoE Marlin kernel takes, and
    under --targets mlp only the linears Marlin's W4A16 linear kernel takes are quantized."""
    from types import SimpleNamespace

    from sglang.srt.layers.quantization.marlin_utils import (
        check_marlin_supports_shape,
        check_moe_marlin_supports_layer,
    )

    from kvguard.serve.kimi_model import ensure_kimi_model

    model = ensure_kimi_model()
    cfg = json.loads((model / "config.json").read_text())
    layer = SimpleNamespace(
        hidden_size=cfg["hidden_size"],
        intermediate_size_per_partition=cfg["moe_intermediate_size"],
        moe_runner_config=SimpleNamespace(
            apply_router_weight_on_input=False, is_gated=True, activation="silu"
        ),
    )
    assert check_moe_marlin_supports_layer(layer, 32) and PQ.marlin_moe_fits(cfg, 32)
    tensors = Q.read_tensors(model)
    for name in PQ.quantized_linears(tensors, "mlp"):
        n, k = tensors[name + ".weight"].shape
        if ".experts." not in name:
            assert check_marlin_supports_shape(n, k, k, 32)[0], name


def test_quantize_moe_clear_errors(tmp_path):
    model = tiny_kimi()
    with pytest.raises(Q.QuantizeError, match="round-to-nearest"):
        Q.quantize_checkpoint(model, tmp_path / "a", method="gptq")
    with pytest.raises(Q.QuantizeError, match="group size 48 does not divide"):
        Q.quantize_checkpoint(model, tmp_path / "b", group_size=48)
    with pytest.raises(Q.QuantizeError, match="GPTQ"):
        Q.quantize_checkpoint(model, tmp_path / "c", fallback_group_size=16)
    with pytest.raises(Q.QuantizeError, match="--targets"):
        Q.quantize_checkpoint(model, tmp_path / "d", targets="attention")


# ------------------------------------------------------------------------------------ kernel
def _experts(num: int, hidden: int, inter: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    packs = []
    for _ in range(num):
        w13 = (torch.randn(2 * inter, hidden, generator=g) * 0.1).to(torch.bfloat16)
        w2 = (torch.randn(hidden, inter, generator=g) * 0.1).to(torch.bfloat16)
        packs.append((PQ.pack_weight(w13, group), PQ.pack_weight(w2, group)))
    return packs


def _as_loaded(t):
    """What SGLang's loader leaves in the layer: packed [K/8, N], scales [G, N]."""
    return t["weight_packed"].t().contiguous(), t["weight_scale"].t().contiguous()


# group 32: torch's INT4 GEMM; group 8 (and N % 16 != 0): packed codes dequantized per call
@pytest.mark.parametrize("hidden, inter, group", [(64, 32, 32), (40, 16, 8)])
def test_moe_forward_int4_matches_float_reference(hidden, inter, group):
    packs = _experts(4, hidden, inter, group)
    experts = [
        tuple(int4_cpu_moe.Int4Weight(*_as_loaded(t), group) for t in pair) for pair in packs
    ]
    assert all(w.int4pack for pair in experts for w in pair) == (group == 32)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, hidden, generator=g).to(torch.bfloat16)
    topk_ids = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [0, 1], [3, 2], [1, 3]])
    topk_w = torch.rand(7, 2, generator=g)
    got = int4_cpu_moe.moe_forward_int4(x, topk_w, topk_ids, experts)
    want = torch.zeros(7, hidden)
    for t in range(7):
        for j in range(2):
            w13, w2 = (
                PQ.unpack_weight(p["weight_packed"], p["weight_scale"], group)
                for p in packs[topk_ids[t, j]]
            )
            h = x[t].float() @ w13.t()
            h = torch.nn.functional.silu(h[:inter]) * h[inter:]
            want[t] += topk_w[t, j] * (h @ w2.t())
    assert got.dtype == torch.bfloat16 and got.shape == (7, hidden)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_linear_int4_matches_dequantized_weight():
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(96, 128, generator=g) * 0.1).to(torch.bfloat16)
    t = PQ.pack_weight(w, 32)
    weight = int4_cpu_moe.Int4Weight(*_as_loaded(t), 32)
    x = torch.randn(5, 128, generator=g).to(torch.bfloat16)
    want = x.float() @ PQ.unpack_weight(t["weight_packed"], t["weight_scale"], 32).t()
    torch.testing.assert_close(weight.matmul(x).float(), want, atol=3e-2, rtol=3e-2)
    with pytest.raises(int4_cpu_moe.Int4MoEConfigError, match="--dtype"):
        weight.matmul(x.float())


def test_unsupported_schemes_are_refused():
    with pytest.raises(int4_cpu_moe.Int4MoEConfigError, match="symmetric 4-bit"):
        int4_cpu_moe._check_scheme(4, False, "group", 32, None)
    with pytest.raises(int4_cpu_moe.Int4MoEConfigError, match="actorder"):
        int4_cpu_moe._check_scheme(4, True, "group", 32, "group")


# ------------------------------------------------------------------------------- end to end
def dequantized_checkpoint(int4_dir: Path, out: Path) -> Path:
    """The BF16 checkpoint holding exactly the weights the INT4 one encodes (for transformers)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(int4_dir, out)
    tensors = load_file(str(int4_dir / "model.safetensors"))
    result = {}
    for key, t in tensors.items():
        if key.endswith(".weight_packed"):
            base = key[: -len(".weight_packed")]
            w = PQ.unpack_weight(t, tensors[f"{base}.weight_scale"], 32)
            result[f"{base}.weight"] = w.to(torch.bfloat16).contiguous()
        elif not key.endswith((".weight_scale", ".weight_shape")):
            result[key] = t
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def hf_scores(model_dir: Path, windows: list[list[int]]) -> tuple[float, list[int]]:
    """transformers in bf16 (as SGLang serves): (perplexity, argmax next token at every position)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    nll, count, top1 = 0.0, 0, []
    with torch.no_grad():
        for w in windows:
            x = torch.tensor([w])
            logits = model(input_ids=x[:, :-1]).logits[0].float()
            nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(w) - 1
            top1 += logits.argmax(-1).tolist()
    return math.exp(nll / count), top1


@pytest.mark.engine
def test_int4_kimi_quantize_then_serve_close_to_bf16(tmp_path, capfd):
    """SGLang serves compressed-tensors in bf16/fp16 only, so the comparison is teacher-forced
    (every position of held-out windows scored, no free-running divergence): the served INT4
    model predicts what transformers predicts on the same dequantized weights, and its held-out
    perplexity is within 10% of the BF16 model's."""
    from quant_helpers import sglang_engine

    from kvguard.bench.quant import heldout_windows, sglang_perplexity
    from kvguard.serve.kimi_model import ensure_kimi_model

    model = ensure_kimi_model()
    int4 = tmp_path / "int4"
    Q.quantize_checkpoint(model, int4, targets="mlp", log=lambda *a: None)  # experts + MLPs
    windows = heldout_windows(model, 6, 128)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    with sglang_engine(int4, guard_mode="sampled", kv_cache_dtype="auto") as engine:
        ppl_int4, top1 = sglang_perplexity(engine, windows, vocab)
    logs = capfd.readouterr()
    assert "kvguard_int4_cpu_moe" in logs.out + logs.err  # the experts ran the INT4 CPU path
    _, top1_same = hf_scores(dequantized_checkpoint(int4, tmp_path / "deq"), windows)
    ppl_bf16, _ = hf_scores(model, windows)
    same = sum(a == b for a, b in zip(top1, top1_same)) / len(top1)
    assert same >= 0.95, same
    assert ppl_int4 <= 1.10 * ppl_bf16, (ppl_int4, ppl_bf16)

"""FP8 (e4m3) KV cache on CPU: patches/cpu_fp8_kv.py.

* In process: SGLang's real FP8 pool and torch_native backend, with the QUANT_TARGETS hooks
  applied the way SGLang's HookRegistry applies them; stored bytes and attention outputs are
  checked against an independent dequantize-then-attend reference, with and without scales.
* End to end: an SGLang engine with ``kv_cache_dtype="fp8_e4m3"`` and the guard in paranoid mode
  serves a small trained model: no request aborted (no integrity violation), greedy output close
  to the BF16 reference.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
pytest.importorskip("sglang")

from quant_helpers import (  # noqa: E402
    agreement,
    hf_greedy,
    prompt_ids,
    sglang_engine,
    sglang_greedy,
    tiny_trained_model,
)

from kvguard.patches import cpu_fp8_kv, kv_read  # noqa: E402
from kvguard.patches.targets import QUANT_TARGETS, READ_TARGETS  # noqa: E402

HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.fixture(scope="module")
def sgl():
    import pkgutil

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import CPUFP8KVCacheMethod
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    return SimpleNamespace(
        pkgutil=pkgutil,
        TorchNativeAttnBackend=TorchNativeAttnBackend,
        CPUFP8KVCacheMethod=CPUFP8KVCacheMethod,
        AttentionType=AttentionType,
        MHATokenToKVPool=MHATokenToKVPool,
        ReqToTokenPool=ReqToTokenPool,
        HookType=HookType,
        _wrap_fn=_wrap_fn,
    )


@pytest.fixture
def hooked(sgl, monkeypatch):
    """Apply the FP8 rows of QUANT_TARGETS and the READ_TARGETS rows exactly as HookRegistry
    would (its own wrapper)."""
    modules = {"cpu_fp8_kv": cpu_fp8_kv, "kv_read": kv_read}
    for target, hook_type, hook_path, _why in QUANT_TARGETS + READ_TARGETS:
        module, fn = hook_path.split(".", 1)
        if module not in modules or "configure" in target:
            continue
        owner_path, attr = target.rsplit(".", 1)
        owner = sgl.pkgutil.resolve_name(owner_path)
        hook = getattr(modules[module], fn)
        monkeypatch.setattr(
            owner, attr, sgl._wrap_fn(getattr(owner, attr), hook, sgl.HookType[hook_type])
        )


def _setup(sgl, n_prefix: int, register: bool = True, k_scale=None, v_scale=None):
    pool = sgl.MHATokenToKVPool(
        size=64,
        page_size=16,
        dtype=torch.float8_e4m3fn,
        head_num=KV_HEADS,
        head_dim=DIM,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        quant_method=sgl.CPUFP8KVCacheMethod(),
    )
    if register:
        cpu_fp8_kv._fp8_pools.add(pool)
    rtt = sgl.ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    backend = sgl.TorchNativeAttnBackend.__new__(sgl.TorchNativeAttnBackend)
    backend.__dict__.update(
        forward_metadata=None,
        device="cpu",
        req_to_token_pool=rtt,
        token_to_kv_pool=pool,
        use_sliding_window_kv_pool=False,
        swa_out_cache_loc=None,
    )
    layer = SimpleNamespace(
        tp_q_head_num=HEADS,
        tp_k_head_num=KV_HEADS,
        tp_v_head_num=KV_HEADS,
        qk_head_dim=DIM,
        v_head_dim=DIM,
        head_dim=DIM,
        layer_id=0,
        scaling=DIM**-0.5,
        is_cross_attention=False,
        attn_type=sgl.AttentionType.DECODER,
        sliding_window_size=-1,
        k_scale_float=k_scale,
        v_scale_float=v_scale,
    )
    slots = torch.arange(16, 16 + n_prefix + 1)  # prefix tokens, then one decode token
    rtt.req_to_token[0, : n_prefix + 1] = slots
    return pool, backend, layer, slots


def _reference(q, k_deq, v_deq, scaling):
    """Causal attention over dequantized K/V in float32 (GQA by repeating KV heads)."""
    rep = HEADS // KV_HEADS
    qh = q.float().view(q.shape[0], HEADS, DIM).transpose(0, 1)
    kh = k_deq.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    vh = v_deq.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    s = qh @ kh.transpose(1, 2) * scaling
    n_q, n_k = q.shape[0], k_deq.shape[0]
    mask = torch.arange(n_k)[None, :] > torch.arange(n_k - n_q, n_k)[:, None]
    s = s.masked_fill(mask, float("-inf"))
    return (s.softmax(-1) @ vh).transpose(0, 1).reshape(n_q, HEADS * DIM)


def _run(sgl, backend, layer, slots, q, k, v, n):
    """Prefill n tokens (extend), then decode one more; returns both outputs."""
    fb = SimpleNamespace(
        out_cache_loc=slots[:n],
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([n]),
        extend_prefix_lens=torch.tensor([0]),
        extend_seq_lens=torch.tensor([n]),
        encoder_lens=None,
    )
    o_ext = backend.forward_extend(q[:n], k[:n], v[:n], layer, fb)
    fb = SimpleNamespace(
        out_cache_loc=slots[n : n + 1],
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([n + 1]),
        encoder_lens=None,
    )
    o_dec = backend.forward_decode(q[n : n + 1], k[n : n + 1], v[n : n + 1], layer, fb)
    return o_ext, o_dec


def _qkv(n, magnitude=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS * DIM, generator=g).to(torch.bfloat16)
    k = (torch.randn(n, KV_HEADS, DIM, generator=g) * magnitude).to(torch.bfloat16)
    v = (torch.randn(n, KV_HEADS, DIM, generator=g) * magnitude).to(torch.bfloat16)
    return q, k, v


def _check(o_ext, o_dec, q, k_deq, v_deq, n, scaling):
    want = _reference(q[:n], k_deq[:n], v_deq[:n], scaling)
    torch.testing.assert_close(o_ext.float(), want, atol=2e-2, rtol=2e-2)
    want_dec = _reference(q[n : n + 1], k_deq, v_deq, scaling)
    torch.testing.assert_close(o_dec.float(), want_dec, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("ks,vs", [(None, None), (0.25, 0.125), (1.0, 4.0)])
def test_fp8_pool_stores_fp8_bytes_and_dequantizes_on_read(sgl, hooked, ks, vs):
    n = 9
    pool, backend, layer, slots = _setup(sgl, n, k_scale=ks, v_scale=vs)
    q, k, v = _qkv(n + 1, magnitude=3.0)
    o_ext, o_dec = _run(sgl, backend, layer, slots, q, k, v, n)
    sk, sv = ks or 1.0, vs or 1.0
    stored_k, stored_v = pool.k_buffer[0][slots], pool.v_buffer[0][slots]
    assert stored_k.dtype == torch.float8_e4m3fn and stored_k.element_size() == 1
    assert torch.equal(
        stored_k.view(torch.uint8), (k / sk).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    assert torch.equal(
        stored_v.view(torch.uint8), (v / sv).to(torch.float8_e4m3fn).view(torch.uint8)
    )
    _check(o_ext, o_dec, q, stored_k.float() * sk, stored_v.float() * sv, n, layer.scaling)


def test_scales_matter_for_large_activations(sgl, hooked):
    """K/V far beyond e4m3's 448: unscaled they saturate; with amax/448 scales they survive."""
    n = 9
    q, k, v = _qkv(n + 1, magnitude=2000.0, seed=1)
    ks, vs = float(k.abs().max()) / 448, float(v.abs().max()) / 448
    _pool, backend, layer, slots = _setup(sgl, n, k_scale=ks, v_scale=vs)
    o_ext, _o_dec = _run(sgl, backend, layer, slots, q * 0.001, k, v, n)
    exact = _reference(q[:n] * 0.001, k[:n].float(), v[:n].float(), layer.scaling)
    rel = (o_ext.float() - exact).norm() / exact.norm()
    assert float(rel) < 0.1
    _pool, backend, layer, slots = _setup(sgl, n)  # no scales: saturated at +-448
    o_sat, _ = _run(sgl, backend, layer, slots, q * 0.001, k, v, n)
    assert float((o_sat.float() - exact).norm() / exact.norm()) > 5 * float(rel)


def test_hooks_leave_other_pools_alone(sgl, hooked):
    n = 5
    pool, backend, layer, slots = _setup(sgl, n, register=False, k_scale=0.5, v_scale=0.5)
    q, k, v = _qkv(n + 1)
    _run(sgl, backend, layer, slots, q, k, v, n)
    # SGLang's own behaviour: no scales passed, plain cast on write and read
    assert torch.equal(
        pool.k_buffer[0][slots].view(torch.uint8), k.to(torch.float8_e4m3fn).view(torch.uint8)
    )
    assert cpu_fp8_kv.supply_scales(pool, layer, None, k, v) is None


def test_dequant_tables_match_torch_cast_for_every_byte():
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)
    k_table, v_table = cpu_fp8_kv.dequant_tables(1.0, 0.5, torch.bfloat16)
    finite = ~want.isnan()
    assert torch.equal(k_table[finite], want[finite]) and bool(k_table[~finite].isnan().all())
    assert torch.equal(v_table[finite], (want.float() * 0.5).to(torch.bfloat16)[finite])
    cache = codes[torch.randperm(256)].view(torch.float8_e4m3fn).view(16, 2, 8)
    rows = torch.tensor([3, 0, 15, 3])
    got = cpu_fp8_kv.dequantize_rows(cache, rows, k_table)
    assert got.shape == (4, 2, 8)
    torch.testing.assert_close(got, cache[rows].to(torch.bfloat16), equal_nan=True, rtol=0, atol=0)


def test_batched_read_bit_identical_to_sglang_cast(sgl, hooked):
    """Scale 1.0: the compact table-dequantized read gives exactly SGLang's own results, for a
    batch of requests with different lengths and page-table rows (decode and extend)."""
    outs = []
    for register in (True, False):
        _pool, backend, layer, _ = _setup(sgl, 0, register=register)
        rtt = backend.req_to_token_pool
        lens = [7, 3, 12]
        g = torch.Generator().manual_seed(4)
        perm = torch.randperm(60, generator=g)[: sum(lens)] + 1
        for row, (start, n) in zip((2, 0, 3), zip((0, 7, 10), lens)):
            rtt.req_to_token[row, :n] = perm[start : start + n]
        q, k, v = _qkv(sum(lens), magnitude=2.0, seed=5)
        fb = SimpleNamespace(
            out_cache_loc=perm,
            req_pool_indices=torch.tensor([2, 0, 3]),
            seq_lens=torch.tensor(lens),
            extend_prefix_lens=torch.tensor([0, 0, 0]),
            extend_seq_lens=torch.tensor(lens),
            encoder_lens=None,
        )
        o_ext = backend.forward_extend(q, k, v, layer, fb)
        last = torch.tensor([6, 9, 21])  # each request's last token, re-read as a decode step
        fb_dec = SimpleNamespace(
            out_cache_loc=perm[last],
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
            encoder_lens=None,
        )
        o_dec = backend.forward_decode(q[last], k[last], v[last], layer, fb_dec)
        outs.append((o_ext, o_dec))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_layer_kv_scales_sources():
    f = cpu_fp8_kv.layer_kv_scales
    assert f(SimpleNamespace(layer_id=0)) == (1.0, 1.0)
    assert f(SimpleNamespace(layer_id=0, k_scale_float=0.5, v_scale_float=2.0)) == (0.5, 2.0)
    # --quantization-param-path sets floats on k_scale/v_scale; FP8 checkpoints load 0-d tensors
    assert f(SimpleNamespace(layer_id=0, k_scale=0.25, v_scale=torch.tensor(0.75))) == (0.25, 0.75)
    # SGLang's "not loaded" placeholder (-1) means no scale
    assert f(SimpleNamespace(layer_id=0, k_scale=torch.tensor(-1.0), v_scale=None)) == (1.0, 1.0)
    with pytest.raises(cpu_fp8_kv.FP8KVConfigError, match="per-tensor"):
        f(SimpleNamespace(layer_id=3, k_scale=torch.ones(2), v_scale=None))
    with pytest.raises(cpu_fp8_kv.FP8KVConfigError, match="not finite"):
        f(SimpleNamespace(layer_id=3, k_scale_float=float("inf")))


# ------------------------------------------------------------------------------------ end to end
N_NEW = 16


@pytest.fixture(scope="module")
def model_dir():
    return tiny_trained_model()


def test_engine_fp8_kv_paranoid_guard_close_to_bf16(model_dir):
    ids = prompt_ids(model_dir)
    with sglang_engine(model_dir, guard_mode="paranoid", kv_cache_dtype="fp8_e4m3") as engine:
        outs = sglang_greedy(engine, ids, N_NEW)
        again = sglang_greedy(engine, ids[:2], N_NEW)  # prefix-cache hits read FP8 KV back
    reasons = [o["meta_info"]["finish_reason"] for o in outs + again]
    assert all(r["type"] == "length" for r in reasons), reasons  # nothing aborted by the guard
    got = [o["output_ids"] for o in outs]
    assert [o["output_ids"] for o in again] == got[:2]
    want = hf_greedy(model_dir, ids, N_NEW)
    assert agreement(got, want) >= 0.8, (got, want)
    assert sum(g[:4] == w[:4] for g, w in zip(got, want)) >= len(ids) - 1


# ----------------------------------------------------------------------------- the AMX gate
def test_gate_decision(sgl, monkeypatch):
    import sglang.srt.runtime_context as rc
    import sglang.srt.utils.common as common

    fp8 = SimpleNamespace(
        kv_cache_dtype=torch.float8_e4m3fn,
        use_mla_backend=False,
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
    )
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: False)
    monkeypatch.setattr(rc, "attention_backends", lambda: ("torch_native", "torch_native"))
    assert cpu_fp8_kv._wants_torch_native_fp8(fp8)
    assert not cpu_fp8_kv._wants_torch_native_fp8(
        SimpleNamespace(**{**vars(fp8), "kv_cache_dtype": torch.bfloat16})
    )
    # MLA (DeepSeek-V3 / Kimi K2): served too, through SGLang's MLA pool
    assert cpu_fp8_kv._wants_torch_native_fp8(
        SimpleNamespace(**{**vars(fp8), "use_mla_backend": True})
    )
    monkeypatch.setattr(rc, "attention_backends", lambda: ("triton", "torch_native"))
    with pytest.raises(cpu_fp8_kv.FP8KVConfigError, match="--attention-backend torch_native"):
        cpu_fp8_kv._wants_torch_native_fp8(fp8)
    monkeypatch.setattr(common, "cpu_has_amx_support", lambda: True)  # SGLang's own AMX route
    assert not cpu_fp8_kv._wants_torch_native_fp8(fp8)


def test_amx_gate_lifted_once_and_restored():
    real_amx, real_backends = (lambda: False), (lambda: ("torch_native",))
    kvc = SimpleNamespace(cpu_has_amx_support=real_amx, attention_backends=real_backends)
    with cpu_fp8_kv._amx_gate_lifted(kvc):
        assert kvc.cpu_has_amx_support() is True  # the gate's two calls
        assert kvc.attention_backends() == ("intel_amx", "intel_amx")
        assert kvc.cpu_has_amx_support() is False  # every later call: the truth
        assert kvc.attention_backends() == ("torch_native",)
    assert kvc.cpu_has_amx_support is real_amx and kvc.attention_backends is real_backends
    with (
        pytest.raises(cpu_fp8_kv.FP8KVConfigError, match="changed shape"),
        cpu_fp8_kv._amx_gate_lifted(kvc),
    ):
        pass  # a configure() that no longer consults the gate
    assert kvc.cpu_has_amx_support is real_amx


def test_mla_gate_lifted_once_and_restored():
    real = SimpleNamespace(is_cpu=lambda: True, device_name="cpu")
    kvc = SimpleNamespace(current_platform=real)
    with cpu_fp8_kv._mla_gate_lifted(kvc):
        assert kvc.current_platform.is_cpu() is False  # the gate's call
        assert kvc.current_platform.is_cpu() is True  # every later call: the truth
        assert kvc.current_platform.device_name == "cpu"
    assert kvc.current_platform is real
    with (
        pytest.raises(cpu_fp8_kv.FP8KVConfigError, match="changed shape"),
        cpu_fp8_kv._mla_gate_lifted(kvc),
    ):
        pass
    assert kvc.current_platform is real


# ------------------------------------------------------------------ MLA (DeepSeek-V3 / Kimi K2)
LORA, ROPE, MLA_HEADS = 32, 16, 4  # latent row: kv_lora_rank + qk_rope_head_dim values


@pytest.fixture
def mla_hooked(sgl, hooked, monkeypatch):
    """The MLA pool's write hook from MLA_TARGETS, applied as HookRegistry would (plus the read
    hooks of ``hooked``)."""
    from sglang.srt.runtime_context import get_parallel

    from kvguard.patches.targets import MLA_TARGETS

    # the MLA pool's write asserts no decode context parallelism; no parallel config is published
    # in a test process
    with get_parallel().override(dcp_enabled=False):
        yield from _apply_mla_write_hook(sgl, MLA_TARGETS, monkeypatch)


def _apply_mla_write_hook(sgl, rows, monkeypatch):
    import inspect

    for target, hook_type, hook_path, _why in rows:
        if not hook_path.startswith("cpu_fp8_kv.") or "load_kv_cache_scales" in target:
            continue
        owner_path, attr = target.rsplit(".", 1)
        owner = sgl.pkgutil.resolve_name(owner_path)
        hook = getattr(cpu_fp8_kv, hook_path.split(".", 1)[1])
        # SGLang's own function, even where an engine started in this process already applied
        # the plugin's hooks (a scale applied twice would divide twice)
        original = inspect.unwrap(getattr(owner, attr))
        monkeypatch.setattr(owner, attr, sgl._wrap_fn(original, hook, sgl.HookType[hook_type]))
    yield


def _mla_setup(sgl, n: int, dtype=torch.float8_e4m3fn, register=True, k_scale=None):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(
        size=64,
        page_size=16,
        dtype=dtype,
        kv_lora_rank=LORA,
        qk_rope_head_dim=ROPE,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    if register:
        cpu_fp8_kv._fp8_pools.add(pool)
    rtt = sgl.ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    backend = sgl.TorchNativeAttnBackend.__new__(sgl.TorchNativeAttnBackend)
    backend.__dict__.update(
        forward_metadata=None,
        device="cpu",
        req_to_token_pool=rtt,
        token_to_kv_pool=pool,
        use_sliding_window_kv_pool=False,
        swa_out_cache_loc=None,
    )
    # DeepSeek's attn_mqa: one latent "head" shared by every query head, V = the latent part
    layer = SimpleNamespace(
        tp_q_head_num=MLA_HEADS,
        tp_k_head_num=1,
        tp_v_head_num=1,
        qk_head_dim=LORA + ROPE,
        v_head_dim=LORA,
        head_dim=LORA + ROPE,
        layer_id=0,
        scaling=(LORA + ROPE) ** -0.5,
        is_cross_attention=False,
        attn_type=sgl.AttentionType.DECODER,
        sliding_window_size=-1,
        k_scale_float=k_scale,
        v_scale_float=None,
    )
    slots = torch.arange(16, 16 + n + 1)
    rtt.req_to_token[0, : n + 1] = slots
    return pool, backend, layer, slots


def _mla_run(backend, layer, slots, q, latent, n):
    """Prefill n tokens, then decode one more, as DeepSeek's absorbed path calls attn_mqa."""
    fb = SimpleNamespace(
        out_cache_loc=slots[:n],
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([n]),
        extend_prefix_lens=torch.tensor([0]),
        extend_seq_lens=torch.tensor([n]),
        encoder_lens=None,
    )
    o_ext = backend.forward_extend(q[:n], latent[:n], latent[:n, :, :LORA], layer, fb)
    fb = SimpleNamespace(
        out_cache_loc=slots[n : n + 1],
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([n + 1]),
        encoder_lens=None,
    )
    o_dec = backend.forward_decode(
        q[n : n + 1], latent[n : n + 1], latent[n : n + 1, :, :LORA], layer, fb
    )
    return o_ext, o_dec


def _mla_reference(q, latent, scaling):
    """Causal MQA over dequantized latent rows in float32: keys are whole rows, values their
    first kv_lora_rank values."""
    qh = q.float().view(q.shape[0], MLA_HEADS, LORA + ROPE).transpose(0, 1)
    k = latent.float()[:, 0, :]
    s = qh @ k.t() * scaling
    n_q, n_k = q.shape[0], k.shape[0]
    mask = torch.arange(n_k)[None, :] > torch.arange(n_k - n_q, n_k)[:, None]
    p = s.masked_fill(mask, float("-inf")).softmax(-1)
    return (p @ k[:, :LORA]).transpose(0, 1).reshape(n_q, MLA_HEADS * LORA)


@pytest.mark.parametrize("ks", [None, 0.25, 4.0])
def test_fp8_mla_pool_stores_scaled_bytes_and_dequantizes_on_read(sgl, mla_hooked, ks):
    n = 9
    pool, backend, layer, slots = _mla_setup(sgl, n, k_scale=ks)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(n + 1, MLA_HEADS * (LORA + ROPE), generator=g).to(torch.bfloat16)
    latent = (torch.randn(n + 1, 1, LORA + ROPE, generator=g) * 3).to(torch.bfloat16)
    o_ext, o_dec = _mla_run(backend, layer, slots, q, latent, n)
    scale = ks or 1.0
    stored = pool.kv_buffer[0][slots]
    assert stored.dtype == torch.uint8 and stored.shape[-1] == LORA + ROPE  # 1 byte per value
    assert torch.equal(stored, (latent / scale).to(torch.float8_e4m3fn).view(torch.uint8))
    deq = stored.view(torch.float8_e4m3fn).float() * scale
    want = _mla_reference(q[:n], deq[:n], layer.scaling)
    torch.testing.assert_close(o_ext.float(), want, atol=2e-2, rtol=2e-2)
    want_dec = _mla_reference(q[n : n + 1], deq, layer.scaling)
    torch.testing.assert_close(o_dec.float(), want_dec, atol=2e-2, rtol=2e-2)


def test_fp8_mla_read_bit_identical_to_sglang_cast(sgl, mla_hooked):
    """Scale 1.0: the dequantized copy (V a view of K's) gives exactly SGLang's own results."""
    outs = []
    for register in (True, False):
        _pool, backend, layer, slots = _mla_setup(sgl, 12, register=register)
        g = torch.Generator().manual_seed(5)
        q = torch.randn(13, MLA_HEADS * (LORA + ROPE), generator=g).to(torch.bfloat16)
        latent = torch.randn(13, 1, LORA + ROPE, generator=g).to(torch.bfloat16)
        outs.append(_mla_run(backend, layer, slots, q, latent, 12))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_guard_takes_every_byte_of_mla_pool_rows(sgl, dtype):
    """The guard's adapter hands over the MLA pool's per-layer latent buffers; the checksum
    kernels' view of them (whole contiguous rows of 4-byte words) covers every stored byte."""
    from kvguard.kernels.kv_checksum_ref import row_words
    from kvguard.patches.adapter import guarded_kv_buffers

    pool, *_ = _mla_setup(sgl, 4, dtype=dtype, register=False)
    kind, buffers = guarded_kv_buffers(pool)
    assert kind == "mla" and len(buffers) == 1 and buffers[0] is pool.kv_buffer[0]
    words = row_words(buffers[0])
    row_bytes = (LORA + ROPE) * (1 if dtype == torch.float8_e4m3fn else 2)
    assert words.shape == (buffers[0].shape[0], row_bytes // 4)
    assert words.data_ptr() == buffers[0].data_ptr()  # a view: the stored bytes themselves


def test_mla_kv_scales_from_quantization_param_path(tmp_path, monkeypatch):
    """--quantization-param-path for an MLA model: SGLang's file format, read by SGLang's loader,
    lands on each layer's attn_mqa (SGLang's DeepSeek model has no load_kv_cache_scales)."""
    import sglang.srt.distributed.parallel_state as ps
    import sglang.srt.runtime_context as rc

    path = tmp_path / "kv_scales.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {0: 0.5, 1: 2.0}}},
            }
        )
    )
    monkeypatch.setattr(rc, "get_model", lambda: SimpleNamespace(quantization_param_path=path))
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)

    class Attention(torch.nn.Module):
        def __init__(self, layer_id):
            super().__init__()
            self.kv_lora_rank = LORA
            self.attn_mqa = SimpleNamespace(layer_id=layer_id, k_scale=None, v_scale=None)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Attention(0), Attention(1)])
    model.config = SimpleNamespace(num_hidden_layers=2, model_type="deepseek_v3")
    called = []
    out = cpu_fp8_kv.around_load_kv_cache_scales(
        lambda **kw: called.append(kw), model=model, kv_cache_dtype="fp8_e4m3"
    )
    assert out is None and not called  # SGLang's own loader (which would raise) is not reached
    assert [cpu_fp8_kv.mla_kv_scale(m.attn_mqa) for m in model.layers] == [0.5, 2.0]
    # without FP8 KV, or for a model that loads its own scales: SGLang's function
    cpu_fp8_kv.around_load_kv_cache_scales(
        lambda **kw: called.append(kw), model=model, kv_cache_dtype="auto"
    )
    assert len(called) == 1

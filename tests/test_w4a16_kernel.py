"""W4A16 on GPTQ tensors: the torch reference (kernels/w4a16_ref.py) against first principles, and
the Triton kernel (kernels/w4a16.py) against the reference under TRITON_INTERPRET=1 (in a
subprocess, so the interpreter setting does not leak into other tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvguard.kernels import w4a16_ref as ref
from kvguard.kernels.w4a16 import w4a16_matmul


def test_pack_rows_nibble_order_and_round_trip():
    codes = torch.arange(8, dtype=torch.int32).view(8, 1).repeat(1, 3)  # rows 0..7
    words = ref.pack_rows(codes)
    assert words.shape == (1, 3) and words.dtype == torch.int32
    assert int(words[0, 0]) == 0x76543210  # row j in bits 4j..4j+3
    high = torch.full((8, 2), 15, dtype=torch.int32)  # 0xFFFFFFFF: the int32 with all bits set
    assert ref.pack_rows(high).tolist() == [[-1, -1]]
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 24), generator=g, dtype=torch.int32)
    assert torch.equal(ref.unpack_rows(ref.pack_rows(codes)), codes)
    assert torch.equal(ref.unpack_cols(ref.pack_cols(codes)), codes)
    assert int(ref.pack_cols(torch.arange(8, dtype=torch.int32).view(1, 8))[0, 0]) == 0x76543210


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        ref.pack_rows(torch.zeros(12, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        ref.pack_rows(torch.full((8, 4), 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 8"):
        ref.pack_cols(torch.zeros(2, 12, dtype=torch.int32))


def _gptq(k, n, gs, sym=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g)
    codes, zeros, scales = ref.quantize_rtn(w, gs, sym=sym)
    return w, codes, zeros, scales, ref.pack_rows(codes), ref.pack_cols(zeros - 1), scales.half()


def test_dequantize_matches_elementwise_definition():
    _w, codes, zeros, _scales, qw, qz, s = _gptq(32, 16, 16, sym=False, seed=1)
    deq = ref.dequantize(qw, qz, s, 16, zero_offset=1)
    for kk in (0, 5, 16, 31):
        for nn in (0, 7, 15):
            gi = kk // 16
            want = (int(codes[kk, nn]) - int(zeros[gi, nn])) * float(s[gi, nn])
            assert float(deq[kk, nn]) == pytest.approx(want, abs=0, rel=1e-6)
    # v2 stores the zero itself: same weight from qzeros + 1 with offset 0
    assert torch.equal(ref.dequantize(qw, ref.pack_cols(zeros), s, 16, zero_offset=0), deq)


def test_rtn_symmetric_error_bound():
    w, _codes, zeros, scales, qw, qz, s = _gptq(256, 32, 64)
    assert bool((zeros == 8).all())  # symmetric GPTQ: zero point 8 (stored as 7 in v1)
    assert bool((ref.unpack_cols(qz) == 7).all())
    deq = ref.dequantize(qw, qz, s, 64)
    group = torch.arange(256) // 64
    step = scales[group]
    # within the representable range [-8s, 7s] the error is at most half a step
    inside = (w >= -8 * step) & (w <= 7 * step)
    assert bool(((deq - w).abs()[inside] <= step[inside] / 2 + 1e-6).all())
    assert bool(((deq - w).abs() <= step).all())  # clipping of the top value costs < 1 step


def test_ref_matmul_and_dispatch_on_cpu():
    _w, _c, _z, _s, qw, qz, s = _gptq(64, 24, 32, sym=False, seed=2)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    bias = torch.randn(24)
    y = ref.w4a16_matmul_ref(x, qw, qz, s, 32, bias=bias)
    assert y.shape == (3, 5, 24) and y.dtype == torch.bfloat16
    want = (x.float() @ ref.dequantize(qw, qz, s, 32) + bias).to(torch.bfloat16)
    assert torch.equal(y, want)
    assert torch.equal(w4a16_matmul(x, qw, qz, s, 32, bias=bias), y)  # CPU: reference path
    with pytest.raises(ValueError, match="divide"):
        ref.dequantize(qw, qz, s, 48)
    with pytest.raises(ValueError, match="features"):
        ref.w4a16_matmul_ref(torch.randn(2, 32), qw, qz, s, 32)


_INTERP_SCRIPT = textwrap.dedent(
    r"""
    import torch
    from kvguard.kernels import w4a16, w4a16_ref as ref

    assert w4a16._use_triton(torch.device("cpu")) and w4a16._INTERPRETED
    g = torch.Generator().manual_seed(3)

    def case(m, k, n, gs, dtype, exact, zero_offset=1, bias=False, **blocks):
        codes = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
        zeros = torch.randint(zero_offset, 16, (k // gs, n), generator=g, dtype=torch.int32)
        if exact:  # power-of-two scales, small integer activations: every sum exact in fp32
            scales = 2.0 ** torch.randint(-3, 2, (k // gs, n), generator=g).float()
            x = torch.randint(-4, 5, (m, k), generator=g).to(dtype)
        else:
            scales = torch.rand(k // gs, n, generator=g) * 0.02 + 0.001
            x = torch.randn(m, k, generator=g).to(dtype)
        qw, qz = ref.pack_rows(codes), ref.pack_cols(zeros - zero_offset)
        s = scales.to(torch.float16)
        b = torch.randint(-3, 4, (n,), generator=g).to(dtype) if bias else None
        got = w4a16.w4a16_matmul_triton(x, qw, qz, s, gs, zero_offset, b, **blocks)
        want = ref.w4a16_matmul_ref(x, qw, qz, s, gs, zero_offset, b)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape == (m, n)
        if exact and dtype == torch.bfloat16:
            # the interpreter rounds float32 -> bfloat16 toward zero (torch and compiled Triton
            # round to nearest even): require the exact float32 result within one bf16 ulp
            exact32 = ref.w4a16_matmul_ref(x.float(), qw, qz, s, gs, zero_offset,
                                           None if b is None else b.float())
            ulp = torch.exp2(torch.floor(torch.log2(exact32.abs().clamp_min(1e-30))) - 7)
            assert bool(((got.float() - exact32).abs() < ulp).all()), (m, k, n, gs)
        elif exact:
            assert torch.equal(got, want), (m, k, n, gs, dtype, (got.float() - want.float()).abs().max())
        else:
            tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < tol, (m, k, n, gs, dtype, err)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        case(1, 64, 24, 32, dtype, exact=True)                    # decode row, N not a block multiple
        case(19, 96, 40, 16, dtype, exact=True, bias=True)        # M, N masked; 6 groups of 16
        case(5, 256, 72, 128, dtype, exact=True, zero_offset=0)   # v2 zeros, two 64-wide K steps/group
        case(7, 128, 16, 32, dtype, exact=False)
    case(33, 64, 136, 64, torch.float32, exact=True, block_m=16, block_n=32, block_k=16)
    # dispatcher takes the kernel path for multiples of 16, the reference otherwise
    x = torch.randint(-2, 3, (3, 64), generator=g).float()
    qw = ref.pack_rows(torch.randint(0, 16, (64, 8), generator=g, dtype=torch.int32))
    qz = ref.pack_cols(torch.full((8, 8), 7, dtype=torch.int32))
    s = torch.ones(8, 8, dtype=torch.float16)
    assert torch.equal(w4a16.w4a16_matmul(x, qw, qz, s, 8), ref.w4a16_matmul_ref(x, qw, qz, s, 8))
    print("INTERP_OK")
    """
)


def test_triton_interpreter_matches_reference():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KVGUARD_FORCE_TRITON="1")
    r = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INTERP_OK" in r.stdout


@pytest.mark.gpu
def test_cuda_kernel_matches_reference():
    _w, _c, _z, _s, qw, qz, s = _gptq(512, 256, 128, sym=False, seed=4)
    x = torch.randn(37, 512, dtype=torch.bfloat16)
    want = ref.w4a16_matmul_ref(x, qw, qz, s, 128)
    got = w4a16_matmul(x.cuda(), qw.cuda(), qz.cuda(), s.cuda(), 128).cpu()
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert float(err) < 1e-2

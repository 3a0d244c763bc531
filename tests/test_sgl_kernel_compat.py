"""kvguard's CPU ``sgl_kernel`` ops: each against a plain-Python statement of what its SGLang call
site expects (the semantics of the Triton kernel SGLang runs for the same call on GPU), plus the
finder's promise never to shadow a real ``sgl_kernel``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvguard.patches import sgl_kernel_compat as ops
from kvguard.patches.sgl_kernel_finder import SglKernelCompatFinder


def test_served_only_when_no_real_sgl_kernel(tmp_path):
    assert isinstance(sys.meta_path[-1], SglKernelCompatFinder) or any(
        isinstance(f, SglKernelCompatFinder) for f in sys.meta_path
    )
    # A real sgl_kernel earlier on the path wins: the finder sits after every regular finder.
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    code = "import sgl_kernel; print(getattr(sgl_kernel, 'REAL', False), getattr(sgl_kernel, 'KVGUARD_COMPAT', False))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True
    )
    assert out.stdout.split() == ["True", "False"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_assign_req_to_token_pool_and_its_inverse():
    table = torch.zeros(5, 12, dtype=torch.int32)
    rows = torch.tensor([3, 1, 4])
    start, end = torch.tensor([2, 0, 5]), torch.tensor([5, 4, 6])
    packed = torch.arange(100, 108, dtype=torch.int64)  # 3 + 4 + 1 slots
    ops.assign_req_to_token_pool_cpu(rows, table, start, end, packed, table.shape[1])
    expected = torch.zeros_like(table)
    k = 0
    for r, s, e in zip(rows.tolist(), start.tolist(), end.tolist()):
        for c in range(s, e):
            expected[r, c] = int(packed[k])
            k += 1
    assert torch.equal(table, expected)
    back = torch.full((8,), -1, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(rows, table, start, end, back, table.shape[1])
    assert torch.equal(back, packed)


def test_assign_draft_cache_locs_contiguous():
    table = torch.arange(4 * 20, dtype=torch.int32).view(4, 20)
    rows, seq = torch.tensor([2, 0]), torch.tensor([5, 9])
    out = torch.zeros(2 * 2 * 3, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rows, table, seq, out, 20, 2, 3)
    expected = [int(table[r, s + k]) for r, s in zip(rows.tolist(), seq.tolist()) for k in range(6)]
    assert out.tolist() == expected


def test_fill_bonus_tokens_and_accept_locs():
    accept_tokens = torch.tensor([[7, 8, 9], [4, 5, 6]])
    bonus = torch.zeros(2, dtype=torch.int64)
    ops.fill_bonus_tokens_cpu(accept_tokens, torch.tensor([2, 3]), bonus, 3)
    assert bonus.tolist() == [8, 6]
    accept_index = torch.tensor([0, -1, 2, 3, -1])
    out_cache_loc = torch.tensor([10, 11, 12, 13, 14])
    accepted = torch.full((5,), -1, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accepted)
    assert accepted.tolist()[:3] == [10, 12, 13]


def test_copy_all_layer_kv_cache_through_raw_addresses():
    layers = [torch.arange(6 * 8, dtype=torch.uint8).view(6, 8).clone() for _ in range(2)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    before = [t.clone() for t in layers]
    # overlapping source and target sets: every target gets its source's *old* row
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 2]), torch.tensor([2, 5]))
    for t, b in zip(layers, before):
        assert torch.equal(t[1], b[2]) and torch.equal(t[2], b[5])
        assert torch.equal(t[[0, 3, 4, 5]], b[[0, 3, 4, 5]])


def test_unsupported_ops_raise_a_clear_error():
    with pytest.raises(ops.UnsupportedOnCpu, match="EAGLE tree speculative decoding"):
        ops.build_tree_kernel_efficient_cpu()
    with pytest.raises(ops.UnsupportedOnCpu, match="speculative decoding"):
        ops.verify_tree_greedy_cpu()

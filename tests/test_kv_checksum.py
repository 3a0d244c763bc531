"""Tests for the KV token checksum (kernels/kv_checksum*.py).

The Triton-interpreter comparison runs in a subprocess with TRITON_INTERPRET=1
set before triton is imported, so it does not leak into other test modules.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvguard.kernels import kv_checksum_ref as ref
from kvguard.kernels.kv_checksum import token_digests
from kvguard.kernels.kv_checksum_ref import (
    block_digests,
    fmix64,
    splitmix64,
    token_digests_ref,
    word_constants,
)

M64 = (1 << 64) - 1


# ---------------------------------------------------------------- big-int model
def py_splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def py_fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def py_perm31(x: int) -> int:
    m31 = (1 << 31) - 1
    x = (x & m31) ^ (ref.SEED & m31)
    x = ((x ^ (x >> 16)) * 0x2C1B3C6D) & m31
    x = ((x ^ (x >> 15)) * 0x297A2D39) & m31
    return x ^ (x >> 16)


def py_const(b: int, j: int) -> int:
    """splitmix64(SEED + b * 2**32 + j), its low 33 bits +-(2 * perm31(cantor(b, j)) + 1)."""
    r = py_splitmix64((ref.SEED + b * 2**32 + j) & M64)
    s = b + j
    low = 2 * py_perm31(s * (s + 1) // 2 + j) + 1
    if (r >> 32) & 1:
        low = (1 << 33) - low
    return (r >> 33 << 33) | low


def py_row_bytes(buf: torch.Tensor, s: int) -> bytes:
    return bytes(buf[s].contiguous().view(torch.uint8).flatten().tolist())


def py_digest(buffers, s: int, p: int) -> int:
    inner = 0
    for b, buf in enumerate(buffers):
        raw = py_row_bytes(buf, s)
        for j in range(len(raw) // 4):
            word = int.from_bytes(raw[4 * j : 4 * j + 4], "little")
            inner = (inner + word * py_const(b, j)) & M64
    return py_fmix64(inner ^ py_splitmix64((ref.POS_SEED + p) & M64))


def u64(t: torch.Tensor) -> list[int]:
    return [v & M64 for v in t.tolist()]


def s64(x: int) -> int:
    return ref.to_signed64(x)


def make_pool(num_slots: int, layers: int, seed: int = 0):
    """Mixed pool: bf16 K [S,2,8], fp16 V [S,3,4] per layer + fp32 and uint8 (FP8 bytes)."""
    g = torch.Generator().manual_seed(seed)
    bufs = []
    for _ in range(layers):
        bufs.append(torch.randn(num_slots, 2, 8, generator=g).to(torch.bfloat16))
        bufs.append(torch.randn(num_slots, 3, 4, generator=g).to(torch.float16))
    bufs.append(torch.randn(num_slots, 1, 5, generator=g))  # fp32, 20 B rows
    bufs.append(torch.randint(0, 256, (num_slots, 1, 12), generator=g, dtype=torch.uint8))
    return bufs


# ---------------------------------------------------------- (a) math vs big-int
def test_torch_int64_wraps_like_mod_2_64():
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-(2**63), 2**63 - 1, (64,), generator=g, dtype=torch.int64)
    b = torch.randint(-(2**63), 2**63 - 1, (64,), generator=g, dtype=torch.int64)
    for x, y, pm, pa in zip(u64(a), u64(b), u64(a * b), u64(a + b)):
        assert pm == (x * y) & M64
        assert pa == (x + y) & M64
    assert u64(a.sum().reshape(1))[0] == sum(u64(a)) & M64
    idx = torch.zeros(64, dtype=torch.int64)
    acc = torch.zeros(1, dtype=torch.int64).index_add_(0, idx, a)
    assert u64(acc)[0] == sum(u64(a)) & M64
    # logical shift helper vs Python on negative (top-bit-set) values
    for s in (1, 27, 30, 31, 33, 63):
        assert u64(ref._lsr(a, s)) == [x >> s for x in u64(a)]


def test_splitmix64_fmix64_match_bigint():
    xs = [0, 1, 2**32, 2**63 - 1, 2**63, M64, 0x123456789ABCDEF0]
    t = torch.tensor([s64(x) for x in xs], dtype=torch.int64)
    assert u64(splitmix64(t)) == [py_splitmix64(x) for x in xs]
    assert u64(fmix64(t)) == [py_fmix64(x) for x in xs]
    # published splitmix64 vector: first output from state 0
    assert py_splitmix64(0) == 0xE220A8397B1DCDAF
    assert py_fmix64(0) == 0


def test_word_constants_match_bigint_and_are_odd():
    c = word_constants(3, 7, "cpu")
    assert c.shape == (3, 7) and c.dtype == torch.int64
    assert [u64(row) for row in c] == [[py_const(b, j) for j in range(7)] for b in range(3)]
    far = word_constants(3, 65000, "cpu")  # large (b, j): no overflow in the construction
    assert u64(far[2, -3:]) == [py_const(2, j) for j in range(64997, 65000)]
    assert bool((c & 1).eq(1).all())
    # prefix-consistent across table widths
    assert torch.equal(word_constants(3, 12, "cpu")[:, :7], c)


def test_ref_matches_bigint_model():
    bufs = make_pool(9, layers=2, seed=3)
    slots = torch.tensor([0, 4, 8, 4, 1, 7], dtype=torch.int64)
    pos = torch.tensor([0, 1, 2, 3, 2**31 - 1, 123456], dtype=torch.int32)
    got = u64(token_digests_ref(bufs, slots, pos))
    want = [py_digest(bufs, int(s), int(p)) for s, p in zip(slots, pos)]
    assert got == want
    # dispatcher on CPU takes the reference path
    assert u64(token_digests(bufs, slots, pos)) == want


def test_ref_chunking_is_invisible(monkeypatch):
    bufs = make_pool(40, layers=1, seed=4)
    slots = torch.randint(0, 40, (37,), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(37)
    full = token_digests_ref(bufs, slots, pos)
    monkeypatch.setattr(ref, "_CHUNK_ELEMS", 10)  # forces many tiny chunks
    assert torch.equal(token_digests_ref(bufs, slots, pos), full)


def test_block_digests_wrapping_sum():
    g = torch.Generator().manual_seed(6)
    d = torch.randint(-(2**63), 2**63 - 1, (20,), generator=g, dtype=torch.int64)
    bid = torch.arange(20) // 5
    got = u64(block_digests(d, bid, 5))
    vals = u64(d)
    want = [sum(vals[5 * i : 5 * i + 5]) & M64 for i in range(4)] + [0]
    assert got == want


def test_row_validation():
    with pytest.raises(ValueError):  # 6-byte rows
        token_digests_ref(
            [torch.zeros(4, 1, 3, dtype=torch.bfloat16)], torch.tensor([0]), torch.tensor([0])
        )
    with pytest.raises(ValueError):  # non-contiguous row
        big = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
        token_digests([big[:, :, :4]], torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError):
        token_digests([torch.zeros(4, 4)], torch.tensor([0, 1]), torch.tensor([0]))


# ------------------------------------------------- (b) Triton interpreter == ref
_INTERP_SCRIPT = textwrap.dedent(
    r"""
    import torch
    from kvguard.kernels import kv_checksum
    from kvguard.kernels.kv_checksum import token_digests, token_digests_triton
    from kvguard.kernels.kv_checksum_ref import token_digests_ref

    assert kv_checksum._use_triton(torch.device("cpu"))  # really the kernel path

    g = torch.Generator().manual_seed(7)
    S = 50
    bufs = []
    for layer in range(3):  # K/V with different row sizes and dtypes
        bufs.append(torch.randn(S, 2, 8, generator=g).to(torch.bfloat16))   # 32 B
        bufs.append(torch.randn(S, 3, 4, generator=g).to(torch.float16))    # 24 B
    bufs.append(torch.randn(S, 1, 40, generator=g))                          # fp32 160 B
    bufs.append(torch.randint(0, 256, (S, 2, 6), generator=g, dtype=torch.uint8))  # FP8 bytes
    wide = torch.randn(S, 4, 8, generator=g).to(torch.bfloat16)
    bufs.append(wide[:, :2])          # strided pool view: slot stride > row size
    bufs.append(torch.randn(S, 1, 8, generator=g).to(torch.float8_e4m3fn))

    N = 70  # not a multiple of any block size
    slots = torch.randint(0, S, (N,), generator=g)
    pos = torch.randint(0, 2**31 - 1, (N,), generator=g)
    want = token_digests_ref(bufs, slots, pos)

    checks = {
        "dispatch": token_digests(bufs, slots, pos),
        "int32_idx": token_digests(bufs, slots.int(), pos.int()),
        "small_blocks": token_digests_triton(bufs, slots, pos, block_n=16, block_w=4),
    }
    for dt_name, b in [("bf16", bufs[0]), ("fp16", bufs[1]), ("fp32", bufs[6]), ("u8", bufs[7])]:
        checks["single_" + dt_name] = token_digests([b], slots, pos)
        want_single = token_digests_ref([b], slots, pos)
        assert torch.equal(checks.pop("single_" + dt_name), want_single), dt_name
    for name, got in checks.items():
        assert got.dtype == torch.int64 and got.shape == (N,), name
        assert torch.equal(got, want), name
    assert token_digests(bufs, slots[:0], pos[:0]).shape == (0,)

    from kvguard.kernels.kv_checksum_ref import page_major
    raw = torch.randint(0, 256, (S // 10, 10 * 132), generator=g, dtype=torch.uint8)  # DSA-like
    paged = [page_major(raw, offset=0, slot_bytes=128, row_bytes=128, per_page=10),
             page_major(raw, offset=1280, slot_bytes=4, row_bytes=4, per_page=10)]
    assert torch.equal(token_digests(bufs + paged, slots, pos),
                       token_digests_ref(bufs + paged, slots, pos)), "page-major"
    print("INTERP_OK")
    """
)


def test_triton_interpreter_bit_identical_to_ref():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KVGUARD_FORCE_TRITON="1")
    r = subprocess.run(
        [sys.executable, "-c", _INTERP_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "INTERP_OK" in r.stdout


# ------------------------------------------------------------ (c) bit flips
def _flip_variants(buf: torch.Tensor, src_slot: int, bits: list[int]) -> torch.Tensor:
    """Buffer whose slot 0 is the original row of src_slot and slot i+1 has bit bits[i] flipped."""
    row = buf[src_slot].contiguous().view(torch.uint8).flatten()
    rows = row.unsqueeze(0).repeat(len(bits) + 1, 1)
    for i, bit in enumerate(bits):
        rows[i + 1, bit // 8] ^= 1 << (bit % 8)
    return rows.view(buf.dtype).view(len(bits) + 1, *buf.shape[1:])


def _assert_all_flips_detected(bufs, which: int, bits: list[int], position: int = 17):
    n = len(bits) + 1
    variant = _flip_variants(bufs[which], 3, bits)
    # Other buffers: slot 3's row replicated, so only buffer `which` differs.
    new = [
        variant if i == which else b[3:4].expand(n, *b.shape[1:]).contiguous()
        for i, b in enumerate(bufs)
    ]
    d = token_digests(new, torch.arange(n), torch.full((n,), position))
    assert int(d[0]) == int(token_digests(bufs, torch.tensor([3]), torch.tensor([position]))[0])
    assert bool((d[1:] != d[0]).all())
    assert len(set(d.tolist())) == n  # also pairwise distinct


def test_every_single_bit_flip_detected_exhaustive_bf16():
    bufs = make_pool(8, layers=2, seed=8)
    nbits = bufs[0][0].numel() * bufs[0].element_size() * 8  # 2*8 bf16 = 256 bits
    assert nbits == 256
    _assert_all_flips_detected(bufs, 0, list(range(nbits)))


def test_bit_flips_detected_sampled_other_buffers():
    bufs = make_pool(8, layers=2, seed=9)
    g = torch.Generator().manual_seed(10)
    for which in range(1, len(bufs)):
        nbits = bufs[which][0].numel() * bufs[which].element_size() * 8
        bits = torch.randperm(nbits, generator=g)[:48].tolist()
        _assert_all_flips_detected(bufs, which, bits)


# ------------------------------------------------ (d) reordering / relocation
def test_swaps_change_block_digest():
    bufs = make_pool(16, layers=2, seed=11)
    slots = torch.tensor([5, 9, 2, 14])
    pos = torch.tensor([100, 101, 102, 103])
    one_block = torch.zeros(4, dtype=torch.int64)
    base = block_digests(token_digests(bufs, slots, pos), one_block, 1)

    swapped_pos = pos[[1, 0, 2, 3]]  # tokens 0 and 1 swap positions
    assert not torch.equal(
        block_digests(token_digests(bufs, slots, swapped_pos), one_block, 1), base
    )
    swapped_slots = slots[[0, 1, 3, 2]]  # tokens 2 and 3 swap slots (contents)
    assert not torch.equal(
        block_digests(token_digests(bufs, swapped_slots, pos), one_block, 1), base
    )
    shifted = pos + 1  # whole block moved to other positions
    assert not torch.equal(block_digests(token_digests(bufs, slots, shifted), one_block, 1), base)
    moved = slots.clone()
    moved[1] = 10  # one token read from a wrong slot
    assert not torch.equal(block_digests(token_digests(bufs, moved, pos), one_block, 1), base)
    # the block digest is a sum: listing order of the same (slot, pos) pairs is irrelevant
    perm = torch.tensor([3, 1, 0, 2])
    assert torch.equal(
        block_digests(token_digests(bufs, slots[perm], pos[perm]), one_block, 1), base
    )
    # swapping the K and V buffers of a layer (buffer order) changes digests too
    kv_swapped = [bufs[1], bufs[0]] + bufs[2:]
    assert not bool(
        (token_digests(kv_swapped, slots, pos) == token_digests(bufs, slots, pos)).any()
    )


# ------------------------------------------------------- (e) determinism
def test_identical_bytes_same_position_identical_digests():
    bufs = make_pool(12, layers=2, seed=12)
    for b in bufs:
        b[7].copy_(b[2])  # slot 7 holds the same bytes as slot 2
    d = token_digests(bufs, torch.tensor([2, 7, 2, 7]), torch.tensor([40, 40, 41, 41]))
    assert d[0] == d[1] and d[2] == d[3] and d[0] != d[2]
    clones = [b.clone() for b in bufs]
    s = torch.tensor([0, 3, 11])
    p = torch.tensor([1, 2, 3])
    assert torch.equal(token_digests(clones, s, p), token_digests(bufs, s, p))
    assert torch.equal(token_digests(bufs, s, p), token_digests(bufs, s, p))
    # the digest depends on bytes only: same bytes reinterpreted as another dtype
    as_u8 = [b.view(torch.uint8) for b in bufs]
    assert torch.equal(token_digests(as_u8, s, p), token_digests(bufs, s, p))


@pytest.mark.gpu
def test_cuda_triton_matches_cpu_ref():
    bufs = make_pool(300, layers=3, seed=13)
    g = torch.Generator().manual_seed(14)
    slots = torch.randint(0, 300, (1000,), generator=g)
    pos = torch.randint(0, 2**20, (1000,), generator=g)
    want = token_digests_ref(bufs, slots, pos)
    got = token_digests([b.cuda() for b in bufs], slots.cuda(), pos.cuda())
    assert torch.equal(got.cpu(), want)
    got_ref_cuda = token_digests_ref([b.cuda() for b in bufs], slots.cuda(), pos.cuda())
    assert torch.equal(got_ref_cuda.cpu(), want)

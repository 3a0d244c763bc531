"""Checksum strength (docs/design.md, "Checksum strength"): the word constants leave no blind
two-bit pair at the production geometries (the v1 constants did), and the fault models that can
be enumerated or sampled are caught through the torch reference and both compiled CPU kernels
(the guard's ``token_digests`` and the verified read's gather-and-hash)."""

from __future__ import annotations

import pytest
import torch

from kvguard.bench import checksum_strength as strength
from kvguard.kernels import kv_checksum_ref as ref
from kvguard.kernels import read_verify
from kvguard.kernels.guard_cpu import CpuKernels
from kvguard.kernels.kv_checksum_ref import (
    block_digests,
    fmix64,
    poskey,
    token_digests_ref,
    word_constants,
)

LOW = (1 << 33) - 1
GEOMETRIES = {g.name: g for g in strength.GEOMETRIES}


def _classes(consts: torch.Tensor, bits: int = 33) -> torch.Tensor:
    """Each constant's class mod 2**bits up to sign: min(x, -x mod 2**bits)."""
    mask = (1 << bits) - 1
    x = consts & mask
    return torch.minimum(x, (-x) & mask)


def _near_pairs(consts: torch.Tensor, bits: int = 33) -> list[tuple[int, int]]:
    """Index pairs of constants equal mod 2**bits up to sign, by sorting (not O(n**2))."""
    rep, order = torch.sort(_classes(consts, bits))
    same = (rep[1:] == rep[:-1]).nonzero().flatten()
    return [(int(order[i]), int(order[i + 1])) for i in same]


# ------------------------------------------------------------------------------ the constants
@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_no_two_constants_agree_in_their_low_33_bits_up_to_sign(name):
    """Llama-3.1-70B (TP 8 and one rank), Kimi K2, GLM-5 (latent rows + DSA index keys and
    scales), BF16 and FP8: every constant a token is hashed with is odd, and no two agree mod
    2**33 up to sign, so no flip of bit k < 32 in one word cancels one of bit k in another."""
    c = strength.geometry_constants(GEOMETRIES[name].words)
    assert c.numel() == GEOMETRIES[name].token_words
    assert bool((c & 1).eq(1).all())
    assert _near_pairs(c) == []
    assert strength.blind_two_bit(c) == 0


def test_the_v1_constants_had_blind_pairs():
    """The check can fail: the v1 constants (splitmix64(...) | 1) of a one-rank Llama-3.1-70B
    BF16 token (81,920 words) hold pairs equal mod 2**33 up to sign, as random constants would
    (~N**2 * 2**-31 expected)."""
    g = GEOMETRIES["llama70b-tp1-bf16"]
    old = strength.geometry_constants(g.words, strength.legacy_word_constants)
    assert len(_near_pairs(old)) >= 1
    assert strength.blind_two_bit(old) == 4  # the table's figure (docs/design.md)


def test_constructed_low_bits_are_distinct_over_the_whole_index_range():
    """The guarantee holds for every (b, j) with b + j <= MAX_INDEX_SUM (Cantor's pairing below
    2**31, then a bijection of 31-bit values): a large table, and its edges (many buffers of one
    word, two buffers of 65,533 words); tables of other widths agree on their common prefix."""
    big = word_constants(256, 2048)
    assert _near_pairs(big.flatten()) == []
    assert torch.equal(word_constants(256, 100), big[:, :100])
    assert torch.equal(word_constants(40, 2048), big[:40])
    edges = torch.cat(
        [word_constants(ref.MAX_INDEX_SUM + 1, 1).flatten(),
         word_constants(2, ref.MAX_INDEX_SUM).flatten()]
    )  # fmt: skip
    assert bool((edges & 1).eq(1).all())
    assert _classes(edges).unique().numel() == edges.numel() - 2  # (0, 0) and (1, 0) twice
    s = ref.MAX_INDEX_SUM
    assert s * (s + 3) // 2 < 2**31 <= (s + 1) * (s + 4) // 2


# ---------------------------------------------------------------------- faults through kernels
def _digests(bufs: list[torch.Tensor], slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Token digests through the reference, the guard's compiled kernel and the verified read's
    compiled gather (one accumulator per row over the buffers); all three must agree."""
    want = token_digests_ref(bufs, slots, pos)
    assert torch.equal(CpuKernels().token_digests(bufs, slots, pos), want)
    acc = torch.zeros(slots.numel(), dtype=torch.int64)
    for b, buf in enumerate(bufs):
        read_verify.gather_rows(buf, slots, None, b, acc)
    assert torch.equal(fmix64(acc ^ poskey(pos)), want)
    return want


def _pool(slots: int, buffers: int = 4, words: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """BF16 rows of model-like values (Llama TP 8's 64-word rows), ``slots`` copies of slot 0."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(1, 2 * words, generator=g).to(torch.bfloat16) for _ in range(buffers)]
    return [r.expand(slots, -1).contiguous() for r in rows]


def _words(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.int32)


def _bit(k: torch.Tensor | int) -> torch.Tensor:
    """int32 words with bit k set (bit 31: the sign bit)."""
    m = torch.ones_like(torch.as_tensor(k)) << torch.as_tensor(k)
    return torch.where(m >= 2**31, m - 2**32, m).to(torch.int32)


def test_every_single_bit_flip_of_a_token_is_caught():
    """Every one of the 8,192 bits of a 4-buffer token (64 words per row) flipped in turn."""
    nb, w = 4, 64
    bufs = _pool(1 + nb * w * 32, nb, w)
    i = torch.arange(nb * w * 32)
    b, j, k = i // (w * 32), i // 32 % w, i % 32
    for bi in range(nb):
        sel = b == bi
        _words(bufs[bi])[1 + i[sel], j[sel]] ^= _bit(k[sel])
    slots = torch.arange(bufs[0].shape[0])
    d = _digests(bufs, slots, torch.full_like(slots, 7))
    assert bool((d[1:] != d[0]).all())


@pytest.mark.parametrize("bit", [31, 30, 16, 0])
def test_two_bit_flips_at_the_same_bit_of_two_words_are_caught(bit):
    """The cancelling kind: bit k of two words, both directions (data bits equal, then unequal),
    within a row and across buffers, at 2,048 sampled word pairs per bit."""
    nb, w, n = 4, 64, 2048
    g = torch.Generator().manual_seed(bit)
    u = torch.randint(0, nb * w, (n,), generator=g)
    v = (u + torch.randint(1, nb * w, (n,), generator=g)) % (nb * w)  # another word
    same = torch.arange(n) % 2 == 0  # the two data bits equal (flips in one direction) or not
    bufs = _pool(2 * n, nb, w, seed=bit)
    before, after = torch.arange(0, 2 * n, 2), torch.arange(1, 2 * n, 2)
    mask = _bit(bit)
    for case in range(n):
        for word, value in ((int(u[case]), 0), (int(v[case]), 0 if same[case] else 1)):
            buf, col = _words(bufs[word // w]), word % w
            rows = torch.tensor([before[case], after[case]])
            cur = buf[rows, col] & ~mask
            buf[rows, col] = cur | (mask if value else 0)
            buf[after[case], col] ^= mask
    slots = torch.arange(2 * n)
    d = _digests(bufs, slots, slots // 2)
    assert bool((d[after] != d[before]).all())


def test_an_odd_number_of_words_changed_at_the_least_bit_is_caught():
    """The rule behind the table: a fault is caught, for any odd constants, when an odd number of
    words change at its least changed bit. Three flips of bit 31 in three words (directions as
    the data has them), 1,024 sampled triples across 4 buffers."""
    nb, w, n = 4, 64, 1024
    g = torch.Generator().manual_seed(9)
    bufs = _pool(1 + n, nb, w, seed=9)
    for i in range(n):
        for word in torch.randperm(nb * w, generator=g)[:3].tolist():
            _words(bufs[word // w])[1 + i, word % w] ^= _bit(31)
    slots = torch.arange(1 + n)
    d = _digests(bufs, slots, torch.full_like(slots, 3))
    assert bool((d[1:] != d[0]).all())


def test_a_v1_blind_pair_is_missed_and_the_same_flips_are_caught_now(monkeypatch):
    """The v1 constants' blind pair at the one-rank Llama-3.1-70B BF16 geometry (160 buffers x
    512 words): the two bit-31 flips leave the token's digest unchanged, through the reference
    and the compiled kernel; with the constants of now the same flips are caught."""
    g = GEOMETRIES["llama70b-tp1-bf16"]
    nb, w = len(g.words), g.words[0]
    old = strength.legacy_word_constants(nb, w)
    u, v = _near_pairs(old.flatten())[0]
    cu, cv = int(old.flatten()[u]) & LOW, int(old.flatten()[v]) & LOW
    opposite = cu == cv  # C_u = C_v mod 2**33: flips cancel when they go opposite ways
    bufs = [torch.zeros(2, w, dtype=torch.int32) for _ in range(nb)]
    bufs[v // w][:, v % w] = -(2**31) if opposite else 0  # bit 31 set before in v only
    for word in (u, v):
        bufs[word // w][1, word % w] ^= -(2**31)
    slots, pos = torch.arange(2), torch.tensor([5, 5])
    now = token_digests_ref(bufs, slots, pos)
    assert torch.equal(CpuKernels().token_digests(bufs, slots, pos), now)
    assert now[0] != now[1]
    monkeypatch.setitem(ref._CONST_CACHE, (nb, w, "cpu"), old)
    then = token_digests_ref(bufs, slots, pos)
    assert torch.equal(CpuKernels().token_digests(bufs, slots, pos), then)
    assert then[0] == then[1]


def test_bursts_of_up_to_32_bits_are_caught():
    """A burst (first and last bit flipped, the rest at random) of 2 to 32 bits anywhere in a
    row, across a word boundary or not: 2,048 sampled; the analysis gives 0 for these lengths."""
    nb, w, n = 2, 64, 2048
    g = torch.Generator().manual_seed(5)
    bufs = _pool(1 + n, nb, w, seed=5)
    length = torch.randint(2, 33, (n,), generator=g)
    start = (torch.rand(n, generator=g) * (w * 32 - length + 1)).long()
    buf = torch.randint(0, nb, (n,), generator=g)
    for i in range(n):
        lo, ln = int(start[i]), int(length[i])
        flips = torch.rand(ln, generator=g) < 0.5
        flips[0] = flips[-1] = True
        bits = lo + flips.nonzero().flatten()
        row = _words(bufs[int(buf[i])])[1 + i]
        for p in bits.tolist():
            row[p // 32] ^= _bit(p % 32)
    slots = torch.arange(1 + n)
    d = _digests(bufs, slots, torch.zeros_like(slots))
    assert bool((d[1:] != d[0]).all())
    assert all(strength.p_burst(ln) == 0 for ln in (1, 2, 17, 32))
    assert strength.p_burst(33) > 0


def _page_pool(pages: int, ps: int, nb: int = 4, w: int = 64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(pages * ps, 2 * w, generator=g).to(torch.bfloat16) for _ in range(nb)]


def _page_digests(bufs: list[torch.Tensor], pages: int, ps: int) -> torch.Tensor:
    slots = torch.arange(pages * ps)
    return block_digests(_digests(bufs, slots, slots % ps), slots // ps, pages)


FAULTS = ["zero_row", "zero_token", "swap_rows", "swap_tokens", "copy_row", "copy_token"]


@pytest.mark.parametrize("fault", FAULTS)
def test_row_level_faults_change_their_page_digest(fault):
    """In each of 64 pages (16 tokens, 4 buffers of 64-word BF16 rows): one buffer's row or a whole
    token zeroed, two rows of one buffer or two whole tokens swapped within the page, or a row or
    token copied over another slot of the page. Only that page's digest moves."""
    pages, ps, nb = 64, 16, 4
    bufs = _page_pool(pages, ps, nb, seed=FAULTS.index(fault))
    clean = _page_digests(bufs, pages, ps)
    g = torch.Generator().manual_seed(3)
    for p in range(pages):
        a, b = (p * ps + torch.randperm(ps, generator=g)[:2]).tolist()
        which = [int(torch.randint(0, nb, (1,), generator=g))]
        hit = which if "row" in fault else list(range(nb))
        for bi in hit:
            buf = bufs[bi]
            if fault.startswith("zero"):
                buf[a] = 0
            elif fault.startswith("swap"):
                buf[[a, b]] = buf[[b, a]]
            else:
                buf[b] = buf[a]
    assert bool((_page_digests(bufs, pages, ps) != clean).all())

"""The token checksum's strength against each fault model, at production geometries.

    python -m kvguard.bench.checksum_strength            # the table of docs/design.md
    python -m kvguard.bench.checksum_strength --pairs    # blind-pair counts, v1 vs current

The digest (``kernels/kv_checksum_ref.py``) is ``fmix64(inner XOR poskey)`` with ``inner`` a
linear form mod 2**64 over a token's 32-bit words with odd constants C. A change d_w of each word
w is missed iff sum_w d_w * C_w = 0 mod 2**64. Let t be the least 2-adic valuation of the d_w and
m the number of words at it: for m odd the sum is odd times 2**t, never 0 (so one changed word,
a burst of at most 32 bits, or any fault with one word at its lowest changed bit is always
caught); for m even it is 0 with probability 2**-(63 - t) for random odd constants. Two words
changed by the same +-2**t are missed iff C_u = +-C_v mod 2**(64 - t): the constructed low bits
rule that out for t < 32, which is every two-bit flip. The figures below are exact sums of these
terms over each fault model's patterns (uniform positions, random data); where a pattern is
caught by construction the v2 constants give 0 and the sum bounds it from above.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from math import comb

import torch

from kvguard.kernels.kv_checksum_ref import SEED, splitmix64, to_signed64, word_constants


@dataclass(frozen=True)
class Geometry:
    """One rank's guarded KV: the row width in 32-bit words of each buffer, in the pool's order."""

    name: str
    what: str
    words: tuple[int, ...]
    row: int  # the row width (words) the per-row figures use: the widest buffer's

    @property
    def token_words(self) -> int:
        return sum(self.words)


def _mha(layers: int, heads: int, dim: int, elem: int) -> tuple[int, ...]:
    return (heads * dim * elem // 4,) * (2 * layers)  # [k0, v0, k1, v1, ...]


def _dsa(layers: int, latent_bytes: int, index_dim: int = 128) -> tuple[int, ...]:
    # [latent0 .. latentL-1, keys0, scales0, keys1, scales1, ...] (patches/adapter.py): FP8 index
    # keys (index_head_dim bytes) and one fp32 scale per key, in every layer
    return (latent_bytes // 4,) * layers + (index_dim // 4, 1) * layers


GEOMETRIES = (
    Geometry("llama70b-tp8-bf16", "Llama-3.1-70B, TP 8 (1 KV head x 128 per rank), BF16",
             _mha(80, 1, 128, 2), 64),
    Geometry("llama70b-tp8-fp8", "Llama-3.1-70B, TP 8, FP8", _mha(80, 1, 128, 1), 32),
    Geometry("llama70b-tp1-bf16", "Llama-3.1-70B, one rank (8 KV heads x 128), BF16",
             _mha(80, 8, 128, 2), 512),
    Geometry("kimi-k2-bf16", "Kimi K2, 61 layers x MLA 512 + 64 rope, BF16",
             ((512 + 64) * 2 // 4,) * 61, 288),
    Geometry("kimi-k2-fp8", "Kimi K2, FP8 (576 B rows, one scale per layer)",
             ((512 + 64) // 4,) * 61, 144),
    Geometry("glm5-bf16", "GLM-5, 78 layers x MLA 576 BF16 + DSA index key 128 FP8 + fp32 scale",
             _dsa(78, (512 + 64) * 2), 288),
    Geometry("glm5-fp8", "GLM-5, FP8 DSA latent rows (512 FP8 + 4 fp32 scales + 64 BF16 rope)",
             _dsa(78, 512 + 16 + 64 * 2), 164),
)  # fmt: skip


def legacy_word_constants(num_buffers: int, words_per_row: int) -> torch.Tensor:
    """The v1 constants (DIGEST_VERSION 1): splitmix64(SEED + b * 2**32 + j) | 1, for comparison."""
    b = torch.arange(num_buffers, dtype=torch.int64).unsqueeze(1)
    j = torch.arange(words_per_row, dtype=torch.int64).unsqueeze(0)
    return splitmix64(to_signed64(SEED) + (b << 32) + j) | 1


def geometry_constants(
    words: Sequence[int], table: Callable[[int, int], torch.Tensor] = word_constants
) -> torch.Tensor:
    """The constants a token of this geometry is hashed with: int64 [sum(words)]."""
    t = table(len(words), max(words))
    return torch.cat([t[b, :w] for b, w in enumerate(words)])


def near_pairs(consts: torch.Tensor, bits: int) -> int:
    """Pairs of constants equal mod 2**bits up to sign (by sorting: one class representative per
    constant, min(x, -x), then equal runs)."""
    mask = -1 if bits >= 64 else (1 << bits) - 1
    x = consts & mask
    rep = torch.minimum(x, (-x) & mask)  # any fixed choice in {x, -x} names the class
    _, counts = torch.unique(rep, return_counts=True)
    return int((counts * (counts - 1) // 2).sum())


def blind_two_bit(consts: torch.Tensor) -> int:
    """(word pair, bit k) combinations whose two flips can cancel: C_u = +-C_v mod 2**(64 - k)."""
    total = 0
    for bits in range(33, 65):
        n = near_pairs(consts, bits)
        if n == 0:
            break  # agreeing in more bits implies agreeing in fewer
        total += n
    return total


def expected_blind_two_bit(n_words: int) -> float:
    """The same count expected of random odd constants: a pair agrees mod 2**m up to sign with
    probability 2**-(m - 2)."""
    return comb(n_words, 2) * sum(2.0 ** -(m - 2) for m in range(33, 65))


def p_two_bits(n_words: int, blind: int) -> float:
    """A uniformly random pair of bits of a token flipped: missed iff the pair is blind and the
    data makes the two changes cancel (one sign of two)."""
    return blind * 0.5 / comb(32 * n_words, 2)


def p_k_bits(words: int, k: int, constructed: bool = True) -> Fraction:
    """k distinct bits of a ``words``-word row flipped, uniformly: sum over the least flipped bit t
    of the patterns with an even number m >= 2 of words flipped at t (all others above t), times
    2**-(63 - t). With the constructed constants the two-bit patterns (k = 2) are never missed."""
    if k == 2 and constructed:
        return Fraction(0)
    total = Fraction(0)
    for t in range(32):
        above = words * (31 - t)
        weight = sum(comb(words, m) * comb(above, k - m) for m in range(2, min(k, words) + 1, 2))
        total += Fraction(weight, 2 ** (63 - t))
    return total / comb(32 * words, k)


def p_random_words(words: int) -> Fraction:
    """Every word of a row changed by a random amount (a zeroed row of model data, a row
    overwritten by another's): a change's valuation is t with probability 2**-(t + 1)."""
    total = Fraction(0)
    for t in range(32):
        at, above = Fraction(1, 2 ** (t + 1)), Fraction(1, 2 ** (t + 1))  # P(v = t), P(v > t)
        for m in range(2, words + 1, 2):
            total += comb(words, m) * at**m * above ** (words - m) / 2 ** (63 - t)
    return total


def _segment(lo: int, hi: int, first: bool, last: bool) -> list[tuple[int, bool, Fraction]]:
    """A burst's bits [lo, hi] in one word, its first (lo) and/or last (hi) bit flipped, the others
    at random: [(least flipped bit or -1, only that bit flipped, probability)]."""
    if first:  # the least flipped bit is lo; single iff every other bit is clear
        if last:
            return [(lo, lo == hi, Fraction(1))]
        single = Fraction(1, 2 ** (hi - lo))
        return [(lo, True, single), (lo, False, 1 - single)]
    out = []
    for v in range(lo, hi + 1):
        if last and v == hi:
            out.append((v, True, Fraction(1, 2 ** (hi - lo))))  # bits below the last one clear
            break
        p_v = Fraction(1, 2 ** (v - lo + 1))  # bits lo..v-1 clear, v set
        single = Fraction(0) if last else Fraction(1, 2 ** (hi - v))  # bits above v clear
        out += [(v, True, p_v * single), (v, False, p_v * (1 - single))]
    if not last:
        out.append((-1, False, Fraction(1, 2 ** (hi - lo + 1))))  # nothing flipped here
    return [o for o in out if o[2]]


def p_burst(length: int, constructed: bool = True) -> Fraction:
    """A burst of ``length`` bits (first and last flipped, the rest at random) at a uniformly random
    offset in a word: sum of 2**-(63 - t) over the outcomes with an even number of words at the
    least flipped bit t (two single-bit words at t: never missed with the constructed constants)."""
    total = Fraction(0)
    for a in range(32):
        end = a + length - 1
        segs = []
        for w in range(end // 32 + 1):
            lo, hi = max(a, 32 * w) - 32 * w, min(end, 32 * w + 31) - 32 * w
            segs.append(_segment(lo, hi, first=w == 0, last=w == end // 32))
        outcomes = [((), Fraction(1))]
        for seg in segs:
            outcomes = [(o + ((v, s),), p * q) for o, p in outcomes for v, s, q in seg]
        for o, p in outcomes:
            changed = [(v, s) for v, s in o if v >= 0]
            t = min(v for v, _ in changed)
            at = [s for v, s in changed if v == t]
            if len(at) % 2 or len(at) < 2:
                continue
            if constructed and len(changed) == 2 and all(at):
                continue
            total += p / 2 ** (63 - t)
    return total / 32


def log2(x: float | Fraction) -> str:
    return "0" if x == 0 else f"2^{math.log2(x):.1f}"


def figures(g: Geometry, burst: Fraction) -> dict[str, str]:
    """Each fault model's miss probability at one geometry (the rows of docs/design.md's table)."""
    now, old = geometry_constants(g.words), geometry_constants(g.words, legacy_word_constants)
    n, w, v1 = g.token_words, g.row, blind_two_bit(old)
    return {
        "words per token / per row": f"{n} / {w}",
        "1 bit; any change within one word; burst of <= 32 bits": "0",
        "2 bits in two words of a token (blind pairs)": f"0 ({blind_two_bit(now)})",
        "... with the v1 constants (blind pairs; random: expected)": (
            f"{log2(p_two_bits(n, v1))} ({v1}; {expected_blind_two_bit(n):.2g})"
        ),
        "3 bits in one row": log2(p_k_bits(w, 3)),
        "4 bits in one row": log2(p_k_bits(w, 4)),
        "8 bits in one row": log2(p_k_bits(w, 8)),
        "burst of 33 to 64 bits (worst length)": log2(burst),
        "zeroed row; a row overwritten by another's": log2(p_random_words(w)),
        "two rows of one buffer swapped in a page": log2(p_random_words(w) + Fraction(1, 2**64)),
        "two tokens swapped; faults in two tokens of a page": log2(Fraction(1, 2**64)),
        "a token's whole KV copied to another slot": "0",
    }


def table() -> str:
    burst = max(p_burst(length) for length in range(33, 65))
    cols = [figures(g, burst) for g in GEOMETRIES]
    lines = ["| fault | " + " | ".join(g.name for g in GEOMETRIES) + " |"]
    lines.append("| --- |" + " --- |" * len(GEOMETRIES))
    lines += [f"| {row} | " + " | ".join(c[row] for c in cols) + " |" for row in cols[0]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", action="store_true", help="near-pair counts per bit, v1 vs now")
    args = ap.parse_args(argv)
    if args.pairs:
        for g in GEOMETRIES:
            for label, fn in (("now", word_constants), ("v1", legacy_word_constants)):
                c = geometry_constants(g.words, fn)
                counts = {m: near_pairs(c, m) for m in range(33, 37)}
                print(f"{g.name:20} {label:3} words {c.numel():6}  pairs equal mod 2**m: {counts}")
        return
    for g in GEOMETRIES:
        print(f"- {g.name}: {g.what}")
    print()
    print(table())


if __name__ == "__main__":
    main()

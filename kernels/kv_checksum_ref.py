"""Reference (pure torch) KV token checksum; also the CPU engine path.

Definition (the Triton kernel in ``kv_checksum.py`` reproduces it bit for bit):

    buffers b = [layer0 K, layer0 V, layer1 K, layer1 V, ...], each [num_slots, ...]
                (or page-major, ``PageMajor``: slot s is row s % n of page s // n)
    word_b,j(s) = j-th little-endian uint32 word of slot s's row in buffer b
    C[b, j]     = odd word constants (``word_constants``): the high 31 bits of
                  r = splitmix64(SEED + b * 2**32 + j), the low 33 bits
                  +-(2 * perm31(cantor(b, j)) + 1) mod 2**33 (sign: bit 32 of r)
    inner(s)    = sum_b sum_j zext64(word_b,j(s)) * C[b, j]        (mod 2**64)
    poskey(p)   = splitmix64(POS_SEED + p)
    digest(s,p) = fmix64(inner(s) XOR poskey(p))
    block digest = wrapping (mod 2**64) sum of its token digests

All values are 64-bit; they are stored as torch.int64 (same bits, read signed).

Properties (docs/design.md, "Checksum strength", has every fault model and its figures):
* Every change confined to one word changes the digest: a change d with
  0 < |d| < 2**32 changes inner by d * C mod 2**64, never 0 as C is odd;
  XOR with a fixed poskey and fmix64 are bijections on 64-bit values.
* Every two-bit flip in a token's KV changes its digest, wherever the bits are.
  Flips of bits k1 < k2 in two words change inner by 2**k1 * (odd), never 0
  (more generally: a fault is caught if an odd number of words change at its
  least changed bit). Flips of the same bit k (< 32) in words u and v are
  missed iff C_u = +-C_v mod 2**(64 - k), and no two constants agree mod 2**33
  up to sign: their low 33 bits are +-(2 * perm31(i) + 1) with i = cantor(b, j)
  injective and below 2**31 while b + j <= MAX_INDEX_SUM (perm31 a bijection of
  31-bit values). Random constants would have ~N**2 * 2**-31 such blind pairs
  among a token's N words (a few at 80k words), each blind in every token.
* Moving a row to another slot/position changes its poskey; reorderings and
  random multi-word corruptions are missed with probability ~2**-64 (inner
  is a pseudo-random linear form; fmix64 spreads it before the block sum).

Implementation notes: torch int64 ``+``/``*``/``sum``/``index_add_`` wrap
mod 2**64 (checked by the tests); torch ``>>`` on int64 is arithmetic, so the
logical shift masks off the sign-extended high bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MASK64 = (1 << 64) - 1

# Fixed seeds ("kvguardC" / "kvguardP" in ASCII). Changing them changes every
# digest, so they are part of the on-wire/on-disk format.
SEED = 0x6B76677561726443
POS_SEED = 0x6B76677561726450

# splitmix64 / fmix64 constants (unsigned).
SM_GAMMA = 0x9E3779B97F4A7C15
SM_M1 = 0xBF58476D1CE4E5B9
SM_M2 = 0x94D049BB133111EB
FMIX_M1 = 0xFF51AFD7ED558CCD
FMIX_M2 = 0xC4CEB9FE1A85EC53

# Target number of int64 elements per temporary when chunking over slots
# (4 MiB: large enough to amortise per-op overhead, small enough to stay in
# L2/L3 across the gather/convert/multiply/sum passes on CPU).
_CHUNK_ELEMS = 1 << 19


def to_signed64(x: int) -> int:
    """Unsigned 64-bit Python int -> the signed int64 with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


def to_unsigned64(x: int) -> int:
    return x & MASK64


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 output function applied to state x (int64 bits in/out)."""
    z = x.to(torch.int64) + to_signed64(SM_GAMMA)
    z = (z ^ _lsr(z, 30)) * to_signed64(SM_M1)
    z = (z ^ _lsr(z, 27)) * to_signed64(SM_M2)
    return z ^ _lsr(z, 31)


def fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 64-bit finalizer (bijective), int64 bits in/out."""
    x = x ^ _lsr(x, 33)
    x = x * to_signed64(FMIX_M1)
    x = x ^ _lsr(x, 33)
    x = x * to_signed64(FMIX_M2)
    return x ^ _lsr(x, 33)


def poskey(positions: torch.Tensor) -> torch.Tensor:
    return splitmix64(positions.to(torch.int64) + to_signed64(POS_SEED))


_POSKEY_TABLE = torch.empty(0, dtype=torch.int64)


def poskey_cpu(positions: torch.Tensor) -> torch.Tensor:
    """poskey by table lookup on CPU (positions are bounded by the context length; the table
    grows by powers of two): one gather instead of a dozen elementwise ops per call."""
    global _POSKEY_TABLE
    positions = positions.to(torch.int64)
    if positions.numel() == 0:
        return positions.clone()
    hi = int(positions.max())
    lo = int(positions.min())
    if lo < 0 or hi >= 1 << 24:
        return poskey(positions)
    if hi >= _POSKEY_TABLE.numel():
        _POSKEY_TABLE = poskey(torch.arange(max(4096, 1 << hi.bit_length()), dtype=torch.int64))
    return _POSKEY_TABLE[positions]


# Version of the token digest's definition: 2 since the word constants' low 33 bits are
# constructed (no blind two-bit pairs). Servers that compare seals (the PD hand-off) fold it into
# their layout signature, so two versions never compare digests.
DIGEST_VERSION = 2

# The low bits of the word constants: 33 of them are constructed, distinct up to sign per (b, j).
LOW_BITS = 33
_LOW_MASK = (1 << LOW_BITS) - 1
_M31 = (1 << 31) - 1
_PERM_SEED = SEED & _M31
_PERM_M1, _PERM_M2 = 0x2C1B3C6D, 0x297A2D39  # odd: x -> x * M mod 2**31 is a bijection
# Largest b + j for which cantor(b, j) < 2**31: the constructed bits are distinct up to sign for
# every (b, j) with b + j <= MAX_INDEX_SUM (e.g. 32,767 buffers of rows up to 32,768 words).
MAX_INDEX_SUM = 65534


def perm31(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**31) (xor-shift / odd-multiply rounds, each invertible mod 2**31):
    spreads the constructed low bits so they carry no arithmetic progression (which would let
    three- and four-word faults cancel). Inputs are masked to 31 bits; no step overflows int64."""
    x = (x & _M31) ^ _PERM_SEED
    x = ((x ^ (x >> 16)) * _PERM_M1) & _M31
    x = ((x ^ (x >> 15)) * _PERM_M2) & _M31
    return x ^ (x >> 16)


def cantor(b: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Cantor's pairing of (b, j): injective on all pairs, below 2**31 while b + j <= 65534."""
    s = b + j
    return s * (s + 1) // 2 + j


_CONST_CACHE: dict[tuple[int, int, str], torch.Tensor] = {}


def word_constants(
    num_buffers: int, words_per_row: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """int64 [num_buffers, words_per_row], the odd word constants C[b, j]: r = splitmix64(SEED +
    b*2**32 + j) with its low 33 bits replaced by +-(2 * perm31(cantor(b, j)) + 1) mod 2**33, the
    sign bit 32 of r. No two constants with b + j <= ``MAX_INDEX_SUM`` agree mod 2**33 up to sign
    (docs/design.md, "Checksum strength"). Every implementation reads this one table.

    C[b, j] depends only on (b, j), so a table built for a larger
    ``words_per_row`` agrees with a smaller one on the common prefix.
    """
    device = torch.device(device if device is not None else "cpu")
    key = (int(num_buffers), int(words_per_row), str(device))
    c = _CONST_CACHE.get(key)
    if c is None:
        b = torch.arange(num_buffers, dtype=torch.int64).unsqueeze(1)
        j = torch.arange(words_per_row, dtype=torch.int64).unsqueeze(0)
        # b * 2**32 wraps harmlessly for b >= 2**31 (never in practice).
        r = splitmix64(to_signed64(SEED) + (b << 32) + j)
        low = 2 * perm31(cantor(b, j)) + 1  # odd, in [1, 2**32)
        low = torch.where(_lsr(r, 32) & 1 == 1, (1 << LOW_BITS) - low, low)  # -low mod 2**33
        c = ((r & to_signed64(MASK64 ^ _LOW_MASK)) | low).to(device)
        _CONST_CACHE[key] = c
    return c


@dataclass(frozen=True, eq=False)
class PageMajor:
    """A KV buffer stored page-major: slot s's row is row ``s % per_page`` of page
    ``s // per_page`` (DSA's index keys: each page holds 64 keys, then their 64 scales).
    ``words``: int32 [num_pages, per_page, words_per_row], a strided view of the pool's bytes."""

    words: torch.Tensor

    def data_ptr(self) -> int:  # where its first row starts: how a read names the buffer
        return int(self.words.data_ptr())

    @property
    def device(self) -> torch.device:
        return self.words.device


# What the checksum reads: a slot-major tensor [num_slots, ...] or a page-major view.
KvBuffer = torch.Tensor | PageMajor


def page_major(
    buf: torch.Tensor, *, offset: int, slot_bytes: int, row_bytes: int, per_page: int
) -> PageMajor:
    """The rows of ``row_bytes`` bytes at byte ``offset + o * slot_bytes`` of each page
    ``buf[p]`` (``buf``: [num_pages, page_bytes], rows contiguous), ``per_page`` of them."""
    u8 = buf.view(torch.uint8) if buf.dtype != torch.uint8 else buf
    if u8.dim() != 2 or (u8.shape[1] > 1 and u8.stride(1) != 1):
        raise ValueError("a page-major buffer is [num_pages, page_bytes] with contiguous pages")
    if offset + (per_page - 1) * slot_bytes + row_bytes > u8.shape[1] or row_bytes > slot_bytes:
        raise ValueError(f"{per_page} rows of {row_bytes} bytes do not fit a page")
    page_bytes = u8.stride(0) if u8.shape[0] > 1 else u8.shape[1]
    start = u8.storage_offset() + offset
    if any(v % 4 for v in (row_bytes, slot_bytes, page_bytes, start, u8.data_ptr() + offset)):
        raise ValueError("page-major rows, strides and offsets must be multiples of 4 bytes")
    rows = u8.as_strided((u8.shape[0], per_page, row_bytes), (page_bytes, slot_bytes, 1), start)
    return PageMajor(rows.view(torch.int32))


def row_words(buf: KvBuffer) -> torch.Tensor:
    """View buffer [num_slots, ...] as int32 words [num_slots, words_per_row] (no copy); a
    ``PageMajor`` buffer as its [num_pages, per_page, words_per_row] words.

    Requires each slot's row to be contiguous and its byte size and the slot
    stride (in bytes) to be multiples of 4.
    """
    if isinstance(buf, PageMajor):
        return buf.words
    if buf.dim() == 0:
        raise ValueError("KV buffer must have a slot dimension")
    b = buf.unsqueeze(1) if buf.dim() == 1 else buf
    expected = 1
    for d in range(b.dim() - 1, 0, -1):
        if b.shape[d] != 1 and b.stride(d) != expected:
            raise ValueError("each slot's KV row must be contiguous")
        expected *= b.shape[d]
    b = b.flatten(1)  # a view, since the row is contiguous
    b = b.as_strided(b.shape, (b.stride(0), 1))  # normalise size-1 strides
    row_bytes = b.shape[1] * b.element_size()
    if row_bytes % 4 != 0:
        raise ValueError(f"KV row size {row_bytes} bytes is not a multiple of 4")
    if b.shape[0] > 1 and (b.stride(0) * b.element_size()) % 4 != 0:
        raise ValueError("KV slot stride in bytes is not a multiple of 4")
    if b.shape[0] <= 1:
        b = b.as_strided(b.shape, (b.shape[1], 1))
    if buf.data_ptr() % 4 != 0:
        raise ValueError("KV buffer base is not 4-byte aligned")
    return b.view(torch.int32)


_VIEW_CACHE: dict[tuple[int, ...], tuple[Sequence[KvBuffer], list[torch.Tensor]]] = {}


def _row_word_views(buffers: Sequence[KvBuffer]) -> list[torch.Tensor]:
    """``row_words`` of each buffer, cached per pool (the engine hashes the same buffers every
    step; the layout checks need not run each time)."""
    key = (id(buffers), len(buffers), buffers[0].data_ptr(), buffers[-1].data_ptr())
    hit = _VIEW_CACHE.get(key)
    if hit is not None and hit[0] is buffers:  # the same list object (ids can be recycled)
        return hit[1]
    if len(_VIEW_CACHE) >= 8:
        _VIEW_CACHE.clear()
    views = [row_words(b) for b in buffers]
    _VIEW_CACHE[key] = (buffers, views)
    return views


def gather_words(words: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows of ``slots`` from a ``row_words`` view: int32 [N, words_per_row], one gather
    (two-level for a page-major buffer: page = slot // per_page, row = slot % per_page)."""
    if words.dim() == 2:
        return torch.index_select(words, 0, slots)
    per_page = words.shape[1]
    return words[slots // per_page, slots % per_page]


def inner_sums_ref(buffers: Sequence[KvBuffer], slots: torch.Tensor) -> torch.Tensor:
    """inner(s) for each slot in ``slots``: int64 [N] (wrapping)."""
    device = buffers[0].device if buffers else slots.device
    slots = slots.to(device=device, dtype=torch.int64)
    n = slots.numel()
    views = _row_word_views(buffers)
    wmax = max((v.shape[-1] for v in views), default=0)
    consts = word_constants(len(views), wmax, device)
    if n == 0 or wmax == 0:
        return torch.zeros(n, dtype=torch.int64, device=device)
    if n * len(views) * wmax <= _CHUNK_ELEMS and all(v.shape[-1] == wmax for v in views):
        # Small batches (the engine's per-step calls): one gather per buffer, then a single
        # widen/mask/multiply/sum over all buffers; per-op overhead dominates at this size.
        # Wrapping integer sums are order-independent, so this equals the chunked loop below.
        x = torch.stack([gather_words(v, slots) for v in views], 1).to(torch.int64)
        return x.bitwise_and_(0xFFFFFFFF).mul_(consts).sum((1, 2))
    inner = torch.zeros(n, dtype=torch.int64, device=device)
    # Chunk over slots so temporaries stay ~_CHUNK_ELEMS elements; the work
    # buffers are allocated once per call and reused (fresh large CPU
    # allocations page-fault on every chunk).
    step = max(1, min(n, _CHUNK_ELEMS // wmax))
    g32 = torch.empty(step * wmax, dtype=torch.int32, device=device)
    x64 = torch.empty(step * wmax, dtype=torch.int64, device=device)
    wmin = min(v.shape[-1] for v in views if v.shape[-1] > 0)
    part = torch.empty(min(n, (step * wmax) // wmin), dtype=torch.int64, device=device)
    for bi, v in enumerate(views):
        w = v.shape[-1]
        if w == 0:
            continue
        c = consts[bi, :w]
        step_b = max(1, min(n, (step * wmax) // w))
        for lo in range(0, n, step_b):
            hi = min(n, lo + step_b)
            m = hi - lo
            g = g32[: m * w].view(m, w)
            if v.dim() == 2:
                torch.index_select(v, 0, slots[lo:hi], out=g)  # gather rows
            else:
                g.copy_(gather_words(v, slots[lo:hi]))
            x = x64[: m * w].view(m, w)
            x.copy_(g)  # sign-extends int32 -> int64 ...
            x.bitwise_and_(0xFFFFFFFF)  # ... so mask: zext64 of the uint32 word
            x.mul_(c)  # wrapping 64-bit multiply by the odd constants
            p = part[:m]
            torch.sum(x, 1, out=p)  # wrapping sum over words
            inner[lo:hi] += p
    return inner


def token_digests_ref(
    buffers: Sequence[KvBuffer], slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Token digests, int64 [N]. ``buffers`` = [k0, v0, k1, v1, ...]."""
    if slots.dim() != 1 or positions.dim() != 1 or slots.numel() != positions.numel():
        raise ValueError("slots and positions must be 1-D of equal length")
    if len(buffers) == 0:
        raise ValueError("need at least one KV buffer")
    inner = inner_sums_ref(buffers, slots)
    positions = positions.to(inner.device)
    return fmix64(
        inner ^ (poskey_cpu(positions) if inner.device.type == "cpu" else poskey(positions))
    )


def block_digests(
    token_digests: torch.Tensor, block_ids: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """Wrapping (mod 2**64) sum of token digests per block: int64 [num_blocks]."""
    out = torch.zeros(num_blocks, dtype=torch.int64, device=token_digests.device)
    return out.index_add_(0, block_ids.to(torch.int64), token_digests.to(torch.int64))

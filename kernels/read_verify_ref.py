"""Verified reads, the torch reference (the specification ``csrc/read_verify.c`` reproduces bit
for bit; ``tests/test_read_verify.py`` holds them to it).

Attention gathers, each layer, the KV rows its batch reads. ``gather_rows`` is that gather with
the token checksum (``kv_checksum_ref``) folded in: besides the rows (copied, or looked up in a
256-entry FP8 dequantization table), each row read adds its buffer's part of ``inner`` into a
per-row accumulator. ``inner`` is linear in the buffers, so after the last layer the accumulator
holds, for every position read, the ``inner`` of exactly the bytes attention consumed, and the
token digest follows: ``fmix64(inner XOR poskey(position))``.

``verify_reads`` then judges each request: for every logical page it read, the digests of the
positions read there must add up to the page's sealed digest, the page must be sealed exactly
that far, each position must sit at its own offset of that one page, and the tags of the pages
read (``page_tag(epoch, logical index)``) must add up to what the request's row holds: so the
bytes are the ones sealed, and the pages are the row's own, whatever the page table said by the
time it was read.
"""

from __future__ import annotations

import torch

from .guard_ref import page_tag
from .kv_checksum_ref import fmix64, poskey, row_words, to_signed64, word_constants

# Added to a row's accumulator when its slot lies outside the pool: nothing is read there and the
# row can no longer match a digest (a corrupted page table must not crash the gather).
OUT_OF_POOL = to_signed64(0xA5A5F00DDEADBEEF)


def buffer_constants(buffer_index: int, row_bytes: int) -> torch.Tensor:
    """int64 C[b, 0 : row_bytes / 4]: the word constants of KV buffer ``b`` (the pool's buffer
    order: MHA ``[k0, v0, k1, v1, ...]``, MLA ``[latent0, latent1, ...]``)."""
    return word_constants(buffer_index + 1, row_bytes // 4)[buffer_index].clone()


def gather_rows(
    cache: torch.Tensor,
    rows: torch.Tensor,
    table: torch.Tensor | None = None,
    consts: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cache[rows]`` (``table[cache[rows]]`` with an FP8 table), shaped ``[n, *cache.shape[1:]]``;
    with ``consts`` (``buffer_constants``) and ``acc`` (int64 [n]), each row's inner part is added
    into ``acc``. A row outside the pool reads as zeros and adds ``OUT_OF_POOL``."""
    num_slots = cache.shape[0]
    rows = rows.to(torch.int64)
    inside = (rows >= 0) & (rows < num_slots)
    safe = torch.where(inside, rows, torch.zeros_like(rows))
    if acc is not None and consts is not None:
        words = row_words(cache)[safe].to(torch.int64).bitwise_and_(0xFFFFFFFF)
        part = (words * consts[None, : words.shape[1]]).sum(1)
        acc += torch.where(inside, part, torch.full_like(part, OUT_OF_POOL))
    flat = cache.view(torch.uint8).reshape(num_slots, -1)[safe]
    flat[~inside] = 0
    if table is None:
        return flat.view(cache.dtype).view(rows.shape[0], *cache.shape[1:])
    out = table[flat.to(torch.int64)]
    out[~inside] = 0
    return out.view(rows.shape[0], *cache.shape[1:])


def hash_rows(src: torch.Tensor, consts: torch.Tensor, acc: torch.Tensor) -> None:
    """The writer's side of ``gather_rows``: ``acc[i] +=`` the inner part of row ``i`` of ``src``
    ``[n, ...]``, the bytes a layer hands its pool's store for its i-th written token (after the
    cast to the storage dtype). Their digest is sealed, so what attention later reads, and what
    lands, is checked against what was meant to land, not against whatever the pool holds."""
    if src.shape[0] == 0:
        return
    words = row_words(src).to(torch.int64).bitwise_and_(0xFFFFFFFF)
    acc += (words * consts[None, : words.shape[1]]).sum(1)


def verify_reads(
    acc: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: list[int],
    req_rows: torch.Tensor,
    page_size: int,
    num_slots: int,
    digest: torch.Tensor,
    fill: torch.Tensor,
    epoch: torch.Tensor,
    agg: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bad [B] bool, pages whose content disagrees [k] int64, in request then page order: only
    those of readers whose page tags hold, i.e. that do hold them)."""
    ps = page_size
    if min(seq_lens, default=0) < 0:
        raise ValueError("verify_reads: a negative read length")
    bad = torch.zeros(len(seq_lens), dtype=torch.bool)
    bad_pages: list[int] = []
    start = 0
    for b, L in enumerate(seq_lens):
        seg_rows, seg_acc = rows[start : start + L], acc[start : start + L]
        pos = torch.arange(L, dtype=torch.int64)
        digests = fmix64(seg_acc ^ poskey(pos))
        tags, listed = 0, len(bad_pages)
        for j in range(-(-L // ps)):
            lo, hi = j * ps, min(L, (j + 1) * ps)
            head = int(seg_rows[lo])
            if not 0 <= head < num_slots:
                bad[b] = True
                continue
            page = head // ps
            placed = bool((seg_rows[lo:hi] == page * ps + torch.arange(hi - lo)).all())
            tags += int(page_tag(epoch[page : page + 1], torch.tensor([j]))[0])
            if not placed or int(fill[page]) != hi - lo:
                bad[b] = True  # unsealed or misplaced: the request is wrong, not the page's bytes
            elif int(digests[lo:hi].sum()) != int(digest[page]):
                bad[b] = True
                bad_pages.append(page)
        row = int(req_rows[b])
        if not 0 <= row < agg.numel() or to_signed64(tags) != int(agg[row]):
            # not (all) the row's own pages: the reader is wrong, not the pages' content (a page
            # claimed since by its new owner must not be quarantined on a stale read)
            bad[b] = True
            del bad_pages[listed:]
        start += L
    return bad, torch.tensor(bad_pages, dtype=torch.int64)

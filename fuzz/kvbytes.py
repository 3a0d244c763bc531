"""The KV pool's bytes as the injectors touch them, by slot: every per-slot buffer of an MHA pool
(``k_buffer`` and ``v_buffer``: K and V per layer) or of an MLA pool (``kv_buffer``: one
compressed latent row, ``kv_lora_rank + rope_dim`` wide, per token and layer). Slot ``s`` is
row ``s`` of every such buffer whatever its kind, so the injectors need no other pool knowledge.

A DSA (GLM-5) pool is an MLA pool plus, per indexer layer, its index keys, laid out as the guard's
adapter defines them (``patches.adapter.index_key_layout``)
(``index_k_with_scale_buffer``: ``[pages, page_size * (index_head_dim + 4)]`` bytes, page-major:
page ``p`` holds the FP8 keys of slots ``p * page_size ...`` token by token, then their fp32
scales). ``kv_buffers`` are its latents (what ``bit_flip`` and the other latent classes flip);
``index_rows`` its index keys and scales by slot (the index-key classes'); a snapshot, write,
zero or comparison of slots covers both, as the page's one lifecycle does."""

from __future__ import annotations

import random

import torch

from kvguard.patches.adapter import index_key_layers, index_key_layout


def kv_buffers(pool) -> list[torch.Tensor]:
    """Every buffer that stores a slot's KV: ``[k0, v0, k1, v1, ...]`` (MHA) or
    ``[latent0, latent1, ...]`` (MLA)."""
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        return [b for pair in zip(pool.k_buffer, pool.v_buffer) for b in pair]
    if hasattr(pool, "kv_buffer"):
        return list(pool.kv_buffer)
    raise TypeError(
        f"the fuzz injectors know MHA (k_buffer/v_buffer) and MLA (kv_buffer) KV pools, "
        f"not {type(pool).__name__}"
    )


def is_dsa(pool) -> bool:
    """Whether the pool keeps DSA index keys beside its KV (``index_k_with_scale_buffer``)."""
    return hasattr(pool, "index_k_with_scale_buffer")


def index_rows(pool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per indexer layer that stores index keys (a layer reusing the previous one's top-k stores
    none), ``(keys, scales)`` as ``[pages, page_size, bytes]`` views of its buffer: slot ``s``'s
    key is ``keys[s // page_size, s % page_size]`` (``index_head_dim`` FP8 bytes), its scale the
    same row of ``scales`` (4 bytes, fp32). Raises TypeError for a pool without index keys and for
    index pages other than one allocator page of one key per token (as the guard's adapter)."""
    if not is_dsa(pool):
        raise TypeError(
            f"index-key faults need a DSA pool's index keys (index_k_with_scale_buffer): "
            f"{type(pool).__name__} has none; inject them into a DSA model (GLM-5, DeepSeek V3.2)"
        )
    try:  # the guard's own definition of the layout: the oracle reads the bytes it hashes
        ps, dim, scale = index_key_layout(pool)
        layers = index_key_layers(pool)
    except ValueError as exc:
        raise TypeError(str(exc)) from exc
    out = []
    for buf in layers:
        keys = buf[:, : ps * dim].unflatten(1, (ps, dim))  # views: writes land in the pool
        scales = buf[:, ps * dim : ps * (dim + scale)].unflatten(1, (ps, scale))
        out.append((keys, scales))
    return out


def _parts(pool) -> list[tuple[torch.Tensor, int]]:
    """Every per-slot part of the pool: (tensor, 0) for a slot-major buffer (row ``s``), and
    (tensor, page size) for a page-major ``[pages, page_size, bytes]`` view (DSA index keys)."""
    out = [(b, 0) for b in kv_buffers(pool)]
    if is_dsa(pool):
        ps = pool.page_size
        out += [(part, ps) for pair in index_rows(pool) for part in pair]
    return out


def _at(paged: int, slots: torch.Tensor) -> tuple:
    """The index of these slots' rows in a part (see ``_parts``)."""
    return (slots,) if not paged else (slots // paged, slots % paged)


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """[n, ...] rows of one buffer as [n, bytes] (a copy: advanced indexing gathers)."""
    return rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)


def snapshot(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """The slots' bytes in every buffer (to write back later, or to compare with)."""
    return [b[_at(paged, slots)].clone() for b, paged in _parts(pool)]


def write(pool, slots: torch.Tensor, saved: list[torch.Tensor]) -> None:
    """Write bytes taken by ``snapshot`` into these slots (a late transfer, a restore)."""
    for (buf, paged), rows in zip(_parts(pool), saved):
        buf[_at(paged, slots)] = rows


def zero(pool, slots: torch.Tensor) -> None:
    """The slots as a load that has not landed yet leaves them: zero bytes."""
    for buf, paged in _parts(pool):
        buf[_at(paged, slots)] = 0


def flip_bit(pool, slot: int, rng: random.Random) -> dict:
    """Flip one random bit of one slot in one random buffer; returns where."""
    bufs = kv_buffers(pool)
    which = rng.randrange(len(bufs))
    row = bufs[which][slot].view(torch.uint8).reshape(-1)  # a view: the flip lands in the pool
    byte, bit = rng.randrange(row.numel()), rng.randrange(8)
    row[byte] ^= 1 << bit
    return {"buffer": which, "byte": byte, "bit": bit}


def layer_buffers(pool, layer: int) -> dict[str, torch.Tensor]:
    """One layer's buffers by name: ``{"k": ..., "v": ...}`` (MHA) or ``{"kv": ...}`` (MLA);
    ``layer`` counts from the pool's first layer (``layer_id - pool.start_layer``)."""
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        return {"k": pool.k_buffer[layer], "v": pool.v_buffer[layer]}
    if hasattr(pool, "kv_buffer"):
        return {"kv": pool.kv_buffer[layer]}
    kv_buffers(pool)  # raises: a pool kind the injectors do not know
    return {}


def num_layers(pool) -> int:
    return len(pool.k_buffer) if hasattr(pool, "k_buffer") else len(kv_buffers(pool))


def _as_float(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, element bytes] uint8 -> [n] float32 values (bytes stored as uint8: FP8 e4m3)."""
    if dtype in (torch.uint8, torch.int8):
        dtype = torch.float8_e4m3fn
    return raw.contiguous().view(dtype).reshape(-1).to(torch.float32, copy=True)


def flip_exponent(buf: torch.Tensor, slot: int, gain: torch.Tensor | None = None) -> dict:
    """Flip the highest exponent bit of one element of ``slot``'s row in ``buf`` (bit 6 of its
    most significant byte: FP8 e4m3/e5m2, bf16, fp16 and fp32 alike), in place. Of the
    elements whose bit is clear (the flip multiplies them: x256 in FP8 e4m3) and whose flipped
    value stays finite, the one whose change weighs most: by ``gain`` (per element, how much a
    change of it moves what a reader computes, e.g. a reader's query for a K row: the change's
    signed effect on its attention logit), else by its magnitude. The worst one such flip can
    do to the row. Returns where, and the value before and after."""
    row = buf[slot]  # a view: the flip lands in the pool
    width = row.element_size()
    raw = row.reshape(-1).view(torch.uint8).reshape(-1, width)  # little endian: last = high
    flipped = raw.clone()
    flipped[:, width - 1] ^= 0x40
    before, after = _as_float(raw, buf.dtype), _as_float(flipped, buf.dtype)
    ok = ((raw[:, width - 1] & 0x40) == 0) & torch.isfinite(after)
    if not bool(ok.any()):
        ok = torch.isfinite(after)
    if gain is not None and gain.numel() == before.numel():
        effect = gain.reshape(-1).to(torch.float32) * (after - before)
    else:
        effect = before.abs()
    score = torch.where(ok, effect, torch.full_like(before, -torch.inf))
    elem = int(score.argmax())
    raw[elem, width - 1] ^= 0x40
    return {
        "element": elem,
        "byte": elem * width + width - 1,
        "bit": 6,
        "value": [float(before[elem]), float(after[elem])],
    }


def changed(pool, slots: torch.Tensor, saved: list[torch.Tensor]) -> torch.Tensor:
    """[n] bool: which slots' bytes differ (in any buffer) from a ``snapshot``. Bytes, not values:
    a NaN equals itself here."""
    out = torch.zeros(slots.numel(), dtype=torch.bool)
    for (buf, paged), rows in zip(_parts(pool), saved):
        out |= (_bytes(buf[_at(paged, slots)]) != _bytes(rows)).any(dim=1).cpu()
    return out


def flip_index_bit(pool, slot: int, rng: random.Random) -> dict:
    """Flip one random bit of ``slot``'s index key or of its scale (one in five: the scale's 4
    bytes against the key's 128), in one random indexer layer; returns where."""
    rows = index_rows(pool)
    layer = rng.randrange(len(rows))
    part = "scale" if rng.random() < 0.2 else "key"
    ps = pool.page_size
    row = rows[layer][part == "scale"][slot // ps, slot % ps]  # a view: the flip lands in the pool
    byte, bit = rng.randrange(row.numel()), rng.randrange(8)
    row[byte] ^= 1 << bit
    return {"index_layer": layer, "part": part, "byte": byte, "bit": bit}


def copy_index_key(pool, src: int, dst: int, layer: int) -> bool:
    """Copy slot ``src``'s index key and scale over slot ``dst``'s in one indexer layer (a
    misdirected index-key write); False, and nothing written, if the two are byte-equal."""
    ps = pool.page_size
    keys, scales = index_rows(pool)[layer]
    s, d = (src // ps, src % ps), (dst // ps, dst % ps)
    if torch.equal(keys[s], keys[d]) and torch.equal(scales[s], scales[d]):
        return False
    keys[d] = keys[s].clone()
    scales[d] = scales[s].clone()
    return True

"""The KV pool's bytes as the injectors touch them, by slot: every per-slot buffer of an MHA pool
(``k_buffer`` and ``v_buffer``: K and V per layer) or of an MLA pool (``kv_buffer``: one
compressed latent row, ``kv_lora_rank + rope_dim`` wide, per token and layer). Slot ``s`` is
row ``s`` of every buffer whatever its kind, so the injectors need no other pool knowledge."""

from __future__ import annotations

import random

import torch


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


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """[n, ...] rows of one buffer as [n, bytes] (a copy: advanced indexing gathers)."""
    return rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)


def snapshot(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    """The slots' bytes in every buffer (to write back later, or to compare with)."""
    return [b[slots].clone() for b in kv_buffers(pool)]


def write(pool, slots: torch.Tensor, saved: list[torch.Tensor]) -> None:
    """Write bytes taken by ``snapshot`` into these slots (a late transfer, a restore)."""
    for buf, rows in zip(kv_buffers(pool), saved):
        buf[slots] = rows


def zero(pool, slots: torch.Tensor) -> None:
    """The slots as a load that has not landed yet leaves them: zero bytes."""
    for buf in kv_buffers(pool):
        buf[slots] = torch.zeros_like(buf[slots])


def flip_bit(pool, slot: int, rng: random.Random) -> dict:
    """Flip one random bit of one slot in one random buffer; returns where."""
    bufs = kv_buffers(pool)
    which = rng.randrange(len(bufs))
    row = bufs[which][slot].view(torch.uint8).reshape(-1)  # a view: the flip lands in the pool
    byte, bit = rng.randrange(row.numel()), rng.randrange(8)
    row[byte] ^= 1 << bit
    return {"buffer": which, "byte": byte, "bit": bit}


def changed(pool, slots: torch.Tensor, saved: list[torch.Tensor]) -> torch.Tensor:
    """[n] bool: which slots' bytes differ (in any buffer) from a ``snapshot``. Bytes, not values:
    a NaN equals itself here."""
    out = torch.zeros(slots.numel(), dtype=torch.bool)
    for buf, rows in zip(kv_buffers(pool), saved):
        out |= (_bytes(buf[slots]) != _bytes(rows)).any(dim=1).cpu()
    return out

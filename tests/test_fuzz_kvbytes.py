"""The fuzz injectors' KV byte paths (bit flip, stale write, load in flight) on SGLang's real pools,
without an engine: MHA (K and V per layer, bf16 and FP8-as-uint8) and MLA (one latent row of
kv_lora_rank + rope_dim per token and layer, the DeepSeek/Kimi layout)."""

from __future__ import annotations

import random

import pytest
import torch

from kvguard.fuzz import kvbytes

LAYERS, PAGE = 2, 16


def _mha(dtype):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=64,
        page_size=PAGE,
        dtype=dtype,
        head_num=2,
        head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


def _mla(dtype):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return MLATokenToKVPool(
        size=64,
        page_size=PAGE,
        dtype=dtype,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


POOLS = {
    "mha-bf16": (lambda: _mha(torch.bfloat16), 2 * LAYERS, 2 * 8 * 2),
    "mha-fp8": (lambda: _mha(torch.float8_e4m3fn), 2 * LAYERS, 2 * 8),
    "mla-bf16": (lambda: _mla(torch.bfloat16), LAYERS, (32 + 8) * 2),
}


def _fill(bufs):
    gen = torch.Generator().manual_seed(0)
    for b in bufs:
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(1, 255, raw.shape, generator=gen, dtype=torch.uint8))


@pytest.mark.parametrize("kind", POOLS)
def test_byte_paths_on_real_pools(kind):
    make, num_buffers, row_bytes = POOLS[kind]
    pool = make()
    bufs = kvbytes.kv_buffers(pool)
    assert len(bufs) == num_buffers
    assert all(b[0].numel() * b.element_size() == row_bytes for b in bufs)
    _fill(bufs)
    slots = torch.arange(PAGE, 2 * PAGE)
    saved = kvbytes.snapshot(pool, slots)
    assert not kvbytes.changed(pool, slots, saved).any()

    kvbytes.zero(pool, slots)  # a load not landed yet (read_before_ready)
    assert kvbytes.changed(pool, slots, saved).all()
    assert all(int(b[slots].view(torch.uint8).sum()) == 0 for b in bufs)
    kvbytes.write(pool, slots, saved)  # the load lands / a stale transfer writes old bytes back
    assert not kvbytes.changed(pool, slots, saved).any()

    before = [b.clone() for b in bufs]
    where = kvbytes.flip_bit(pool, 20, random.Random(3))
    flipped = kvbytes.changed(pool, slots, saved)
    assert flipped.tolist() == [s == 20 for s in slots.tolist()]  # that slot, in the pool itself
    diff = [(b.view(torch.uint8) ^ o.view(torch.uint8)).reshape(-1) for b, o in zip(bufs, before)]
    assert [int(d.ne(0).sum()) for d in diff] == [
        int(i == where["buffer"]) for i in range(len(bufs))
    ]
    byte = diff[where["buffer"]].reshape(bufs[0].shape[0], -1)[20]
    assert int(byte[where["byte"]]) == 1 << where["bit"] and 0 <= where["byte"] < row_bytes


def test_unknown_pool_is_refused_clearly():
    with pytest.raises(TypeError, match=r"MHA .* and MLA .* KV pools, not object"):
        kvbytes.kv_buffers(object())

"""The guard takes a pool's buffers by kind through one adapter, and refuses in one line what
it cannot model; its own memory is taken from the KV budget SGLang sizes the pool from."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

from kvguard.patches.adapter import UnsupportedPoolError, guarded_kv_buffers
from kvguard.patches.pool_budget import guard_bytes_per_token


def _mha(**kw):
    return MHATokenToKVPool(
        size=64, page_size=16, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=2,
        device="cpu", enable_memory_saver=False, **kw,
    )  # fmt: skip


def _mla(lora: int, rope: int, dtype=torch.bfloat16):
    return MLATokenToKVPool(
        size=64, page_size=16, dtype=dtype, kv_lora_rank=lora, qk_rope_head_dim=rope,
        layer_num=2, device="cpu", enable_memory_saver=False,
    )  # fmt: skip


def test_buffers_by_pool_kind():
    kind, bufs = guarded_kv_buffers(_mha())
    assert kind == "mha" and len(bufs) == 4  # K and V of each layer
    kind, bufs = guarded_kv_buffers(_mla(64, 16))
    assert kind == "mla" and len(bufs) == 2 and bufs[0].shape[-1] == 80  # one latent per layer


def test_unmodelled_pools_are_refused_in_one_line():
    class OtherPool:
        pass

    with pytest.raises(UnsupportedPoolError, match="cannot guard the KV pool OtherPool"):
        guarded_kv_buffers(OtherPool())
    # an FP8 latent row of 81 bytes is not a whole number of 32-bit words
    with pytest.raises(UnsupportedPoolError, match="not a multiple of 4"):
        guarded_kv_buffers(_mla(65, 16, torch.float8_e4m3fn))


def test_guard_share_of_the_budget():
    from kvguard.patches.pool_budget import around_calculate_pool_sizes

    class Configurator:  # SGLang's DefaultPoolConfigurator divides the budget by this
        _cell_size = 1024

    seen = []
    around_calculate_pool_sizes(lambda c, b, ps: seen.append(b), Configurator(), 10**9, 16)
    per_token = guard_bytes_per_token(16)
    assert per_token == (72 + 25) / 16
    assert seen[0] == int(10**9 * 1024 / (1024 + per_token))

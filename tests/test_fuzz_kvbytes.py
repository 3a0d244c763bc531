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


# -- a DSA (GLM-5) pool: MLA latents plus page-major index keys and scales ------------------------
DSA_PS, DSA_PAGES = 64, 4


def _dsa():
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    return DSATokenToKVPool(
        size=(DSA_PAGES - 1) * DSA_PS, page_size=DSA_PS, kv_lora_rank=128, dtype=torch.bfloat16,
        qk_rope_head_dim=64, layer_num=3, device="cpu", index_head_dim=128,
        enable_memory_saver=False, kv_cache_dim=192, index_buf_size=(DSA_PAGES - 1) * DSA_PS,
        skip_topk_layers=[False, False, True],
    )  # fmt: skip


def test_dsa_index_rows_address_sglang_page_major_layout():
    pool = _dsa()
    raw = pool.index_k_with_scale_buffer
    rows = kvbytes.index_rows(pool)
    assert len(rows) == 2  # the third layer reuses the previous top-k: no index keys
    keys, scales = rows[1]
    slot = 2 * DSA_PS + 9  # page 2, row 9
    keys[2, 9, 5] = 0xAB
    scales[2, 9, 3] = 0xCD
    assert raw[1][2, 9 * 128 + 5] == 0xAB and raw[1][2, 64 * 128 + 9 * 4 + 3] == 0xCD
    assert int(raw[1].ne(0).sum()) == 2 and not raw[0].any()
    # a snapshot, zero, write and comparison of slots cover latents and index keys alike
    _fill(kvbytes.kv_buffers(pool) + list(raw[:2]))
    slots = torch.arange(slot - 3, slot + 3)
    saved = kvbytes.snapshot(pool, slots)
    kvbytes.zero(pool, slots)
    assert not raw[0][2, 6 * 128 : 12 * 128].any() and not raw[0][2, 8192 + 24 : 8192 + 48].any()
    assert raw[0][2, 5 * 128 : 6 * 128].all()  # the slot before: untouched
    kvbytes.write(pool, slots, saved)
    assert not kvbytes.changed(pool, slots, saved).any()
    before = [b.clone() for b in kvbytes.kv_buffers(pool)]
    where = kvbytes.flip_index_bit(pool, slot, random.Random(1))
    assert kvbytes.changed(pool, slots, saved).tolist() == [s == slot for s in slots.tolist()]
    latents = zip(before, kvbytes.kv_buffers(pool))  # bytes: random bf16 bytes hold NaNs
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in latents)
    scale = where["part"] == "scale"
    now = rows[where["index_layer"]][scale][2, 9]
    was = saved[3 + 2 * where["index_layer"] + scale][3]  # 3 latents, then keys/scales per layer
    assert int((now ^ was).ne(0).sum()) == 1 and int(now[where["byte"]] ^ was[where["byte"]]) == (
        1 << where["bit"]
    )
    kvbytes.write(pool, slots, saved)
    # a misplaced key: another slot's key and scale over this one's, in one layer
    src = 1 * DSA_PS + 40
    assert kvbytes.copy_index_key(pool, src, slot, layer=0)
    assert torch.equal(rows[0][0][2, 9], rows[0][0][1, 40])
    assert torch.equal(rows[0][1][2, 9], rows[0][1][1, 40])
    assert kvbytes.changed(pool, slots, saved).tolist() == [s == slot for s in slots.tolist()]
    assert not kvbytes.copy_index_key(pool, src, slot, layer=0)  # equal bytes: nothing to do


def test_index_key_classes_are_refused_without_index_keys():
    from kvguard.fuzz.injectors import INJECTORS, POOL_CLASSES, refusal

    assert set(POOL_CLASSES) == {"index_key_flip", "index_key_misplaced"} <= set(INJECTORS)
    mla = _mla(torch.bfloat16)
    with pytest.raises(TypeError, match="MLATokenToKVPool has none"):
        kvbytes.index_rows(mla)
    assert "MLATokenToKVPool" in refusal("index_key_flip", mla)
    assert refusal("index_key_misplaced", _dsa()) is None and refusal("bit_flip", mla) is None


def test_plugin_drops_an_index_key_entry_on_a_pool_without_index_keys(tmp_path):
    """The plugin logs the refusal as an injector_error naming the entry and moves on to the
    next entry at once; the oracle reports that entry as injector_error, with the reason."""
    import json
    import types

    from kvguard.fuzz import plugin
    from kvguard.fuzz.injectors import INJECTORS
    from kvguard.fuzz.oracle import injections_from_log

    log = tmp_path / "fuzz.jsonl"
    st = plugin.FuzzState(str(tmp_path / "control.json"), str(log))
    plan = [{"id": 1, "cls": "index_key_misplaced", "seed": 1}, {"id": 2, "cls": "bit_flip"}]
    st.queue = [dict(e) for e in plan]
    runner = types.SimpleNamespace(token_to_kv_pool=_mla(torch.bfloat16))
    sched = types.SimpleNamespace(
        tp_group=types.SimpleNamespace(rank_in_group=0),
        tp_worker=types.SimpleNamespace(model_runner=runner),
    )
    tried = []
    injectors = {**INJECTORS, "bit_flip": lambda *a: tried.append(a) or None}
    assert plugin._inject(st, sched, object(), injectors) is None
    assert [e["id"] for e in st.queue] == [2] and not tried  # dropped, nothing injected
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[0]["event"] == "injector_error" and events[0]["id"] == 1
    assert "MLATokenToKVPool" in events[0]["error"]
    recs = injections_from_log(events, plan)
    assert recs[1]["status"] == "injector_error" and "DSA" in recs[1]["detail"]
    assert recs[2]["status"] == "not_run"

"""Both KV structures of a DSA (GLM-5) pool are guarded: a guard over a real SGLang
``DSATokenToKVPool`` (its MLA latents and its page-major index keys and scales, taken through the
adapter) catches a flipped index-key byte, a flipped scale byte and a misplaced index key, through
the per-step check the engine runs (``Guard.before_forward``/``after_forward``/``resolve`` on the
synthetic pool's requests), and aborts exactly the request that reads them."""

from __future__ import annotations

import pytest
import torch
from guard_scenarios import _decode, _two

pytest.importorskip("sglang")

from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
from synthetic_pool import SyntheticPool

from kvguard.ledger import PageState
from kvguard.patches.adapter import guarded_kv_buffers

PS = 64  # DSA's page: the allocator's page is the index-key page
PAGES = 16
KEYS = PS * 128  # per index page: 64 keys of 128 FP8 bytes, then 64 fp32 scales


def _dsa_pool(dtype: torch.dtype = torch.bfloat16) -> DSATokenToKVPool:
    """Three layers, the last one reusing the previous layer's top-k (no index keys)."""
    return DSATokenToKVPool(
        size=(PAGES - 1) * PS, page_size=PS, kv_lora_rank=128, dtype=dtype, qk_rope_head_dim=64,
        layer_num=3, device="cpu", index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=192 if dtype != torch.float8_e4m3fn else 128 + 4 + 128,
        index_buf_size=(PAGES - 1) * PS, skip_topk_layers=[False, False, True],
    )  # fmt: skip


def _guarded(mode: str, kernels: str, dtype: torch.dtype = torch.bfloat16):
    dsa = _dsa_pool(dtype)
    kind, buffers = guarded_kv_buffers(dsa)
    assert kind == "dsa"
    pool = SyntheticPool(page_size=PS, num_pages=PAGES, mode=mode, max_len=512, kernels=kernels,
                         sweep_tokens_per_step=64, kv_buffers=buffers)  # fmt: skip
    return dsa, pool


def test_adapter_describes_latents_and_index_pages():
    dsa = _dsa_pool()
    kind, bufs = guarded_kv_buffers(dsa)
    assert kind == "dsa" and len(bufs) == 3 + 2 * 2  # 3 latents; keys + scales of 2 indexers
    assert all(isinstance(b, torch.Tensor) and b.shape[0] == PAGES * PS for b in bufs[:3])
    for layer in range(2):
        raw = dsa.index_k_with_scale_buffer[layer]
        keys, scales = bufs[3 + 2 * layer], bufs[4 + 2 * layer]
        assert keys.words.shape == (PAGES, PS, 32) and keys.words.stride() == (2112, 32, 1)
        assert scales.words.shape == (PAGES, PS, 1) and scales.words.stride() == (2112, 1, 1)
        assert keys.data_ptr() == raw.data_ptr()
        assert scales.data_ptr() == raw.data_ptr() + KEYS
        raw[5, 7 * 128 + 3] = 0xAB  # page 5, slot 5 * 64 + 7, key byte 3 ...
        raw[5, KEYS + 7 * 4 + 2] = 0xCD  # ... and byte 2 of its scale
        assert keys.words[5, 7].view(torch.uint8)[3] == 0xAB
        assert scales.words[5, 7].view(torch.uint8)[2] == 0xCD
    # FP8 latents are packed rows of bytes, [R fp8 | R/128 fp32 scales | rope bf16]
    kind, bufs = guarded_kv_buffers(_dsa_pool(torch.float8_e4m3fn))
    assert kind == "dsa" and bufs[0].dtype == torch.uint8 and bufs[0].shape[-1] == 260


def test_index_pages_the_guard_does_not_model_are_refused():
    from kvguard.patches.adapter import UnsupportedPoolError

    dsa = _dsa_pool()
    dsa.index_kpool = 2  # two allocator pages' keys per index row: not the layout modelled
    with pytest.raises(UnsupportedPoolError, match="pooled 2 pages"):
        guarded_kv_buffers(dsa)
    dsa = _dsa_pool()
    dsa.index_key_cache.buffer[0] = dsa.index_key_cache.buffer[0][:3]  # fewer pages than slots
    with pytest.raises(UnsupportedPoolError, match="do not cover"):
        guarded_kv_buffers(dsa)


def _flip_key(dsa, page: int, offset: int) -> None:
    dsa.index_k_with_scale_buffer[1][page, offset * 128 + 77] ^= 0x10


def _flip_scale(dsa, page: int, offset: int) -> None:
    dsa.index_k_with_scale_buffer[0][page, KEYS + offset * 4 + 3] ^= 0x01


def _misplace_key(dsa, page: int, offset: int, src_slot: int) -> None:
    """The index key of another request's slot copied over this one (its scale and latent
    rows untouched): the indexer would score the other request's token here."""
    raw = dsa.index_k_with_scale_buffer[0]
    sp, so = divmod(src_slot, PS)
    raw[page, offset * 128 : (offset + 1) * 128] = raw[sp, so * 128 : (so + 1) * 128].clone()


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("mode", ["paranoid", "verified", "sampled"])
@pytest.mark.parametrize("fault", ["key", "scale", "misplaced"])
def test_index_key_faults_abort_their_reader(fault, mode, kernels):
    dsa, pool = _guarded(mode, kernels)
    a, b = _two(pool)
    assert not pool.violations  # a clean run over the real pool's buffers: no false alarm
    page, offset = a.pages[1], 5  # a full, sealed page of a's: resting, read every step
    if fault == "key":
        _flip_key(dsa, page, offset)
    elif fault == "scale":
        _flip_scale(dsa, page, offset)
    else:
        _misplace_key(dsa, page, offset, src_slot=b.pages[1] * PS + offset)
    changed = pool.step
    _decode(pool, [a, b], steps=6)
    assert pool.flagged() == {a.rid}
    first = min(v.step for v in pool.violations if v.request == a.rid)
    # paranoid and verified check every read page before the forward; sampled's rolling window
    # covers a's and b's pages (3 each) at one page per step
    assert first <= changed + (1 if mode != "sampled" else 6)
    assert int(pool.guard.ledger.state[page]) == PageState.QUARANTINED


def test_faults_outside_the_read_set_abort_no_one():
    """A flipped index key in a free page is no request's: nobody is aborted, and a fresh
    request that takes the page writes its rows before anything reads them."""
    dsa, pool = _guarded("paranoid", "cpu")
    a, b = _two(pool)
    free = pool.free_pages[0]
    _flip_key(dsa, free, 0)
    _decode(pool, [a, b], steps=2)
    c = pool.admit(list(range(100)))
    pool.forward([c], 70)  # takes the free page first: its rows are written before any read
    _decode(pool, [a, b, c], steps=2)
    assert not pool.violations and free in c.pages


def test_a_scrubbed_page_loses_its_index_keys_and_only_its_own():
    dsa, pool = _guarded("paranoid", "cpu")
    a, b = _two(pool)
    page = a.pages[1]
    _flip_key(dsa, page, 9)
    _decode(pool, [a, b], steps=1)
    assert pool.flagged() == {a.rid}
    other = [raw[b.pages[1]].clone() for raw in dsa.index_k_with_scale_buffer[:2]]
    pool.release(a)  # the last holder lets the quarantined page go: scrubbed, then free
    assert int(pool.guard.ledger.state[page]) == PageState.FREE
    for raw, kept in zip(dsa.index_k_with_scale_buffer[:2], other):
        assert not raw[page].any()  # keys and scales of every slot of the page
        assert torch.equal(raw[b.pages[1]], kept)
    _decode(pool, [b], steps=2)
    assert pool.flagged() == {a.rid}


def test_verified_reads_hash_every_dsa_buffer_as_the_seal_does():
    """A CPU DSA pool has a read path: the indexer and sparse MLA (patches/dsa_cpu.py) read the
    index keys, their scales and the latents through ``kv_read.hashed_rows``. Per row read,
    the parts folded into the forward's record over all buffers add up to the token checksum's
    inner sum the ledger seals (``inner_sums_ref``), for slot-major latents and page-major index
    keys alike, FP8 (packed rows) and BF16; a slot outside the pool reads as out of pool; the
    bytes come back as stored."""
    from types import SimpleNamespace

    from kvguard.kernels.kv_checksum_ref import inner_sums_ref
    from kvguard.kernels.read_verify_ref import OUT_OF_POOL
    from kvguard.patches import kv_read

    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        dsa = _dsa_pool(dtype)
        runner = SimpleNamespace(token_to_kv_pool=dsa)
        runner.attn_backend = type("TorchNativeAttnBackend", (), {})()
        assert kv_read.read_path_unavailable(runner) is None
        _, bufs = guarded_kv_buffers(dsa)
        g = torch.Generator().manual_seed(3)
        for raw in list(dsa.kv_buffer) + list(dsa.index_k_with_scale_buffer[:2]):
            u8 = raw.view(torch.uint8)
            u8.copy_(torch.randint(0, 256, u8.shape, dtype=torch.uint8, generator=g))
        lens = [70, 5, 130]
        table = torch.randint(0, PAGES * PS, (3, 200), dtype=torch.int32, generator=g)
        table[1, 3] = PAGES * PS + 9  # a corrupted page-table entry: outside the pool
        batch = SimpleNamespace(
            req_pool_indices=torch.tensor([2, 0, 1]), seq_lens=torch.tensor(lens)
        )
        table2 = torch.zeros(3, 200, dtype=torch.int32)
        table2[2], table2[0], table2[1] = table[0], table[1], table[2]  # rows named by the batch
        index = {b.data_ptr(): i for i, b in enumerate(bufs)}  # as Guard.buffer_index
        guard = SimpleNamespace(
            buffer_index=lambda b, index=index: index.get(b.data_ptr()),
            account_in_forward=lambda seconds: None,  # as Guard.account_in_forward
        )
        kv_read.clear_record()
        got = [kv_read.hashed_rows(guard, batch, table2, b) for b in reversed(bufs)]
        rec = kv_read.take_record()
        assert rec is not None and sorted(rec.buffers) == list(range(len(bufs)))
        rows = torch.cat([table[i, :n].to(torch.int64) for i, n in enumerate(lens)])
        assert torch.equal(rec.rows, rows)
        inside = rows < PAGES * PS
        want = inner_sums_ref(bufs, rows.clamp_max(PAGES * PS - 1))
        assert torch.equal(rec.acc[inside], want[inside])
        out_of_pool = torch.tensor(OUT_OF_POOL) * len(bufs)  # wrapping, as the sums do
        assert bool((rec.acc[~inside] == out_of_pool).all())
        keys, lat = got[1], got[-1]  # the last indexer's keys; the first layer's latents
        raw = dsa.index_k_with_scale_buffer[1]
        p, o = divmod(int(rows[0]), PS)
        assert torch.equal(keys[0], raw[p, o * 128 : (o + 1) * 128])
        assert torch.equal(lat[0].view(torch.uint8), dsa.kv_buffer[0][rows[0]].view(torch.uint8))


def test_a_read_that_was_not_hashed_fails_the_step_closed():
    """Verified mode with the read path on, but nothing hashed what the forward read (as when
    a read could not be taken): no step is vouched for, each fails closed."""
    _, pool = _guarded("verified", "cpu")
    a, b = _two(pool, decode=0)
    assert not pool.violations
    pool.guard.enable_read_path()
    errors = pool.guard.num_internal_errors
    _decode(pool, [a, b], steps=1)
    assert pool.flagged() == {a.rid, b.rid}  # the step's requests fail closed
    assert pool.guard.num_internal_errors == errors + 1

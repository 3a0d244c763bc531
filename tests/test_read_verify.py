"""Verified reads: the compiled gather-and-hash and the read check agree with their torch reference
bit for bit; attention through the fused read gives exactly SGLang's own outputs (MHA and MLA,
FP8 and BF16, several page sizes); what attention read hashes to the token digests of the pool;
and bytes changed after the pre-forward check, before attention reads them, fail the read."""

from __future__ import annotations

import pytest
import torch
from test_fp8_kv import (  # noqa: F401  (fixtures: sgl, hooked, mla_hooked)
    DIM,
    KV_HEADS,
    LORA,
    ROPE,
    _mla_run,
    _mla_setup,
    _qkv,
    _run,
    _setup,
    hooked,
    mla_hooked,
    sgl,
)

from kvguard.config import GuardConfig
from kvguard.guard import Guard
from kvguard.kernels import read_verify as compiled
from kvguard.kernels import read_verify_ref as ref
from kvguard.kernels.guard_ref import page_tag
from kvguard.kernels.kv_checksum_ref import fmix64, poskey, to_signed64, token_digests_ref
from kvguard.patches import cpu_fp8_kv, kv_read, state
from kvguard.patches.adapter import guarded_kv_buffers
from kvguard.patches.targets import READ_TARGETS


def _bits(t: torch.Tensor) -> torch.Tensor:
    return (
        t.view(torch.uint8)
        if t.element_size() == 1
        else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


@pytest.mark.parametrize("table_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_shape", [(2, 64), (1, 80), (4,)])
def test_gather_rows_compiled_matches_reference(table_dtype, row_shape):
    g = torch.Generator().manual_seed(1)
    dtype = torch.uint8 if table_dtype is not None else torch.bfloat16
    cache = torch.randint(0, 256, (300, *row_shape), dtype=torch.uint8, generator=g)
    if dtype is torch.bfloat16:
        cache = torch.randint(
            0, 256, (300, *row_shape[:-1], row_shape[-1] * 2), dtype=torch.uint8, generator=g
        )
        cache = cache.view(torch.bfloat16)
    table = None
    if table_dtype is not None:
        table = cpu_fp8_kv.dequant_tables(0.5, 1.0, table_dtype)[0]
    rows = torch.randint(-2, 303, (97,), dtype=torch.int64, generator=g)  # some outside the pool
    row_bytes = cache[0].numel() * cache.element_size()
    a_ref, a_c = torch.zeros(97, dtype=torch.int64), torch.zeros(97, dtype=torch.int64)
    out_ref = ref.gather_rows(cache, rows, table, ref.buffer_constants(5, row_bytes), a_ref)
    out_c = compiled.gather_rows(cache, rows, table, 5, a_c)
    assert torch.equal(a_ref, a_c)
    assert torch.equal(_bits(out_ref), _bits(out_c))
    outside = (rows < 0) | (rows >= 300)
    assert bool((a_c[outside] == ref.OUT_OF_POOL).all())
    plain = compiled.gather_rows(cache, rows, table)  # no hashing: the same rows
    assert torch.equal(_bits(plain), _bits(out_c))


def _sealed_pool(ps: int, lens: list[int], seed: int = 0):
    """A 4-buffer pool whose requests' pages are sealed as the guard seals them: the ledger arrays
    verify_reads reads (digest, fill, epoch) and each row's page-tag sum (agg)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 256
    slots = num_pages * ps
    bufs = [torch.randint(0, 256, (slots, 2, 16), dtype=torch.uint8, generator=g) for _ in range(4)]
    digest = torch.zeros(num_pages, dtype=torch.int64)
    fill = torch.zeros(num_pages, dtype=torch.int16)
    epoch = torch.randint(1, 1 << 40, (num_pages,), dtype=torch.int64, generator=g)
    agg = torch.zeros(8, dtype=torch.int64)
    free = torch.randperm(num_pages - 1, generator=g) + 1
    rows_all, req_rows, used = [], [], 0
    for b, L in enumerate(lens):
        n_pages = -(-L // ps)
        pages = free[used : used + n_pages]
        used += n_pages
        slots_b = (pages[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:L]
        d = token_digests_ref(bufs, slots_b, torch.arange(L))
        for j, p in enumerate(pages.tolist()):
            digest[p] = d[j * ps : (j + 1) * ps].sum()
            fill[p] = min(ps, L - j * ps)
        tags = page_tag(epoch[pages], torch.arange(n_pages)).sum()
        agg[b + 2] = tags
        rows_all.append(slots_b)
        req_rows.append(b + 2)
    rows = torch.cat(rows_all)
    return bufs, rows, torch.tensor(req_rows), dict(digest=digest, fill=fill, epoch=epoch, agg=agg)


def _read(bufs, rows):
    acc = torch.zeros(rows.numel(), dtype=torch.int64)
    for i, b in enumerate(bufs):
        compiled.gather_rows(b, rows, None, i, acc)
    return acc


def _both(acc, rows, lens, req_rows, ps, slots, led):
    args = (
        acc,
        rows,
        lens,
        req_rows,
        ps,
        slots,
        led["digest"],
        led["fill"],
        led["epoch"],
        led["agg"],
    )
    b_ref, p_ref = ref.verify_reads(*args)
    b_c, p_c = compiled.verify_reads(*args)
    assert torch.equal(b_ref, b_c) and torch.equal(p_ref, p_c)
    return b_c.tolist(), p_c.tolist()


@pytest.mark.parametrize("ps", [1, 16, 64])
def test_verify_reads_clean_then_each_fault(ps):
    lens = [37, 5, 130]
    bufs, rows, req_rows, led = _sealed_pool(ps, lens)
    slots = bufs[0].shape[0]
    assert _both(_read(bufs, rows), rows, lens, req_rows, ps, slots, led) == ([False] * 3, [])

    # one byte of request 2's KV changes after the seal (before or during the forward)
    victim = rows[37 + 5 + 70]
    bufs[3][victim, 1, 7] ^= 0x40
    bad, pages = _both(_read(bufs, rows), rows, lens, req_rows, ps, slots, led)
    assert bad == [False, False, True] and pages == [int(victim) // ps]
    bufs[3][victim, 1, 7] ^= 0x40

    # the page table names another request's slot at request 0's position 3 by read time
    moved = rows.clone()
    moved[3] = rows[37 + 2]
    bad, _ = _both(_read(bufs, moved), moved, lens, req_rows, ps, slots, led)
    assert bad[0] and not bad[2]

    # a whole page swapped for another page with its own valid digest: the row's tags differ
    if ps > 1:
        swapped = rows.clone()
        swapped[37 + 5 : 37 + 5 + ps] = rows[:ps]  # request 2's page 0 := request 0's page 0
        bad, _ = _both(_read(bufs, swapped), swapped, lens, req_rows, ps, slots, led)
        assert bad[2]

    # a page sealed less far than read (a firewalled write): the reader fails, the page is not
    # quarantined (its bytes are not what is wrong)
    page0 = int(rows[0]) // ps
    led["fill"][page0] -= 1
    bad, pages = _both(_read(bufs, rows), rows, lens, req_rows, ps, slots, led)
    assert bad[0] and pages == []
    led["fill"][page0] += 1

    # a page-table row outside the records never reads out of bounds
    wrong_row = req_rows.clone()
    wrong_row[1] = -1
    bad, _ = _both(_read(bufs, rows), rows, lens, wrong_row, ps, slots, led)
    assert bad == [False, True, False]

    # a slot outside the pool never crashes the gather and fails its reader
    wild = rows.clone()
    wild[40] = slots + 5
    bad, _ = _both(_read(bufs, wild), wild, lens, req_rows, ps, slots, led)
    assert bad[1]


def _guard_for(pool, ps: int, monkeypatch) -> Guard:
    _, buffers = guarded_kv_buffers(pool)
    guard = Guard(
        GuardConfig(mode="verified"), num_slots=buffers[0].shape[0], page_size=ps, num_rows=4,
        kv_buffers=buffers, device="cpu",
    )  # fmt: skip
    guard.enable_read_path()
    monkeypatch.setattr(state, "guard", guard)
    return guard


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("fp8", [True, False])
def test_fused_read_bit_identical_mha(sgl, hooked, monkeypatch, fp8, ps):  # noqa: F811
    """Attention through the fused (hashed) read == SGLang's own loop, and what it hashed is the
    token digest of every position read."""
    n = 21
    q, k, v = _qkv(n + 1, magnitude=2.0, seed=3)
    outs = []
    for verify in (False, True):
        _, backend, layer, slots = _setup(sgl, n, register=False)
        quant = {"quant_method": sgl.CPUFP8KVCacheMethod()} if fp8 else {}
        pool = sgl.MHATokenToKVPool(
            size=128, page_size=ps, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
            head_num=KV_HEADS, head_dim=DIM, layer_num=1, device="cpu",
            enable_memory_saver=False, **quant,
        )  # fmt: skip
        backend.token_to_kv_pool = pool
        if verify:
            guard = _guard_for(pool, ps, monkeypatch)
        else:
            monkeypatch.setattr(state, "guard", None)
        kv_read.clear_record()
        o_ext, o_dec = _run(sgl, backend, layer, slots, q, k, v, n)
        outs.append((o_ext, o_dec))
        if verify:
            rec = kv_read.take_record()
            assert rec is not None and rec.buffers == [0, 1]
            pos = torch.arange(n + 1)
            want = token_digests_ref(guard.checker.kv_buffers, rec.rows, pos)
            assert torch.equal(fmix64(rec.acc ^ poskey(pos)), want)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("fp8", [True, False])
def test_fused_read_bit_identical_mla(sgl, mla_hooked, monkeypatch, fp8, ps):  # noqa: F811
    n = 19
    g = torch.Generator().manual_seed(7)
    q = torch.randn(n + 1, 4 * (LORA + ROPE), generator=g).to(torch.bfloat16)
    latent = torch.randn(n + 1, 1, LORA + ROPE, generator=g).to(torch.bfloat16)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    outs = []
    for verify in (False, True):
        pool, backend, layer, slots = _mla_setup(sgl, n, dtype=dtype, register=fp8)
        if ps != 16:  # the same pool at another page size
            from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

            pool = MLATokenToKVPool(
                size=128, page_size=ps, dtype=dtype, kv_lora_rank=LORA, qk_rope_head_dim=ROPE,
                layer_num=1, device="cpu", enable_memory_saver=False,
            )  # fmt: skip
            if fp8:
                cpu_fp8_kv._fp8_pools.add(pool)
            backend.token_to_kv_pool = pool
        if verify:
            guard = _guard_for(pool, ps, monkeypatch)
        else:
            monkeypatch.setattr(state, "guard", None)
        kv_read.clear_record()
        outs.append(_mla_run(backend, layer, slots, q, latent, n))
        if verify:
            rec = kv_read.take_record()
            assert rec is not None and rec.buffers == [0]
            pos = torch.arange(n + 1)
            want = token_digests_ref(guard.checker.kv_buffers, rec.rows, pos)
            assert torch.equal(fmix64(rec.acc ^ poskey(pos)), want)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_bytes_changed_inside_the_forward_fail_the_read(sgl, hooked, monkeypatch):  # noqa: F811
    """The pre-forward check has passed; a late write lands in a sealed token before attention
    reads it: the read's sums no longer match the sealed digest, so the request fails."""
    n = 21
    q, k, v = _qkv(n + 1, seed=5)
    pool, backend, layer, slots = _setup(sgl, n, register=True)
    guard = _guard_for(pool, 16, monkeypatch)
    kv_read.clear_record()
    _run(sgl, backend, layer, slots, q, k, v, n)  # writes the KV (prefill, then one decode)
    kv_read.take_record()
    buffers = guard.checker.kv_buffers
    rows = slots[: n + 1].to(torch.int64)
    d = token_digests_ref(buffers, rows, torch.arange(n + 1))
    pages = rows.view(-1)[::16] // 16
    digest = torch.zeros(guard.ledger.num_pages, dtype=torch.int64)
    fill = torch.zeros(guard.ledger.num_pages, dtype=torch.int16)
    epoch = torch.arange(guard.ledger.num_pages, dtype=torch.int64) + 7
    for j, p in enumerate(pages.tolist()):
        digest[p] = d[j * 16 : (j + 1) * 16].sum()
        fill[p] = min(16, n + 1 - j * 16)
    agg = torch.zeros(4, dtype=torch.int64)
    agg[0] = to_signed64(int(page_tag(epoch[pages], torch.arange(pages.numel())).sum()))

    def judged() -> list[bool]:
        fb = __import__("types").SimpleNamespace(
            out_cache_loc=slots[n : n + 1], req_pool_indices=torch.tensor([0]),
            seq_lens=torch.tensor([n + 1]), encoder_lens=None,
        )  # fmt: skip
        kv_read.clear_record()
        backend.forward_decode(q[n : n + 1], k[n : n + 1], v[n : n + 1], layer, fb)
        rec = kv_read.take_record()
        bad, _ = compiled.verify_reads(
            rec.acc, rec.rows, rec.seq_lens, rec.req_rows, 16, buffers[0].shape[0], digest, fill,
            epoch, agg,
        )  # fmt: skip
        return bad.tolist()

    assert judged() == [False]
    pool.k_buffer[0].view(torch.uint8)[slots[4], 0, 3] ^= 0x20  # lands after the check
    assert judged() == [True]


def test_unhashable_read_is_served_and_never_vouched_for(sgl, hooked, monkeypatch):  # noqa: F811
    """Attention reads a buffer the guard does not hold: no crash, SGLang's own loop serves the
    forward, and the guard gets no read to vouch for (its step then fails closed)."""
    n = 9
    q, k, v = _qkv(n + 1, seed=2)
    pool, backend, layer, slots = _setup(sgl, n, register=True)
    guard = _guard_for(pool, 16, monkeypatch)
    monkeypatch.setattr(guard, "_buffer_index", {})  # as if the pool's buffers were replaced
    for target, hook_type, hook_path, _why in READ_TARGETS:  # wrapped twice, as by two loaders
        owner_path, attr = target.rsplit(".", 1)
        owner = sgl.pkgutil.resolve_name(owner_path)
        hook = getattr(kv_read, hook_path.split(".", 1)[1])
        wrapped = sgl._wrap_fn(getattr(owner, attr), hook, sgl.HookType[hook_type])
        monkeypatch.setattr(owner, attr, wrapped)
    kv_read.clear_record()
    out = _run(sgl, backend, layer, slots, q, k, v, n)
    assert all(bool(torch.isfinite(o.float()).all()) for o in out)
    assert kv_read.take_sums() is None
    assert guard.num_internal_errors == 2  # once per forward (prefill, decode), no more

"""patches/pd_guard.py's hooks on SGLang's decode path, driven with stand-ins for SGLang's request
objects and a synthetic pool's guard (no engine): the pre-allocation claims the transfer's slots,
the commit seals them or aborts the request, the test switch flips a landed byte; the prefill's
metadata row carries its seal, which the commit compares with what landed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from synthetic_pool import SyntheticPool

from kvguard.kernels.guard_state import PageState
from kvguard.patches import pd_guard, state
from kvguard.verdict import Kind

PS = 16


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> SyntheticPool:
    p = SyntheticPool(page_size=PS, num_pages=64, mode="verified", max_len=256)
    monkeypatch.setattr(state, "guard", p.guard)
    monkeypatch.setattr(
        state,
        "scheduler",
        SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=p.table),
            token_to_kv_pool_allocator=SimpleNamespace(page_size=PS),
            tp_rank=0,
            tp_size=1,
        ),
    )
    monkeypatch.delenv(pd_guard.FLIP_ROOM, raising=False)
    monkeypatch.delenv(pd_guard.FLIP_IN_FLIGHT_ROOM, raising=False)
    return p


def _prealloc(pool: SyntheticPool, n: int, room: int = 7) -> tuple[SimpleNamespace, torch.Tensor]:
    """What DecodePreallocQueue._pre_alloc does to the guard's view: a row (hooked rows alloc),
    slots handed out (hooked allocator), written into the row; then the AFTER hook."""
    row = pool.free_rows.pop(0)
    pool.guard.on_rows_allocated(torch.tensor([row]))
    pages = [pool._take_page() for _ in range(-(-n // PS))]
    slots = torch.tensor([pages[p // PS] * PS + p % PS for p in range(n)], dtype=torch.int64)
    pool.guard.on_alloc(slots[::PS].clone())
    pool.table[row, :n] = slots.to(torch.int32)
    req = SimpleNamespace(
        rid=f"req-{room}",
        kv=SimpleNamespace(req_pool_idx=row, kv_committed_len=n),
        origin_input_ids=[(5 * i + 1) % 300 for i in range(n)],
        output_ids=[],
        finished_reason=None,
        bootstrap_room=room,
        bootstrap_host="127.0.0.1",
    )
    assert pd_guard.after_pre_alloc(slots, None, req) is slots
    return req, slots


def _metadata(words: torch.Tensor | None = None) -> SimpleNamespace:
    """SGLang's MetadataBuffers as the hooks read them: one request's cached_tokens row."""
    row = torch.zeros(1, 16, dtype=torch.int32) if words is None else words.reshape(1, 16)
    return SimpleNamespace(cached_tokens=row)


def _commit(req: SimpleNamespace, words: torch.Tensor | None = None) -> None:
    queue = SimpleNamespace(metadata_buffers=_metadata(words))
    decode_req = SimpleNamespace(req=req, metadata_buffer_index=0)
    pd_guard.around_commit_transfer(lambda queue, decode_req: None, queue, decode_req)


def _sent_words(pool: SyntheticPool, req: SimpleNamespace, n: int) -> torch.Tensor:
    """The prefill side: the request's KV written and sealed by a forward on a pool of the same
    layout, then its metadata row filled (the AFTER hook on set_buf): the row that travels."""
    sender = SyntheticPool(page_size=PS, num_pages=64, mode="verified", max_len=256)
    sreq = sender.admit(list(req.origin_input_ids) + [1] * 8)
    sender.forward([sreq], n)
    buffers = _metadata()
    prefill_req = SimpleNamespace(
        metadata_buffer_index=0,
        origin_input_ids=req.origin_input_ids,
        extend_end=n,
        disagg_decode_prefix_len=0,
        kv=SimpleNamespace(req_pool_idx=sreq.row),
    )
    guard, table = state.guard, state.scheduler.req_to_token_pool.req_to_token
    state.guard, state.scheduler.req_to_token_pool.req_to_token = sender.guard, sender.table
    try:
        pd_guard.after_set_buf(None, buffers, prefill_req)
    finally:
        state.guard, state.scheduler.req_to_token_pool.req_to_token = guard, table
    return buffers.cached_tokens[0].clone()


def test_pre_alloc_claims_and_commit_seals(pool: SyntheticPool) -> None:
    m = pool.guard.metrics
    checked, seconds = m.transfers_checked._value.get(), m.transfer_check_seconds._value.get()
    req, slots = _prealloc(pool, 37)
    pages = torch.unique(slots // PS)
    L = pool.guard.ledger
    assert bool((L.state[pages] == PageState.OWNED).all())
    assert int(L.pages.fill[pages].sum()) == 0  # claimed, nothing sealed
    pool.write_kv(slots, torch.tensor(req.origin_input_ids), torch.arange(37))
    _commit(req)
    assert int(L.pages.fill[pages].sum()) == 37
    assert pool.guard.actions.num_violations == 0 and req.finished_reason is None
    pool.guard.flush_metrics()  # the claim and the landing, timed apart from the forwards'
    assert m.transfers_checked._value.get() - checked == 2
    assert m.transfer_check_seconds._value.get() > seconds


def test_commit_into_a_changed_claim_aborts_the_request(pool: SyntheticPool) -> None:
    req, slots = _prealloc(pool, 20)
    with pool.guard.releasing(req.kv.req_pool_idx):  # released while its transfer is in flight
        pool.guard.on_release(torch.unique(slots // PS))
    pool.guard.on_alloc(slots[::PS].clone())  # handed out again
    _commit(req)
    (v,) = pool.guard.actions.history
    assert v.kinds == Kind.STALE_TRANSFER and v.request == req.rid


def test_test_switch_flips_a_landed_byte_of_that_room_only(
    pool: SyntheticPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(pd_guard.FLIP_ROOM, "9")
    kept, ks = _prealloc(pool, 20, room=8)
    hit, hs = _prealloc(pool, 20, room=9)
    for req, slots in ((kept, ks), (hit, hs)):
        pool.write_kv(slots, torch.tensor(req.origin_input_ids), torch.arange(20))
    before = [b.clone() for b in pool.bufs]
    _commit(kept)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.bufs))
    _commit(hit)
    changed = (before[0] != pool.bufs[0]).reshape(pool.bufs[0].shape[0], -1).any(1)
    assert torch.nonzero(changed).reshape(-1).tolist() == [int(hs[10])]


def test_the_prefill_s_seal_rides_in_the_metadata_row_and_is_compared_on_landing(
    pool: SyntheticPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept, ks = _prealloc(pool, 37, room=8)
    hit, hs = _prealloc(pool, 37, room=9)
    words = _sent_words(pool, kept, 37)
    assert int(words[7]) == pd_guard.SEAL_MAGIC and int(words[11]) == 37
    assert not words[:7].any()  # SGLang's own words untouched
    monkeypatch.setenv(pd_guard.FLIP_IN_FLIGHT_ROOM, "9")
    for req, slots in ((kept, ks), (hit, hs)):
        pool.write_kv(slots, torch.tensor(req.origin_input_ids), torch.arange(37))
    _commit(kept, words)
    assert pool.guard.actions.num_violations == 0
    _commit(hit, words)  # the same prompt's seal: its bytes changed in flight
    (v,) = pool.guard.actions.history
    assert v.kinds == Kind.TRANSFER_MISMATCH and v.request == hit.rid


def test_a_row_without_a_seal_or_of_another_layout_lands_unsealed(pool: SyntheticPool) -> None:
    a, sa = _prealloc(pool, 20, room=8)
    b, sb = _prealloc(pool, 20, room=9)
    words = _sent_words(pool, b, 20)
    words[8] ^= 1  # another layout's signature
    for req, slots in ((a, sa), (b, sb)):
        pool.write_kv(slots, torch.tensor(req.origin_input_ids), torch.arange(20))
    _commit(a)  # no marker: a prefill without kvguard
    _commit(b, words)
    assert pool.guard.actions.num_violations == 0


def test_a_truncated_or_unvouched_seal_aborts(pool: SyntheticPool) -> None:
    a, sa = _prealloc(pool, 20, room=8)
    b, sb = _prealloc(pool, 20, room=9)
    short = _sent_words(pool, a, 20)
    short[11] = 19
    unvouched = _sent_words(pool, b, 20)
    unvouched[7] = pd_guard.SEAL_UNVOUCHED
    for req, slots in ((a, sa), (b, sb)):
        pool.write_kv(slots, torch.tensor(req.origin_input_ids), torch.arange(20))
    _commit(a, short)
    _commit(b, unvouched)
    assert [v.kinds for v in pool.guard.actions.history] == [Kind.TRANSFER_MISMATCH] * 2


def test_a_warm_up_s_fake_transfer_reads_no_metadata(
    pool: SyntheticPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang's warm-up request lands nothing and sends no metadata row: not 'unsealed'."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    monkeypatch.setattr(pd_guard, "_said", set())
    req, _ = _prealloc(pool, 8)
    req.bootstrap_host = FAKE_BOOTSTRAP_HOST
    _commit(req, torch.full((16,), 5, dtype=torch.int32))
    assert pd_guard._said == set() and pool.guard.actions.num_violations == 0


def test_a_prefill_with_its_guard_switched_off_sends_no_stale_seal(
    pool: SyntheticPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang reuses metadata rows and never clears words 7-11: a seal left by an earlier request
    must not travel with a request sent while the guard was off (``KVGUARD_MODE_FILE``)."""
    req, _ = _prealloc(pool, 20)
    words = _sent_words(pool, req, 20)
    assert int(words[7]) == pd_guard.SEAL_MAGIC
    buffers = _metadata(words.clone())
    monkeypatch.setattr(state, "on", lambda: False)
    pd_guard.after_set_buf(None, buffers, SimpleNamespace(metadata_buffer_index=0))
    assert not buffers.cached_tokens[0, pd_guard.SEAL_WORDS].any()
    assert torch.equal(buffers.cached_tokens[0, :7], words[:7])


def _backed_up(pool: SyntheticPool, n: int) -> tuple[int | None, int]:
    """A decode request that wrote and sealed ``n`` positions (forwards), then was retracted: the
    backup hook's seal, taken before its pages are released. Its tokens are ``_prealloc``'s."""
    tokens = [(5 * i + 1) % 300 for i in range(n)]
    running = pool.admit(tokens + [1] * 8)
    pool.forward([running], n)
    req = SimpleNamespace(seqlen=n + 1, kv=SimpleNamespace(req_pool_idx=running.row))
    pd_guard.after_offload_kv_cache(None, req, SimpleNamespace(req_to_token=pool.table))
    pool.release(running)
    seal: tuple[int | None, int] = req.kvguard_backup_seal
    return seal


def _restore(pool: SyntheticPool, req: SimpleNamespace, slots: torch.Tensor, flip: bool) -> None:
    """SGLang's restore_kv_cache (cpu_tensor: load_kv_cache) through the AROUND hook: the backed
    up bytes written into the slots _pre_alloc claimed; ``flip``: one byte of them changed."""

    def load(req, *args):
        n = slots.numel()
        pool.write_kv(slots, torch.tensor(req.origin_input_ids[:n]), torch.arange(n))
        if flip:
            pool.bufs[0].view(-1)[int(slots[n // 2]) * pool.bufs[0][0].numel()] ^= 1

    pd_guard.around_restore_kv_cache(load, req, None, None, None, "cpu_tensor")


@pytest.mark.parametrize("flip", [False, True])
def test_a_retracted_request_s_restore_is_a_landing_checked_against_its_backup(
    pool: SyntheticPool, flip: bool
) -> None:
    seal = _backed_up(pool, 37)
    assert seal[0] is not None and seal[1] == 37
    req, slots = _prealloc(pool, 37)  # resumed: re-allocated and claimed
    req.kvguard_backup_seal = seal
    _restore(pool, req, slots, flip)
    if not flip:
        assert pool.guard.actions.num_violations == 0
        pages = torch.unique(slots // PS)
        assert int(pool.guard.ledger.pages.fill[pages].sum()) == 37  # sealed: read like its own
    else:
        (v,) = pool.guard.actions.history
        assert v.kinds == Kind.TRANSFER_MISMATCH and v.request == req.rid
    assert req.kvguard_backup_seal is None


def test_a_restore_without_a_backup_seal_is_not_served(pool: SyntheticPool) -> None:
    """Another backend's restore, or a backup taken while the guard was off: nothing vouches."""
    req, slots = _prealloc(pool, 20)
    _restore(pool, req, slots, flip=False)
    (v,) = pool.guard.actions.history
    assert v.kinds == Kind.TRANSFER_MISMATCH

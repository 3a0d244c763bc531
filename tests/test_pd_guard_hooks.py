"""patches/pd_guard.py's hooks on SGLang's decode path, driven with stand-ins for SGLang's request
objects and a synthetic pool's guard (no engine): the pre-allocation claims the transfer's slots,
the commit seals them or aborts the request, the test switch flips a landed byte."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvguard.bench.synthetic_pool import SyntheticPool
from kvguard.kernels.guard_state import PageState
from kvguard.patches import pd_guard, state
from kvguard.verdict import Kind

PS = 16


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> SyntheticPool:
    p = SyntheticPool(page_size=PS, num_pages=64, mode="verified", max_len=256)
    monkeypatch.setattr(state, "guard", p.guard)
    monkeypatch.setattr(
        state, "scheduler", SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=p.table))
    )
    monkeypatch.delenv(pd_guard.FLIP_ROOM, raising=False)
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


def _commit(req: SimpleNamespace) -> None:
    pd_guard.around_commit_transfer(lambda queue, decode_req: None, None, SimpleNamespace(req=req))


def test_pre_alloc_claims_and_commit_seals(pool: SyntheticPool) -> None:
    req, slots = _prealloc(pool, 37)
    pages = torch.unique(slots // PS)
    L = pool.guard.ledger
    assert bool((L.state[pages] == PageState.OWNED).all())
    assert int(L.pages.fill[pages].sum()) == 0  # claimed, nothing sealed
    pool.write_kv(slots, torch.tensor(req.origin_input_ids), torch.arange(37))
    _commit(req)
    assert int(L.pages.fill[pages].sum()) == 37
    assert pool.guard.actions.num_violations == 0 and req.finished_reason is None


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

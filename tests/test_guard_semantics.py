"""What the guard decides, on the synthetic pool: for every engine bug of ``guard_scenarios``,
in every mode that promises to see it and at page sizes 1, 16 and 64, exactly its victims are
aborted (no collateral: the new owner of a re-handed page, the other sharers of a page a bad write
aimed at, a reader of a freed page whose bytes are intact all go on), as soon as the mode
promises, and the ledger's own invariants hold."""

from __future__ import annotations

import pytest
import torch
from guard_scenarios import BYTES_CHANGED, SCENARIOS, BytesChanged
from synthetic_pool import SyntheticPool

from kvguard.ledger import IntegrityError, PageState
from kvguard.verdict import Kind

# verified: the synthetic pool has no attention read to hash, so the mode runs its fallback (every
# read checked before the forward); its read path is tested in tests/test_read_verify.py
MODES = ("tags", "sampled", "verified", "paranoid")
PAGE_SIZES = (1, 16, 64)


def _pool(mode: str, ps: int, **kw) -> SyntheticPool:
    return SyntheticPool(page_size=ps, num_pages=4096 // ps + 16, mode=mode, max_len=512,
                         sweep_tokens_per_step=64, **kw)  # fmt: skip


# Scenarios whose corruption leaves every tag intact: only checksums can see it
# (docs/bug-classes.md, "Two kinds of evidence").
_CHECKSUM_ONLY = (
    "bit_flip_private", "bit_flip_shared", "read_before_ready",
    # a store gone astray: caught against the writer's digests (the pool's bytes never were)
    "store_never_lands", "store_lands_elsewhere", "store_lands_on_own_token",
)  # fmt: skip
# (scenario, mode) cases that are not in the matrix, and why: what that mode does not promise.
NOT_PROMISED = {
    (s, "tags"): "tags keeps no checksums: bytes changed behind intact tags are served unseen"
    for s in _CHECKSUM_ONLY
}


def _forwards_to_abort(scenario: str, mode: str, pool: SyntheticPool, change: BytesChanged) -> int:
    """The forwards after a bytes change within which its mode promises to abort the victims."""
    if mode in ("paranoid", "verified") or scenario == "read_before_ready":
        return 1  # every read is checksummed before the forward; adopted pages before their use
    # sampled: the rolling window re-hashes sweep_tokens_per_step tokens of the batch's read set
    # per step, so it covers the readers' pages within this many steps
    ps = pool.ps
    window = -(-pool.guard.config.sweep_tokens_per_step // ps)
    read_pages = sum(-(-n // ps) for n in change.read_lens)
    return -(-read_pages // window)


@pytest.mark.parametrize(
    ("scenario", "mode", "ps"),
    [
        pytest.param(
            scenario, mode, ps,
            marks=[pytest.mark.skip(reason=NOT_PROMISED[scenario, mode])]
            if (scenario, mode) in NOT_PROMISED else [],
        )
        for scenario in sorted(SCENARIOS) for mode in MODES for ps in PAGE_SIZES
    ],
)  # fmt: skip
def test_only_victims_are_aborted(scenario, mode, ps):
    pool = _pool(mode, ps)
    victims = SCENARIOS[scenario](pool)
    # no vacuous pass: a case asserts what its mode promises, or NOT_PROMISED leaves it out
    assert victims is not None, f"{scenario} names no victims in {mode}: see NOT_PROMISED"
    flagged = pool.flagged()
    assert flagged == victims, f"{scenario}: aborted {flagged}, victims {victims}"
    change = BYTES_CHANGED.get(pool)
    assert (change is not None) == (scenario in _CHECKSUM_ONLY), f"{scenario}: _CHECKSUM_ONLY"
    if change is None:
        return
    limit = change.step + _forwards_to_abort(scenario, mode, pool, change)
    for rid in victims:
        first = min(v.step for v in pool.violations if v.request == rid)
        assert change.step < first <= limit, (
            f"{scenario} {mode}: {rid} aborted at step {first}, bytes changed after step "
            f"{change.step}, promised by step {limit}"
        )


def test_firewalled_write_never_lands_and_sharers_go_on():
    pool = _pool("tags", 16)
    SCENARIOS["shared_write"](pool)  # asserts the bytes inside
    kinds = [v.kinds for v in pool.violations if v.request]
    assert kinds and all(k & Kind.WRITE_TO_SHARED for k in kinds)


def test_premature_free_is_taken_back_and_reported():
    pool = _pool("sampled", 1)
    SCENARIOS["premature_free_not_reused"](pool)
    events = [v for v in pool.guard.actions.history if v.request is None]
    assert any(v.kinds & Kind.PREMATURE_FREE for v in events)
    assert pool.guard.quarantine.num_reclaimed_total >= 1


def test_stale_holder_free_is_reported():
    pool = _pool("tags", 16)
    SCENARIOS["premature_free_reused"](pool)
    assert any(v.kinds & Kind.STALE_FREE for v in pool.guard.actions.history if v.request is None)


def test_double_free_is_not_pushed_twice():
    pool = _pool("tags", 16)
    SCENARIOS["clean"](pool)
    page = pool.free_pages[-1]
    assert pool.evict([page]) == []  # already free: dropped, reported at the next resolve
    assert pool.free_pages.count(page) == 1
    a = pool.admit(list(range(40)))
    pool.forward([a], 40)
    assert any(v.kinds & Kind.DOUBLE_FREE for v in pool.guard.actions.history)


def test_quarantine_escalates_and_intact_readers_go_on():
    """After a bit flip is found (sampled), the page is quarantined; until the pool is flushed
    every read is verified, and readers whose bytes are intact are not aborted."""
    pool = _pool("sampled", 16)
    SCENARIOS["bit_flip_shared"](pool)
    g = pool.guard
    assert g.quarantine.num_quarantined_total >= 1 and g.flush_wanted
    assert g.checker.escalated
    assert (g.ledger.state == PageState.QUARANTINED).any()
    g.reset()
    assert not (g.ledger.state == PageState.QUARANTINED).any() and g.ledger.num_quarantined == 0


def test_check_integrity_against_the_engine_view():
    pool = _pool("tags", 16)
    SCENARIOS["clean"](pool)
    # release everything: the ledger must then agree with the free list and the "tree"
    L = pool.guard.ledger
    held = torch.nonzero((L.state == PageState.OWNED) | (L.state == PageState.ALLOCATED)).reshape(
        -1
    )
    pool.evict([p for p in held.tolist() if p])
    shared = torch.nonzero(L.state == PageState.SHARED).reshape(-1)
    L.check_integrity(torch.tensor(pool.free_pages), shared)
    with pytest.raises(IntegrityError, match="both free and cached"):
        L.check_integrity(torch.tensor(pool.free_pages + shared[:1].tolist()), shared)


def test_state_grows_with_pages_not_with_rows_times_context():
    small = _pool("sampled", 16, num_rows=8)
    wide = SyntheticPool(
        page_size=16, num_pages=4096 // 16 + 16, mode="sampled", num_rows=8, max_len=65536
    )
    assert small.guard.state_bytes == wide.guard.state_bytes  # context length does not count
    g = small.guard
    assert g.ledger.nbytes() == g.ledger.num_pages * 72 and g.records.nbytes() == 8 * 28
    # the command that prints the guard's bytes at a geometry counts the same arrays
    from kvguard.bench.state_bytes import guard_bytes

    est = guard_bytes(small.num_slots, 16, 8)
    assert est["ledger"] == g.ledger.nbytes() and est["records"] == g.records.nbytes()
    assert est["workspace"] <= g.kernels.workspace_bytes() <= est["workspace"] + (1 << 17)


@pytest.mark.parametrize("mode", ["tags", "sampled"])
def test_a_hand_out_is_what_the_allocator_returned(mode):
    """Hand-outs are applied lazily (at the next read of the ledger's pages), but as the
    allocator returned them: the engine's tensor is the step's out_cache_loc, and rewriting it
    before the forward (a bug; the fuzz injector's shared_write) must not hand out the new slot."""
    pool = _pool(mode, 16)
    st = pool.guard.ledger.state
    free = torch.nonzero(st == PageState.FREE).reshape(-1)
    a, b = int(free[1]), int(free[2])
    slots = torch.tensor([a * 16], dtype=torch.int64)
    pool.guard.on_alloc(slots)
    slots[0] = b * 16  # rewritten in place after the allocator returned it
    st = pool.guard.ledger.state
    assert st[a] == PageState.ALLOCATED and st[b] == PageState.FREE

"""Quarantine with a lifecycle, a guard that fails closed, storms that cost what they flag: the
guard's own behaviour on a synthetic pool (no engine; the engine tier repeats it live)."""

from __future__ import annotations

import pytest
import torch
from guard_scenarios import SCENARIOS
from synthetic_pool import SyntheticPool

from kvguard.agreement import intersection, union
from kvguard.health import FAILURES_TO_FAIL_CLOSED
from kvguard.ledger import PageLedger, PageState
from kvguard.quarantine import ESCALATION_STEPS
from kvguard.verdict import Kind


def _pool(mode: str = "sampled", ps: int = 16) -> SyntheticPool:
    return SyntheticPool(page_size=ps, num_pages=4096 // ps + 16, mode=mode, max_len=512,
                         sweep_tokens_per_step=64)  # fmt: skip


def _quarantined(pool: SyntheticPool) -> list[int]:
    return torch.nonzero(pool.guard.ledger.state == PageState.QUARANTINED).reshape(-1).tolist()


def _page_bytes(pool: SyntheticPool, page: int) -> list[torch.Tensor]:
    ps = pool.ps
    return [b[page * ps : (page + 1) * ps] for b in pool.bufs]


def test_a_quarantined_page_returns_to_service_only_scrubbed():
    pool = _pool()
    SCENARIOS["bit_flip_shared"](pool)
    g = pool.guard
    bad = _quarantined(pool)
    assert bad and g.ledger.num_quarantined == len(bad) and g.flush_wanted
    assert any(bool(t.any()) for p in bad for t in _page_bytes(pool, p))
    back = pool.evict(bad)  # the prefix cache lets go of them (its eviction)
    assert sorted(back) == sorted(bad)  # they re-enter the free list ...
    for p in bad:  # ... with no byte of their bad content and a reset entry
        assert all(not bool(t.any()) for t in _page_bytes(pool, p))
        assert int(g.ledger.state[p]) == PageState.FREE
        assert int(g.ledger.pages.prior[p]) == PageState.QUARANTINED
        assert int(g.ledger.pages.fill[p]) == 0
    assert g.ledger.num_quarantined == 0


def test_a_flush_scrubs_quarantined_pages_before_handing_them_out():
    pool = _pool()
    SCENARIOS["bit_flip_shared"](pool)
    bad = _quarantined(pool)
    assert bad
    pool.guard.reset()
    for p in bad:
        assert all(not bool(t.any()) for t in _page_bytes(pool, p))
    assert pool.guard.ledger.num_quarantined == 0


def test_a_stale_reader_of_a_scrubbed_page_is_refused():
    """After the scrub the page is FREE with QUARANTINED as its prior: a reader still holding it
    is a wrong owner, never a premature free to take back."""
    pool = _pool("tags")
    a, b = SCENARIOS["clean"].__globals__["_two"](pool)
    page = a.pages[0]
    L = pool.guard.ledger
    L.quarantine(torch.tensor([page]), L.epoch[[page]], pool.step)
    pool.guard.on_release(torch.tensor([page]))
    pool.forward([a, b], 1)
    assert a.aborted and not b.aborted
    assert any(v.kinds & Kind.WRONG_OWNER for v in pool.violations if v.request == a.rid)


def test_the_quarantine_cap_fails_closed_and_recovers():
    pool = _pool()
    g = pool.guard
    g.health.quarantine_cap_pages = 1
    changes: list[str | None] = []
    g.health.listeners.append(changes.append)
    SCENARIOS["bit_flip_shared"](pool)
    assert not g.health.healthy and "quarantined" in (g.health.reason or "")
    assert g.metrics.healthy._value.get() == 0  # type: ignore[attr-defined]
    assert g.metrics.quarantined_pages._value.get() == g.ledger.num_quarantined  # type: ignore[attr-defined]
    pool.evict(_quarantined(pool))
    assert g.health.healthy and changes[-1] is None and len(changes) == 2


def test_escalation_is_bounded_in_time():
    pool = _pool()
    _, b = SCENARIOS["clean"].__globals__["_two"](pool)
    SCENARIOS["bit_flip_shared"](pool)
    g = pool.guard
    assert g.checker.escalated and g.ledger.num_quarantined
    g.quarantine.last_step = pool.step - ESCALATION_STEPS - 1
    pool.forward([b], 1)
    assert not g.checker.escalated and g.ledger.num_quarantined


def test_repeated_internal_failures_latch_unhealthy():
    pool = _pool()
    g = pool.guard
    for _ in range(FAILURES_TO_FAIL_CLOSED - 1):
        g.internal_error("check", RuntimeError("boom"))
    assert g.health.healthy
    g.internal_error("check", RuntimeError("boom"))
    assert not g.health.healthy and "restart" in (g.health.reason or "")
    g.health.step_succeeded()
    assert not g.health.healthy  # latched
    assert g.num_internal_errors == FAILURES_TO_FAIL_CLOSED


def test_an_unchecked_step_fails_every_request_closed():
    pool = _pool()
    a, b = SCENARIOS["clean"].__globals__["_two"](pool)
    out = pool.guard.resolve(None, [a, b])
    assert [v.request for v in out] == [a.rid, b.rid]
    assert all(v.kinds == Kind.GUARD_ERROR for v in out) and a.aborted and b.aborted


def _break_acting(monkeypatch, g, where: str) -> None:
    """Make acting on a flagged step fail: deciding heal or abort (``plan``) or carrying it out
    (``apply``)."""

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    if where == "plan":
        monkeypatch.setattr(g, "plan_actions", broken)
    else:
        monkeypatch.setattr(g.actions, "apply", broken)


@pytest.mark.parametrize("where", ["plan", "apply"])
def test_a_failure_while_acting_fails_the_batch_closed(monkeypatch, where):
    pool = _pool()
    g = pool.guard
    _break_acting(monkeypatch, g, where)
    SCENARIOS["bit_flip_private"](pool)
    assert g.num_internal_errors >= 1
    assert any(v.kinds == Kind.GUARD_ERROR for v in pool.violations)


@pytest.mark.parametrize("where", ["plan", "apply"])
def test_a_failure_while_acting_still_quarantines_the_bad_page(monkeypatch, where):
    """The batch fails closed, and the flipped shared page is quarantined all the same: a request
    arriving before the idle flush must not adopt it from the prefix cache."""
    pool = _pool()
    g = pool.guard
    _break_acting(monkeypatch, g, where)
    SCENARIOS["bit_flip_shared"](pool)
    assert any(v.kinds == Kind.GUARD_ERROR for v in pool.violations)
    assert _quarantined(pool) and g.flush_wanted and g.tree_suspect


def test_a_storm_logs_a_few_lines_and_counts_the_rest():
    """A fault every step: the log writes a burst per event and window, the rest is counted."""
    pool = _pool()
    g = pool.guard
    g.log.burst = 3
    for _ in range(6):
        a, b = SCENARIOS["clean"].__globals__["_two"](pool, decode=1)
        pool.bufs[0][a.pages[0] * pool.ps] ^= 0x40
        pool.guard.set_mode("paranoid")
        pool.forward([a, b], 1)
    assert len(g.actions.history) >= 6
    assert g.metrics.log_suppressed._value.get() >= 3  # type: ignore[attr-defined]


def test_agreed_pages_union_and_intersection():
    p = torch.tensor
    mine = (p([5, 9]), p([50, 90]))
    theirs = (p([9, 2]), p([90, 20]))
    pages, epochs = union([mine, theirs])
    assert pages.tolist() == [2, 5, 9] and epochs.tolist() == [20, 50, 90]
    pages, epochs = intersection([mine, theirs])
    assert pages.tolist() == [9] and epochs.tolist() == [90]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.uint8])
def test_scrub_zeroes_every_kv_dtype(dtype):
    """FP8 KV (kvguard-serve's default) has no fill kernels: the scrub writes bytes."""
    from kvguard.kernels.backend import select

    ps, pages = 4, 8
    bufs = [torch.ones(pages * ps, 2, 8).to(dtype) for _ in range(2)]
    L = PageLedger(pages * ps, ps, "cpu", select(torch.device("cpu")))
    L.pages.state[3] = PageState.QUARANTINED
    L.num_quarantined = 1
    assert L.scrub(torch.tensor([3, 5]), bufs, 7).tolist() == [3]  # 5 was not quarantined
    for b in bufs:
        assert not b[12:16].to(torch.float32).any() and b[:12].to(torch.float32).all()
    assert L.num_quarantined == 0 and int(L.state[3]) == PageState.FREE

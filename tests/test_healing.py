"""Heal or abort: the decision (``kvguard.healing``) and the action layer that applies it, with a
recording engine control (the live-engine side is ``test_heal_engine``)."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch
from prometheus_client import CollectorRegistry

from kvguard.actions import Actions
from kvguard.config import GuardConfig, ReadPath
from kvguard.healing import WINDOW_S, WRITE_KINDS, HealPolicy
from kvguard.kernels.backend import select
from kvguard.ledger import PageLedger
from kvguard.metrics import GuardMetrics
from kvguard.verdict import Kind, Violation


@pytest.fixture(autouse=True)
def _quiet_log():
    """The guard logs every violation; here to nowhere. (An engine test earlier in the session
    may have pointed structlog at a stream its capture has closed since.)"""
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        cache_logger_on_first_use=False,
    )
    yield
    structlog.configure(**saved)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Control:
    """Records what the action layer asked of the engine."""

    def __init__(self, can_recompute=True):
        self.can_recompute = can_recompute
        self.count: dict[str, int] = {}
        self.pending: set[str] = set()
        self.aborted: list[str] = []
        self.sent: dict[str, int] = {}  # output tokens already sent, per request

    def abort(self, handle, violation):
        self.aborted.append(handle)
        return True

    def recomputes(self, handle):
        return self.count.get(handle, 0)

    def emitted(self, handle):
        return self.sent.get(handle, 0)

    def recomputing(self, handle):
        return handle in self.pending

    def recompute(self, handle, violation):
        if not self.can_recompute:
            return False
        self.count[handle] = self.count.get(handle, 0) + 1
        self.pending.add(handle)
        return True

    def withhold_pages(self, pages):
        return 0


def _actions(control, clock=None, hashed=True, **config):
    """``hashed``: the attention read is hashed (the read path in force is then the mode's
    verified_in_attention); False: the fallback, a pre-forward check."""
    metrics = GuardMetrics(CollectorRegistry())
    cfg = GuardConfig(**config)
    policy = HealPolicy(cfg, metrics, clock or Clock(), read_path=lambda: cfg.read_path(hashed))
    ledger = PageLedger(64, 1, torch.device("cpu"), select(torch.device("cpu"), "torch"))
    return Actions(ledger, metrics, control, healing=policy), metrics


def _violation(rid, kinds=Kind.READ_MISMATCH):
    return Violation(f"v-{rid}", kinds, 7, rid, 1)


def _value(counter):
    return counter._value.get()


def test_verified_reads_heal_and_the_record_says_so():
    control = Control()
    actions, metrics = _actions(control)
    v = _violation("a")
    actions.act([v], ["a"])
    assert control.pending == {"a"} and not control.aborted
    assert (v.action, v.recomputes) == ("recompute", 1)
    assert v.as_event()["action"] == "recompute"
    assert _value(metrics.requests_recomputed) == 1 and _value(metrics.requests_aborted) == 0
    assert actions.history == [v]


def test_a_request_already_sent_back_is_not_counted_again():
    control = Control()
    actions, metrics = _actions(control)
    actions.act([_violation("a")], ["a"])
    actions.act([_violation("a")], ["a"])  # the step in flight read its old KV too
    assert control.count == {"a": 1} and _value(metrics.requests_recomputed) == 1
    # logged again (every violation is), as the same recompute
    assert [(v.action, v.recomputes) for v in actions.history] == [("recompute", 1)] * 2


@pytest.mark.parametrize(
    ("config", "kinds", "why"),
    [
        ({"on_violation": "abort"}, Kind.READ_MISMATCH, None),
        ({"mode": "tags"}, Kind.WRONG_OWNER, "mode tags"),
        ({"mode": "sampled"}, Kind.CHECKSUM_MISMATCH, "mode sampled"),
        ({}, Kind.GUARD_ERROR, "could not judge"),
        ({"recompute_budget": 0}, Kind.READ_MISMATCH, "budget"),
    ],
)
def test_aborted_where_healing_cannot_apply(config, kinds, why):
    control = Control()
    actions, metrics = _actions(control, **config)
    v = _violation("a", kinds)
    actions.act([v], ["a"])
    assert control.aborted == ["a"] and not control.pending
    assert v.action == "abort" and v.recomputes == 0
    assert (v.why_not_healed is None) if why is None else (why in v.why_not_healed)
    assert _value(metrics.requests_aborted) == 1 and _value(metrics.requests_recomputed) == 0


def test_the_budget_is_per_request():
    control = Control()
    actions, _ = _actions(control, recompute_budget=2)
    for _ in range(3):
        control.pending.clear()  # re-queued: its next fault is news
        actions.act([_violation("a")], ["a"])
    assert control.count == {"a": 2} and control.aborted == ["a"]
    assert "budget" in actions.history[-1].why_not_healed
    control.pending.clear()
    actions.act([_violation("b")], ["b"])  # another request still heals
    assert control.count["b"] == 1


def test_an_engine_that_cannot_requeue_aborts():
    control = Control(can_recompute=False)
    actions, _ = _actions(control)
    v = _violation("a")
    actions.act([v], ["a"])
    assert control.aborted == ["a"] and v.action == "abort" and v.recomputes == 0
    assert "requeue" in v.why_not_healed


@pytest.mark.parametrize("mode", ["verified", "paranoid"])
@pytest.mark.parametrize("kinds", [Kind.READ_MISMATCH, Kind.CHECKSUM_MISMATCH, Kind.WRONG_OWNER])
def test_tokens_kept_only_where_reads_were_verified_in_attention(mode, kinds):
    """The read path in force decides, not the mode. Hashed in attention: a request that already
    sent tokens is healed (they came from verified reads). A pre-forward check: the bytes behind
    its last token may have changed after that check, so it is aborted, and the record says why;
    one that sent nothing yet (a prefill) is still healed."""
    verified = Control()
    actions, _ = _actions(verified, mode=mode, hashed=True)
    verified.sent["a"] = 5
    v = _violation("a", kinds)
    actions.act([v], ["a"])
    assert verified.pending == {"a"} and not verified.aborted
    assert (v.action, v.why_not_healed) == ("recompute", None)

    fallback = Control()
    actions, metrics = _actions(fallback, mode=mode, hashed=False)
    fallback.sent["a"] = 5
    v, fresh = _violation("a", kinds), _violation("b", kinds)
    actions.act([v, fresh], ["a", "b"])
    assert fallback.aborted == ["a"] and fallback.pending == {"b"}
    assert v.action == "abort" and v.recomputes == 0
    assert "pre_forward_check" in v.why_not_healed and "5 token(s)" in v.why_not_healed
    assert v.as_event()["why_not_healed"] == v.why_not_healed
    assert fresh.action == "recompute"
    assert _value(metrics.requests_aborted) == 1 and _value(metrics.requests_recomputed) == 1


@pytest.mark.parametrize("kinds", [Kind.TABLE_MISMATCH, Kind.OVERWRITE, Kind.DOUBLE_ALLOCATION])
def test_a_write_refused_before_it_lands_is_healed_on_either_path(kinds):
    """A violation found on the step's own writes alone (firewalled before the forward) says
    nothing of what the request read: healed on the pre-forward path too. With a read kind
    beside it, it is a read violation."""
    assert kinds & WRITE_KINDS
    for hashed in (True, False):
        control = Control()
        actions, _ = _actions(control, hashed=hashed)
        control.sent.update(a=3, b=3)
        actions.act([_violation("a", kinds)], ["a"])
        assert control.pending == {"a"} and not control.aborted
        actions.act([_violation("b", kinds | Kind.WRONG_OWNER)], ["b"])
        assert ("b" in control.aborted) is not hashed


def test_without_a_read_path_the_policy_assumes_the_weaker():
    """A policy not told the read path in force takes the mode's fallback (pre-forward check),
    never the stronger one; tags and sampled verify no read at all."""
    metrics = GuardMetrics(CollectorRegistry())
    policy = HealPolicy(GuardConfig(), metrics)
    assert policy.read_path() is ReadPath.PRE_FORWARD_CHECK
    assert "pre_forward_check" in policy.why_not(Kind.READ_MISMATCH, 0, False, 1)
    assert policy.why_not(Kind.READ_MISMATCH, 0, False, 0) is None
    for mode in ("tags", "sampled"):
        policy = HealPolicy(GuardConfig(mode=mode), metrics)
        assert policy.read_path() is ReadPath.NONE
        assert f"mode {mode}" in policy.why_not(Kind.READ_MISMATCH, 0, False, 0)


@pytest.mark.parametrize("mode", ["verified", "paranoid", "sampled", "tags"])
def test_the_guard_decides_the_read_path_once(mode):
    """``Guard.read_path`` is the one decision: what healing asks, what ``verifies_reads`` and
    the status (/server_info) say, and whether the step check verifies every read before the
    forward, before and after the adapter enables the hashed attention read, and when the mode
    is switched at run time."""
    from synthetic_pool import SyntheticPool

    pool = SyntheticPool(page_size=4, num_pages=32, mode=mode, kernels="torch")
    guard = pool.guard
    verifying = mode in ("verified", "paranoid")

    def agree(expected):
        assert guard.read_path is expected
        assert guard.healing.read_path() is expected
        assert guard.status()["read_path"] == expected.value
        assert guard.verifies_reads is (expected is ReadPath.VERIFIED_IN_ATTENTION)
        verify_all = guard.checker.params(1, 1).verify_all
        assert verify_all is (expected is ReadPath.PRE_FORWARD_CHECK or mode == "paranoid")

    agree(ReadPath.PRE_FORWARD_CHECK if verifying else ReadPath.NONE)
    guard.enable_read_path()
    agree(ReadPath.VERIFIED_IN_ATTENTION if verifying else ReadPath.NONE)
    guard.set_mode("tags")
    assert guard.read_path is ReadPath.NONE and guard.healing.read_path() is ReadPath.NONE
    guard.set_mode(mode)
    agree(ReadPath.VERIFIED_IN_ATTENTION if verifying else ReadPath.NONE)


def test_breaker_opens_past_the_rate_and_closes_as_it_falls():
    clock, control = Clock(), Control()
    actions, metrics = _actions(control, clock, recompute_breaker_per_minute=3)
    policy = actions.healing
    for i in range(3):
        actions.act([_violation(f"r{i}")], [f"r{i}"], policy.breaker_open())
        clock.now += 1
    assert policy.breaker_open() and metrics.recompute_breaker_open._value.get() == 1
    v = _violation("late")
    actions.act([v], ["late"], policy.breaker_open())
    assert control.aborted == ["late"] and "breaker" in v.why_not_healed
    clock.now += WINDOW_S  # the trailing minute empties: healing resumes
    assert not policy.breaker_open() and metrics.recompute_breaker_open._value.get() == 0
    actions.act([_violation("later")], ["later"], policy.breaker_open())
    assert "later" in control.pending


def test_breaker_zero_means_none():
    clock, control = Clock(), Control()
    actions, _ = _actions(control, clock, recompute_breaker_per_minute=0)
    for i in range(100):
        actions.act([_violation(f"r{i}")], [f"r{i}"], actions.healing.breaker_open())
    assert len(control.pending) == 100 and not control.aborted


def test_the_agreed_breaker_state_decides_not_the_local_one():
    """Under TP each rank passes the breaker bit OR-ed over the ranks: a rank whose own breaker
    is closed still aborts when a peer's is open."""
    control = Control()
    actions, _ = _actions(control)
    assert not actions.healing.breaker_open()
    v = _violation("a")
    actions.act([v], ["a"], breaker_open=True)
    assert control.aborted == ["a"] and "breaker" in v.why_not_healed


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_a_page_cached_before_its_verdict_is_quarantined(kernels):
    """A request reads a flipped byte (caught only by verifying attention's read, after the
    forward) and fills a page from it; the prefix cache takes that page before the step's verdict
    is read (an overlap scheduler checkpoints a chunked prefill's chunk then). The page is
    poisoned for every later reader, its healed writer's re-prefill included: the flagged
    request's pages the tree holds by resolve are quarantined."""
    from synthetic_pool import SyntheticPool

    from kvguard.ledger import PageState

    pool = SyntheticPool(page_size=4, num_pages=32, mode="verified", kernels=kernels)
    pool.guard.enable_read_path()
    owner = pool.admit(list(range(10, 18)))
    pool.forward([owner], 8)
    pool.share(owner)  # both pages enter the prefix cache
    reader = pool.admit(list(range(10, 18)) + [1, 2, 3, 4], prefix=owner, prefix_pages=2)
    pool.forward([reader], 3)  # adopts them (checked at the hand-off), writes positions 8-10
    assert not pool.flagged()
    pool.bufs[0][owner.pages[0] * 4 + 1, 0, 0] ^= 1  # a bit flips in the shared KV
    row = reader.row

    def checkpoint():  # the tree takes the reader's 12 tokens (3 pages) before resolve
        pool.guard.on_share(pool.table[row, :12].to(torch.int64), row)

    pool.forward([reader], 1, before_resolve=checkpoint)  # position 11 fills page 2
    assert pool.flagged() == {"r2"}
    assert "read_mismatch" in pool.violations[-1].kinds.names()
    state = pool.guard.ledger.state
    assert state[owner.pages[0]] == PageState.QUARANTINED  # read bad
    assert state[reader.pages[2]] == PageState.QUARANTINED  # computed from it, in the tree
    assert state[owner.pages[1]] == PageState.SHARED  # intact: untouched


@pytest.mark.parametrize("on_violation", ["abort", "recompute"])
def test_a_finished_request_flagged_again_is_logged_not_counted(on_violation):
    """A step launched before a request finished flags it after: the violation is logged (every
    one is), nothing is aborted or recomputed, and no abort is counted."""

    class Finished(Control):
        def abort(self, handle, violation):
            return False  # it had finished

        def recompute(self, handle, violation):
            violation.why_not_healed = "the request had finished"
            return False

    control = Finished()
    actions, metrics = _actions(control, on_violation=on_violation)
    v = _violation("a")
    actions.act([v], ["a"])
    assert actions.history == [v] and v.action == "none"
    assert _value(metrics.requests_aborted) == 0 and _value(metrics.requests_recomputed) == 0


def test_a_plan_touches_nothing_until_applied():
    """Deciding heal-or-abort reaches nothing in the engine (under tensor parallelism the ranks
    agree that every one of them could plan before any applies); applying does the plan."""
    control = Control()
    control.pending.add("b")  # sent back by an earlier step
    actions, _ = _actions(control, on_violation="recompute")
    plan = actions.plan([_violation("a"), _violation("b"), _violation("c")], ["a", "b", None])
    assert [how.value if how else None for _, _, how in plan] == ["recompute", "again", None]
    assert control.count == {} and control.pending == {"b"} and not control.aborted
    assert actions.num_violations == 0  # nothing recorded yet
    actions.apply(plan)
    assert control.pending == {"a", "b"} and control.count == {"a": 1}
    assert [v.action for v, _, _ in plan][:2] == ["recompute", "recompute"]
    assert actions.num_violations == 3

"""The fuzz campaign scores requests kvguard healed (recomputed) instead of aborting, without an
engine: the oracle's outcomes for them (recomputed, recomputed_collateral, false_recompute; an
escape stays an escape), every violation event of a request kept, the injection outcome
``recomputed`` and the per-class counts of recomputes, aborts, escapes and client-visible errors;
the accounting's spans of tokens computed from wrong KV (a recompute drops the tokens of the step
it flagged and computes them again from fresh KV: they never left, while a token from wrong KV
that did leave still counts); a stream that takes back tokens it sent; the campaign's
``--on-violation`` setting."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvguard.fuzz.accounting import Garbage, Scan, Watch, Written
from kvguard.fuzz.client import Response, StreamFold
from kvguard.fuzz.oracle import (
    classify,
    guard_violations,
    injections_from_log,
    tokens_in_spans,
)
from kvguard.fuzz.report import markdown, summarize, verdict

TOP = [[-0.1, t, -3.0, 0] for t in (1, 2, 3, 4)]
REF = ([1, 2, 3, 4], TOP)


def _resp(key, ids=(1, 2, 3, 4), status=200, violation=None, streamed=False, top=None):
    top = top or TOP[: len(ids)]
    r = Response(
        f"i-{key}",
        key,
        1,
        status=status,
        output_ids=list(ids) if status == 200 else None,
        top2=top if status == 200 else None,
        violation=violation,
        error=None if violation is None else f"KV cache integrity violation {violation}",
    )
    if streamed:
        r.streamed, r.stream_ids, r.stream_top2 = True, list(ids), list(top)
        r.stream_end = "abort" if violation else "done"
    return r


def _ev(rid, vid, action, n, step=20, kinds=("checksum_mismatch",)):
    return {
        "event": "kv_integrity_violation",
        "violation_id": vid,
        "request": f"i-{rid}",
        "step": step,
        "kinds": list(kinds),
        "action": action,
        "recomputes": n,
        "pages": [],
    }


def test_guard_violations_keeps_every_event_of_a_request():
    log = [
        _ev("a", "kvg-1", "recompute", 1, step=20),
        {"event": "something_else", "request": "i-a"},
        _ev("a", "kvg-1", "recompute", 1, step=20),  # the same event from another rank
        _ev("a", "kvg-2", "recompute", 2, step=25),
        _ev("a", "kvg-3", "abort", 2, step=30),
        _ev("b", "kvg-4", "abort", 0),
        {"event": "kv_integrity_violation", "violation_id": "kvg-5", "request": None},
    ]
    got = guard_violations(log)
    assert [e["violation_id"] for e in got["i-a"]] == ["kvg-1", "kvg-2", "kvg-3"]
    assert [e["violation_id"] for e in got["i-b"]] == ["kvg-4"]
    assert set(got) == {"i-a", "i-b"}


def _inj(events, planned):
    return injections_from_log(events, planned)


def test_oracle_scores_recomputed_requests():
    """Healed requests are scored by their output like any other; who they are decides the name."""
    ref = {k: REF for k in "abcdefghij"}
    wrong = [TOP[0], [-0.1, 9, -3.0, 0], TOP[2], TOP[3]]
    responses = [
        _resp("a"),  # victim, recomputed, the reference output
        _resp("b"),  # only exposed, recomputed
        _resp("c"),  # touched by nothing, recomputed
        _resp("d", [1, 9, 3, 4], top=wrong),  # victim, recomputed, a decisive difference
        _resp("e", status=500, violation="kvg-e2"),  # victim, recomputed, then its budget spent
        _resp("f", [1, 9], streamed=True, top=wrong[:2]),  # recomputed stream, a wrong token sent
        _resp("g", streamed=True),  # recomputed stream, every token the reference's
        _resp("h"),  # victim, completed unnoticed: exposed, as before
        _resp("i", status=500, violation="kvg-i"),  # victim, aborted (abort mode)
        _resp("j", [1, 2, 3, 4, 4], streamed=True, top=TOP + [TOP[3]]),  # a token repeated
    ]
    responses[9].stream_end = "done"
    events = [
        {
            "event": "injected",
            "id": 1,
            "cls": "bit_flip",
            "at_step": 18,
            "victims": ["i-a", "i-d", "i-e", "i-f", "i-g", "i-h", "i-j"],
            "exposed": ["i-b"],
        },
        {"event": "injected", "id": 2, "cls": "premature_free", "at_step": 19, "victims": ["i-i"]},
    ]
    injections = _inj(events, [{"id": 1, "cls": "bit_flip"}, {"id": 2, "cls": "premature_free"}])
    log = [_ev(k, f"kvg-{k}", "recompute", 1) for k in "abcdfgj"]
    log += [_ev("a", "kvg-a2", "recompute", 1, step=21)]  # flagged again by the step in flight
    spent = {
        **_ev("e", "kvg-e2", "abort", 1, step=24),
        "why_not_healed": "recompute budget spent (1)",
    }
    log += [_ev("e", "kvg-e1", "recompute", 1), spent]
    log += [_ev("i", "kvg-i", "abort", 0, step=21)]
    # a step in flight flags a request already finished: nothing done to it
    log += [
        {**_ev("g", "kvg-g2", "none", 1, step=22), "why_not_healed": "the request had finished"}
    ]
    records, injections = classify(ref, responses, injections, guard_violations(log))
    by = {r["key"]: r for r in records}
    assert {k: r["outcome"] for k, r in by.items()} == {
        "a": "recomputed",
        "b": "recomputed_collateral",
        "c": "false_recompute",
        "d": "escaped",  # an escape is an escape whatever the guard did
        "e": "detected",  # recomputed, then aborted: an abort
        "f": "escaped",
        "g": "recomputed",
        "h": "exposed",
        "i": "detected",
        "j": "escaped",  # one token too many reached the client (past the reference's end)
    }
    assert by["f"]["streamed_escape"] and not by["f"]["guard_aborted"]
    assert [by[k]["recomputes"] for k in "abcdefghij"] == [1, 1, 1, 1, 1, 1, 1, 0, 0, 1]
    assert by["e"]["guard_actions"] == ["recompute", "abort"] and by["e"]["steps_to_abort"] == 2
    assert by["g"]["guard_actions"] == ["recompute", "none"] and "why_not_healed" not in by["g"]
    assert "guard_abort_unseen" not in by["g"]
    assert not any(by[k]["client_error"] for k in "abcdfghj")
    assert by["e"]["client_error"] and by["i"]["client_error"]
    assert "guard_abort_unseen" not in by["a"]
    assert by["a"]["guard_actions"] == ["recompute", "recompute"]
    assert by["a"]["repeated_recompute_events"] == 1
    # the injection: an escape wins; one with only healed victims is recomputed
    assert injections[1]["outcome"] == "escaped"
    assert injections[2]["outcome"] == "detected"
    one = injections[1]
    assert (one["victims_recomputed"], one["collateral_recomputed"]) == (5, 1)  # a d f g j; b
    assert (one["victims_aborted"], one["recomputes"]) == (1, 7)  # e; a b d e f g j
    assert (one["escaped_requests"], one["client_errors"]) == (3, 1)
    assert injections[2]["client_errors"] == 1 and injections[2]["victims_recomputed"] == 0
    # a victim recomputed, none escaped, none aborted: recomputed
    healed = _inj(events[:1], [{"id": 1, "cls": "bit_flip"}])
    healed[1]["victims"] = {"i-a": 18, "i-g": 18}
    _, healed = classify(ref, [responses[0], responses[6]], healed, guard_violations(log))
    assert healed[1]["outcome"] == "recomputed"

    cfg = {
        "mode": "verified",
        "page_size": 16,
        "on_violation": "recompute",
        "requests": records,
        "injections": list(injections.values()),
    }
    s = summarize(cfg)
    assert s["requests"]["recomputed"] == 2 and s["requests"]["false_recompute"] == 1
    assert s["requests"]["recomputed_collateral"] == 1
    assert (s["requests_recomputed"], s["recomputes"], s["recomputed_then_aborted"]) == (8, 8, 1)
    assert s["client_visible_errors"] == 2 and s["client_errors_unattributed"] == 0
    assert s["aborts_by_class"]["bit_flip"]["victims_recomputed"] == 5
    assert s["aborts_by_class"]["premature_free"]["client_errors"] == 1
    assert s["injections"]["escaped"] == 1 and s["on_violation"] == "recompute"
    assert s["not_healed"] == {"recompute budget spent (1)": 1}
    assert s["repeated_recompute_events"] == 1
    assert by["e"]["why_not_healed"] == "recompute budget spent (1)"
    cfg["summary"] = s
    bad = verdict(cfg)
    assert not any("recompute" in b for b in bad)  # healed requests are no failure
    assert any("escaped" in b for b in bad)


def test_a_recompute_alone_is_no_failure():
    ref = {k: REF for k in "abc"}
    responses = [_resp("a"), _resp("b"), _resp("c", streamed=True)]
    events = [
        {"event": "injected", "id": 1, "cls": "bit_flip", "at_step": 5, "victims": ["i-a"]},
        {"event": "victims", "id": 1, "cls": "bit_flip", "at_step": 6, "exposed": ["i-b"]},
    ]
    injections = _inj(events, [{"id": 1, "cls": "bit_flip"}])
    log = [_ev(k, f"kvg-{k}", "recompute", 1) for k in "abc"]
    records, injections = classify(ref, responses, injections, guard_violations(log))
    assert [r["outcome"] for r in records] == [
        "recomputed",
        "recomputed_collateral",
        "false_recompute",
    ]
    assert injections[1]["outcome"] == "recomputed"
    cfg = {
        "mode": "paranoid",
        "page_size": 16,
        "on_violation": "recompute",
        "requests": records,
        "injections": list(injections.values()),
        "clean": {"tokens_per_s": 1.0, "requests": 3},
    }
    cfg["summary"] = summarize(cfg)
    assert verdict(cfg) == []
    cfg["verdict"] = []
    report = {
        "seed": 1,
        "settings": {
            "num_requests": 3,
            "num_injections": 1,
            "wave_size": 3,
            "max_total_tokens": 2048,
            "chunked_prefill_size": 64,
            "tie_margin": 0.1,
            "on_violation": "recompute",
        },
        "configs": [cfg],
    }
    md = markdown(report)
    assert "KVGUARD_ON_VIOLATION=recompute" in md and "Guard actions per injection" in md
    assert "| paranoid ps16 | 3 | 0 | 0 | 0 | 0 | 1 (1, 1) |" in md


def test_a_leak_victim_healed_before_the_read_is_no_leak():
    ref = {k: REF for k in "ab"}
    responses = [_resp("a"), _resp("b")]
    events = [
        {"event": "injected", "id": 1, "cls": "cross_tenant", "at_step": 30, "victims": ["i-a"]},
        {"event": "victims", "id": 1, "cls": "cross_tenant", "at_step": 31, "victims": ["i-b"]},
    ]
    injections = _inj(events, [{"id": 1, "cls": "cross_tenant"}])
    log = [_ev("a", "kvg-a", "recompute", 1, step=30), _ev("b", "kvg-b", "recompute", 1, step=40)]
    records, _ = classify(ref, responses, injections, guard_violations(log))
    assert [r["outcome"] for r in records] == ["recomputed", "escaped"]
    assert records[1]["leak"]  # recomputed long after another tenant's KV served it


# -- tokens from wrong KV ------------------------------------------------------------------------
def test_tokens_in_spans():
    assert tokens_in_spans([[2, None]], 6) == 4
    assert tokens_in_spans([[2, 2]], 6) == 0  # dropped and computed again: none left
    assert tokens_in_spans([[2, 4]], 6) == 2  # two kept from wrong KV, then computed again
    assert tokens_in_spans([[2, 4], [3, None]], 6) == 4  # overlapping spans count once
    assert tokens_in_spans([[2, 4], [5, None]], 3) == 1  # only what was sent
    assert tokens_in_spans([[4, 2]], 6) == 0  # it kept fewer than it had computed


def test_oracle_charges_only_tokens_that_left():
    """A recompute drops the tokens computed from wrong KV at the step it flagged: a victim that
    completed with every token is charged only with those it kept (wrong_kv spans), and a log
    from before spans (read_at only) is read as before."""
    ref = {k: REF for k in "abcd"}
    responses = [_resp(k) for k in "abc"] + [_resp("d", streamed=True)]
    events = [
        {
            "event": "injected",
            "id": 1,
            "cls": "in_forward_flip",
            "at_step": 10,
            "victims": ["i-a", "i-b", "i-c", "i-d"],
            "read_at": {"i-a": 1, "i-b": 1, "i-c": 1, "i-d": 2},
            "wrong_kv": {"i-a": [[1, None]]},
        },
        {
            "event": "victims",
            "id": 1,
            "cls": "in_forward_flip",
            "at_step": 12,
            "victims": ["i-a", "i-b", "i-c", "i-d"],
            "read_at": {"i-a": 1, "i-b": 1, "i-c": 1, "i-d": 2},
            # a: flagged at the step it read wrong KV (token 1 dropped); b: flagged a step late
            # (token 1 left); c: open (never recomputed); d: a log from before spans
            "wrong_kv": {"i-a": [[1, 1]], "i-b": [[1, 2]], "i-c": [[1, None]]},
            "restarts": {"i-a": [[11, 1]], "i-b": [[12, 2]]},
        },
    ]
    injections = _inj(events, [{"id": 1, "cls": "in_forward_flip"}])
    assert injections[1]["wrong_kv"]["i-a"] == [[1, 1]]  # the latest state wins
    log = [_ev(k, f"kvg-{k}", "recompute", 1) for k in "ab"]
    records, _ = classify(ref, responses, injections, guard_violations(log))
    by = {r["key"]: r for r in records}
    assert [by[k]["tokens_from_wrong_kv"] for k in "abcd"] == [0, 1, 3, 2]
    assert by["a"]["outcome"] == "recomputed" and by["a"]["restarts"] == [[11, 1]]
    assert by["a"]["wrong_kv_spans"] == [[1, 1]] and by["a"]["wrong_kv_from_token"] == 1
    assert by["c"]["outcome"] == "exposed"


# -- the accounting: a restart closes the span -------------------------------------------------------
PS = 4


class _Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_decode(self):
        return self.kind == "decode"

    def is_extend(self):
        return self.kind in ("extend", "mixed")

    def is_mixed(self):
        return self.kind == "mixed"


class _World:
    """A scheduler as the accounting reads it: one page table, requests, the batch of a step."""

    def __init__(self):
        self.table = torch.full((4, 32), -1, dtype=torch.int64)
        self.sched = SimpleNamespace(
            token_to_kv_pool_allocator=SimpleNamespace(page_size=PS),
            req_to_token_pool=SimpleNamespace(req_to_token=self.table),
            running_batch=SimpleNamespace(reqs=[]),
            waiting_queue=[],
            chunked_req=None,
        )

    def req(self, rid, prompt, row, slots):
        req = SimpleNamespace(
            rid=rid,
            origin_input_ids=list(prompt),
            output_ids=[],
            kv=SimpleNamespace(req_pool_idx=row, kv_allocated_len=0, kv_committed_len=0),
            finished=lambda: False,
        )
        req.kv.holds_kv = True
        self.place(req, row, slots)
        return req

    def place(self, req, row, slots):
        """Give ``req`` row ``row`` mapping positions 0.. to ``slots``."""
        req.kv.req_pool_idx = row
        self.table[row, : len(slots)] = torch.tensor(slots)
        req.kv.kv_allocated_len = len(slots)

    def decode(self, req, slot):
        """A decode step of ``req``: writes the KV of its last token at the next position."""
        pos = len(req.origin_input_ids) + len(req.output_ids) - 1
        self.table[req.kv.req_pool_idx, pos] = slot
        req.kv.kv_allocated_len = req.kv.kv_committed_len = pos + 1
        n = torch.tensor([pos + 1])
        return SimpleNamespace(
            reqs=[req],
            forward_mode=_Mode("decode"),
            out_cache_loc=torch.tensor([slot]),
            seq_lens=n,
            seq_lens_cpu=n,
            prefix_lens=None,
            extend_lens=None,
        )

    def extend(self, req, start, slots):
        """A prefill (chunk) of ``req`` writing positions start.. into ``slots``."""
        end = start + len(slots)
        self.table[req.kv.req_pool_idx, start:end] = torch.tensor(slots)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = end
        n = torch.tensor([end])
        return SimpleNamespace(
            reqs=[req],
            forward_mode=_Mode("extend"),
            out_cache_loc=torch.tensor(slots),
            seq_lens=n,
            seq_lens_cpu=n,
            prefix_lens=[start],
            extend_lens=[len(slots)],
        )

    def step(self, watch, batch, step):
        scan = Scan(self.sched, batch, watch.pages)
        return watch.before_forward(scan, None, step)


def test_a_recompute_closes_the_span_of_tokens_from_wrong_kv():
    """A victim reads a flipped slot in a decode step (token 1 from wrong KV), decodes once more
    (token 2), then is recomputed: released, prefilled again into fresh slots from its prompt
    and the one token it kept (tokens 1 and 2 dropped), decodes on from fresh KV. Its span is
    [1, 1): no token from wrong KV left. It is no longer poisoned: what it writes now is its own
    KV."""
    w = _World()
    req = w.req("r", [11, 12, 13, 14], 0, [0, 1, 2, 3])
    req.kv.kv_committed_len = 4
    req.output_ids = [5]  # the prefill computed token 0
    watch = Watch(PS, 10, {2: Garbage("bit_flip")})
    assert w.step(watch, w.decode(req, 4), 10)  # computes token 1, reading slot 2
    assert watch.read_at == {"r": 1} and watch.spans == {"r": [[1, None]]}
    assert "r" in watch.poisoned
    req.output_ids.append(6)
    w.step(watch, w.decode(req, 5), 11)  # token 2, still from the flipped slot
    assert watch.spans == {"r": [[1, None]]}
    # the guard recomputes it: tokens 1 and 2 dropped, a fresh row, prefilled again
    req.output_ids = [5]
    w.place(req, 1, [16, 17, 18, 19, 20])
    assert w.step(watch, w.extend(req, 0, [16, 17, 18, 19, 20]), 12)
    assert watch.spans == {"r": [[1, 1]]} and watch.restarts == {"r": [[12, 1]]}
    assert "r" not in watch.poisoned
    for n, slot in enumerate((21, 22), 2):  # decodes on from fresh KV: no new span
        req.output_ids.append(n + 4)
        w.step(watch, w.decode(req, slot), 12 + n)
    assert watch.spans == {"r": [[1, 1]]} and watch.read_at == {"r": 1}
    assert tokens_in_spans(watch.spans["r"], 6) == 0


def test_a_late_recompute_keeps_the_tokens_that_left_and_a_chunk_is_no_restart():
    """Flagged a step after it read wrong KV, the victim keeps token 1 (computed from wrong KV,
    sent): the span is [1, 2). A prefill's next chunk starts where the last one ended: no restart.
    A re-prefill that maps the flipped slot again reads wrong KV again: a new span."""
    w = _World()
    req = w.req("r", list(range(10, 18)), 0, [0, 1, 2, 3])
    w.extend(req, 0, [0, 1, 2, 3])  # the prompt's first chunk, before the flip
    watch = Watch(PS, 1, {2: Garbage("bit_flip")})  # then slot 2 flipped
    w.place(req, 0, [0, 1, 2, 3, 4, 5, 6, 7])
    w.step(watch, w.extend(req, 4, [4, 5, 6, 7]), 2)  # the second chunk reads slot 2: token 0
    assert watch.spans == {"r": [[0, None]]}
    req.output_ids = [30]
    w.step(watch, w.decode(req, 8), 3)
    req.output_ids = [30, 31]
    w.step(watch, w.decode(req, 9), 4)
    assert watch.spans == {"r": [[0, None]]} and not watch.restarts
    # recomputed keeping tokens 0 and 1 (computed from wrong KV, already sent)
    w.place(req, 2, [0, 1, 2, 3, 12, 13, 14, 15, 16, 17])  # a prefix hit on the flipped page
    w.step(watch, w.extend(req, 4, [12, 13, 14, 15, 16, 17]), 5)
    assert watch.spans == {"r": [[0, 2], [2, None]]} and watch.restarts == {"r": [[5, 2]]}
    assert "r" in watch.poisoned  # it reads the flipped slot again
    assert tokens_in_spans(watch.spans["r"], 2) == 2


def test_a_chunked_reprefill_computes_the_token_after_those_kept():
    """A re-prefill of prompt + kept tokens in chunks: a chunk that reads wrong KV taints the
    first token the re-prefill computes (the kept count), not token 0."""
    w = _World()
    req = w.req("r", [1, 2, 3, 4, 5, 6, 7, 8], 0, [0, 1, 2, 3, 4, 5, 6, 7])
    req.kv.kv_committed_len = 8
    req.output_ids = [9, 10, 11]
    w.place(req, 0, list(range(11)))
    watch = Watch(PS, 1, {2: Garbage("bit_flip")})
    w.step(watch, w.decode(req, 10), 1)  # computes token 3 reading slot 2
    assert watch.spans == {"r": [[3, None]]}
    # prefilled again: a prefix-cache hit on the flipped page, then a first chunk of 4 of the 7
    # tokens left (it computes no token)
    w.place(req, 1, [0, 1, 2, 3, 20, 21, 22, 23, 24, 25, 26])
    w.step(watch, w.extend(req, 4, [20, 21, 22, 23]), 2)
    assert watch.spans == {"r": [[3, 3], [3, None]]}
    assert watch.wrong_reads["r"][-1] == [3, 2, 2, "garbage (bit_flip)"]


def test_a_bad_writer_prefilled_again_writes_its_own_kv():
    """shared_write's writer (its writes into the watched page are checked for landing) that is
    recomputed gets rows afresh: its writes into pages it is given now are its own KV, no bad
    write."""
    w = _World()
    other = w.req("o", [1, 2, 3, 4], 1, [0, 1, 2, 3])
    other.kv.kv_committed_len = 4
    watch = Watch(PS, 1, {s: Written((None, None), s, other) for s in range(4)})
    writer = w.req("w", [1, 2, 3, 4], 0, [8, 9, 10, 11])
    writer.kv.kv_committed_len = 4
    writer.output_ids = [7]
    watch.foreign["w"] = writer
    w.step(watch, w.decode(writer, 12), 1)  # writes outside the watched page: how far it got
    writer.output_ids = [7, 8]
    w.step(watch, w.decode(writer, 13), 2)
    w.place(writer, 2, [0, 1, 2, 3, 4])  # re-prefilled into the page, freed and given to it
    assert w.step(watch, w.extend(writer, 0, [0, 1, 2, 3, 4]), 3)
    assert "w" not in watch.foreign and watch.restarts == {"w": [[3, 2]]}
    assert watch.bad_writes == 0 and watch.contents[0].req is writer


def _pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=64,
        page_size=PS,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )


def test_a_bad_write_that_a_firewall_drops_leaves_the_page_as_it_was():
    """shared_write: the writer's position 4 maps into another request's page (slot 0), it reads
    that slot in the very forward (wrong KV: it is poisoned) and writes its KV there. Dropped
    (the bytes unchanged), the slot still holds the owner's KV; landed, the writer's poisoned
    KV."""
    for lands in (False, True):
        w = _World()
        owner = w.req("o", [1, 2, 3, 4], 1, [0, 1, 2, 3])
        owner.kv.kv_committed_len = 4
        watch = Watch(PS, 1, {s: Written((None, None), s, owner) for s in range(4)})
        writer = w.req("w", [1, 2, 3, 4], 0, [8, 9, 10, 11])
        writer.kv.kv_committed_len = 4
        writer.output_ids = [7]
        watch.foreign["w"] = writer
        pool = _pool()
        batch = w.decode(writer, 0)  # position 4 -> slot 0, the owner's page
        scan = Scan(w.sched, batch, watch.pages)
        watch.before_forward(scan, pool, 1)
        assert "w" in watch.poisoned and watch.spans == {"w": [[1, None]]}
        if lands:
            pool.k_buffer[0][0] += 1
        watch.after_forward(scan, pool, 1)
        assert (watch.bad_writes, watch.bad_writes_landed) == (1, int(lands))
        held = watch.contents[0]
        assert (held.req is writer and held.poisoned) if lands else held.req is owner


def test_a_refused_write_into_a_page_another_request_reads_charges_nobody():
    """double_allocation's aftermath: two live rows map one page. Its owner wrote positions 0-3
    there; the stale holder's next decode writes its position 4 into slot 2, which the owner
    reads. A write firewall refuses it (the bytes unchanged): the slot still holds the owner's
    KV, the owner reads the right KV (not charged) and the stale holder reads the owner's KV at
    its position 4 (it is). Landed (the bytes changed): the owner reads the stale holder's KV
    (charged from the token this forward computes), the stale holder its own new row."""
    for lands in (False, True):
        w = _World()
        owner = w.req("o", [1, 2, 3, 4], 1, [0, 1, 2, 3])
        owner.kv.kv_committed_len = 4
        owner.output_ids = [9]
        watch = Watch(PS, 1, {s: Written((None, None), s, owner) for s in range(4)})
        stale = w.req("s", [5, 6, 7, 8], 0, [4, 5, 6, 7])
        stale.kv.kv_committed_len = 4
        stale.output_ids = [7]
        one, two = w.decode(owner, 12), w.decode(stale, 2)  # owner: a fresh page; stale: slot 2
        n = torch.tensor([5, 5])
        batch = SimpleNamespace(
            reqs=[owner, stale],
            forward_mode=_Mode("decode"),
            out_cache_loc=torch.cat([one.out_cache_loc, two.out_cache_loc]),
            seq_lens=n,
            seq_lens_cpu=n,
            prefix_lens=None,
            extend_lens=None,
        )
        pool = _pool()
        scan = Scan(w.sched, batch, watch.pages)
        assert scan.contested == {2}
        watch.before_forward(scan, pool, 1)
        assert not watch.spans and not watch.poisoned  # judged once the bytes tell
        scan.snapshot(pool)  # right before the forward
        if lands:
            pool.v_buffer[0][2] += 1
        scan.settle(pool)  # right after it
        assert watch.after_forward(scan, pool, 1)
        assert (watch.bad_writes, watch.bad_writes_landed) == (0, 0)  # no designated bad writer
        if lands:
            assert watch.contents[2].req is stale and watch.spans == {"o": [[1, None]]}
            assert "s" not in watch.poisoned  # it read its own new row
        else:
            assert watch.contents[2].req is owner and "o" not in watch.spans
            assert "o" not in watch.victims and "o" not in watch.poisoned
            assert watch.spans == {"s": [[1, None]]}  # it read the owner's KV at its position 4
            assert watch.wrong_reads["s"] == [[1, 2, 4, "KV of o at 2 (another position)"]]


def test_a_poisoned_write_that_did_not_land_poisons_nothing():
    """A request reading a flipped slot writes wrong KV: followed from then on, but only where it
    landed. Its write into another request's page (slot 9, which that request reads) refused,
    the slot keeps that request's KV and is not followed."""
    for lands in (False, True):
        w = _World()
        req = w.req("p", [1, 2, 3, 4], 0, [0, 1, 2, 3])
        req.kv.kv_committed_len = 4
        req.output_ids = [5]
        other = w.req("q", [6, 7, 8, 9], 1, [8, 9, 10, 11])
        other.kv.kv_committed_len = 4
        w.sched.running_batch.reqs = [other]  # not in this batch: it reads slot 9 later
        watch = Watch(PS, 1, {2: Garbage("bit_flip")})
        pool = _pool()
        scan = Scan(w.sched, w.decode(req, 9), watch.pages)
        assert scan.contested == {9}
        watch.before_forward(scan, pool, 1)
        assert "p" in watch.poisoned and 9 not in watch.contents
        if lands:
            pool.k_buffer[0][9] += 1
        scan.settle(pool)
        watch.after_forward(scan, pool, 1)
        assert (9 in watch.contents and watch.contents[9].poisoned) == lands
        assert (2 in watch.pages) == lands


def test_mixed_batch_decodes_are_no_restart():
    w = _World()
    req = w.req("r", [1, 2, 3, 4], 0, [0, 1, 2, 3])
    req.kv.kv_committed_len = 4
    req.output_ids = [5]
    watch = Watch(PS, 1, {2: Garbage("bit_flip")})
    w.step(watch, w.decode(req, 4), 1)
    req.output_ids.append(6)
    batch = w.decode(req, 5)
    batch.forward_mode, batch.prefix_lens, batch.extend_lens = _Mode("mixed"), [5], [1]
    w.step(watch, batch, 2)
    assert not watch.restarts and watch.spans == {"r": [[1, None]]}


# -- the client: a stream that takes back tokens ---------------------------------------------------
def _chunk(ids, done=None, reason=None):
    meta = {"completion_tokens": len(ids) if done is None else done}
    if reason is not None:
        meta["finish_reason"] = reason
    return {"output_ids": ids, "meta_info": meta}


def test_stream_that_takes_back_sent_tokens_is_counted():
    def fold(chunks):
        out = Response("r", "k", 0, streamed=True)
        f = StreamFold(out)
        for c in chunks:
            f.chunk(c)
        return out

    ok = fold([_chunk([5]), _chunk([5, 6]), _chunk([], done=2, reason={"type": "abort"})])
    assert ok.stream_withdrawn == 0
    back = fold([_chunk([5, 6, 7]), _chunk([5, 6]), _chunk([5, 6, 7, 8])])  # 7 taken back
    assert back.stream_withdrawn == 1 and back.stream_ids == [5, 6, 7, 8]
    inc = fold([_chunk([5], done=1), _chunk([6, 7], done=3), _chunk([7], done=2)])
    assert inc.stream_withdrawn == 1


# -- the campaign's setting --------------------------------------------------------------------------
def test_cli_on_violation_reaches_the_guarded_servers(tmp_path, monkeypatch):
    from kvguard.fuzz import campaign
    from kvguard.fuzz.cli import parser, settings_from

    assert settings_from(parser().parse_args([])).on_violation == "recompute"
    s = settings_from(parser().parse_args(["--on-violation", "abort", "--out", str(tmp_path)]))
    assert s.on_violation == "abort"
    started = []

    class Serve:
        def __init__(self, args, log, env):
            started.append(env)

        def start(self):
            pass

    monkeypatch.setattr(campaign, "ServeProcess", Serve)
    monkeypatch.setattr(campaign, "_guard_status", lambda srv: {})
    for mode in ("verified", "off"):
        run = campaign.ConfigRun(mode, 16, tmp_path / mode)
        run.dir.mkdir()
        campaign.Runner(s, [])._start(run)
    assert started[0]["KVGUARD_ON_VIOLATION"] == "abort"
    assert "KVGUARD_ON_VIOLATION" not in started[1]  # no guard to tell


def test_a_victim_waiting_for_its_recompute_keeps_its_watch_open():
    """Sent back to be recomputed, a victim holds no KV until its prefill: its incident stays
    open (so the plugin keeps following it) until the restart closes its span."""
    w = _World()
    req = w.req("r", [11, 12, 13, 14], 0, [0, 1, 2, 3])
    req.kv.kv_committed_len = 4
    req.output_ids = [5]
    watch = Watch(PS, 10, {2: Garbage("bit_flip")})
    w.step(watch, w.decode(req, 4), 10)
    assert watch.spans == {"r": [[1, None]]}
    later = 10 + 1000  # long after the incident's last event
    req.kv.holds_kv = False  # released, waiting in the queue for its prefill
    assert watch.is_open(later)
    watch.spans["r"][-1][1] = 1  # the restart closed the span
    assert not watch.is_open(later)


def test_the_plugin_stops_following_only_settled_injections():
    from kvguard.fuzz import plugin

    def inj(open_):
        return SimpleNamespace(watch=SimpleNamespace(is_open=lambda step, o=open_: o))

    old_open, old_settled = inj(True), inj(False)
    recent = [inj(False) for _ in range(plugin.MAX_WATCHED)]
    st = SimpleNamespace(step=5, active=[old_open, old_settled, *recent])
    plugin._retire(st)
    assert st.active == [old_open, *recent]


def test_a_null_logprob_from_garbage_kv_is_no_client_crash():
    """With the guard off, KV gone to garbage gives NaN logits, which arrive as null logprobs:
    the position has no top-2 (so it is never a near tie), and the client goes on."""
    from kvguard.fuzz.client import _top2

    assert _top2([[None, 7, "a"], [None, 9, "b"]]) is None
    assert _top2([[-0.12345, 7, "a"], [-1.0, 9, "b"]]) == [-0.1235, 7, -1.0, 9]

"""The oracle: what reached each client, judged against the clean reference run.

Request outcomes (requests the client itself dropped are ``client_abort``, unless a token it
was sent before it dropped them already differed from the clean pass's: ``escaped``):

- ``clean``: output identical to the reference, token for token, and the request no victim of
  an injection;
- ``exposed``: a victim of an injection (it read, or would have read, wrong KV bytes: see
  ``accounting``) that completed with the reference output, token for token: the wrong bytes
  changed no greedy token this time. Not an escape, not nothing either;

- ``recomputed``: a victim of an injection that kvguard healed instead of aborting (its KV
  released, prefilled again from its prompt and the tokens it kept, decoded on: one
  ``kv_integrity_violation`` event with ``action: recompute`` per time) and that completed with
  the reference output, token for token, every streamed token included;
- ``recomputed_collateral``: the same for a request that was only exposed to an injection, and
  ``false_recompute`` for one no injection touched: reported, not errors (the client saw
  nothing but latency). A recomputed request whose output differs is scored like any other
  (``escaped``, ``near_tie``); one recomputed and then aborted (its budget spent) is scored as
  an abort (``detected``, ``collateral``, ``false_abort``);

Besides its outcome, a victim's record counts ``tokens_from_wrong_kv``: tokens that reached its
client (streamed, or in its completed output) although the forward that computed them read wrong
KV bytes (the accounting names each span of such tokens: from the first token a forward that read
wrong KV computed, to where a recompute or retraction began computing them again from fresh KV;
tokens it dropped and computed again never left). Same or not, they left unverified: a guard that
checks what attention read before a step's tokens go out sends none.
- ``detected``: aborted by kvguard and a victim of an injection, every token it was sent before
  the abort (streamed) the reference's;
- ``collateral``: aborted by kvguard, a victim of no injection, but exposed to one in the
  accounting's sense (it held a page an injection involved while its own KV stayed intact: its
  output would have matched);
- ``escaped``: a token that reached the client differs from the reference (victim or not) at a
  position the model chose decisively. For a plain request, its completed output; for a
  streamed one, every token it was sent, **even if kvguard aborted it afterwards** (a streamed
  escape: the client already had the wrong token) or its client dropped it. Also a completed
  victim of a leak class (``cross_tenant``: it was served from another tenant's KV, whatever
  its tokens);
- ``near_tie``: completed, output differs first at a step where both runs had their two best
  tokens within ``tie_margin`` nats of each other, with a candidate in common. Greedy decoding
  is not bit-stable across batch compositions and prefix-cache states (chunk boundaries change
  the KV's rounding), so a clean run flips such ties too: reported, not counted as an escape.
  The campaign measures this noise floor by comparing the clean passes of configurations. A
  stream that first differs at a near tie is not an escape either (its later tokens follow a
  different context): it is judged by how it ended;
- ``false_abort``: aborted by kvguard but no injection touched its KV or its pages (the record
  says whether the guard saw changed KV bytes, i.e. corruption the plugin did not follow, or
  only distrusted a page whose bytes still verified);
- ``error``: no answer or another failure (server death, timeout, a stream cut or ended by an
  error that is not kvguard's);
- ``no_reference``: the reference run has no output to compare with.

Injection outcomes: ``escaped`` (some victim's wrong token reached its client: a completed wrong
output, or a streamed token before the abort), ``detected`` (some victim aborted by kvguard, and
no victim's wrong token reached a client), ``recomputed`` (some victim recomputed by kvguard, none
aborted, none escaped), ``refused`` (the guard refused the bad prefix-cache
hit itself, so no request read it: ``cross_tenant``), ``near_tie`` (a victim's output differs
only from a near-tie step on), ``exposed`` (its victims completed with the reference output: the
corruption changed no greedy token, or the guard repaired it before they read it; called
``masked`` before streaming was scored), ``unscored`` (its only victims were dropped by their
client or failed), ``no_victim`` (the KV it touched was never read by a request still running),
``not_landed`` (a stale write that never found a reader; an in-forward flip whose layer never
ran), ``skipped`` (no fitting moment within max_tries steps), ``not_run`` (still queued when the
configuration ended), ``injector_error``. Each injection also counts what the guard did to the
requests charged to it (each victim, or request only exposed, is charged to one injection):
victims aborted, collateral (requests only exposed to it, a victim of no injection, aborted),
victims and exposed requests recomputed (healed: not aborted in the end), recomputes, escaped
requests, and client-visible errors (guard aborts and any other error a client saw).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

from kvguard.fuzz.client import Response

TIE_MARGIN = 0.1  # nats between the two best tokens: below this a flip may be rounding noise
# a leak class's victim the guard recomputed at most this many steps after it became one was
# healed before it read another tenant's KV (the plugin judges it before that forward, the guard
# flags it in that forward's checks: the same step, or the next by the other counter)
LEAK_HEAL_STEPS = 1
REQUEST_OUTCOMES = (
    "clean",
    "exposed",
    "recomputed",
    "recomputed_collateral",
    "false_recompute",
    "detected",
    "collateral",
    "escaped",
    "near_tie",
    "false_abort",
    "error",
    "no_reference",
    "client_abort",
)
INJECTION_OUTCOMES = (
    "detected",
    "recomputed",
    "refused",
    "escaped",
    "near_tie",
    "exposed",
    "unscored",
    "no_victim",
    "not_landed",
    "skipped",
    "not_run",
    "injector_error",
)
UNGUARDED = ("off", "canary")  # guard modes whose escapes measure the oracle, not a guard
LEAK_CLASSES = ("cross_tenant",)  # a victim that completes is a leak, whatever its tokens
CANARY_LINE = re.compile(r"kv_canary violation: .*slot_idx=(\d+) position=(\d+)")


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
    return out


def injections_from_log(events: list[dict], planned: list[dict]) -> dict[int, dict]:
    """Fold the plugin's log (injected / victims / landed / skipped) into one record per entry:
    victims and exposed requests with the step each was first seen (logs of older campaigns
    have no exposed sets: every holder was a victim then)."""
    out = {
        e["id"]: {
            "id": e["id"],
            "cls": e["cls"],
            "wave": e.get("wave"),
            "status": "not_run",
            "at_step": None,
            "victims": {},
            "exposed": {},
            "why": {},
            "read_at": {},  # victim -> first output token it computed from wrong KV
            "wrong_kv": {},  # victim -> [[from, to or None], ...]: tokens from wrong KV
            "restarts": {},  # victim -> [[step, tokens kept], ...]: prefilled again after
            "wrong_reads": {},  # victim -> [[token, slot, position, what it held], ...]
            "detail": None,
            "pending": False,
            "bad_writes": [0, 0],  # writes into pages the writer does not own: landed, made
        }
        for e in planned
    }
    for ev in events:
        rec = out.get(ev.get("id"))
        if rec is None:
            if ev.get("event") == "injector_error":
                for r in out.values():  # an injector error names no entry: the queue head
                    if r["status"] == "not_run":
                        r["status"], r["detail"] = "injector_error", ev.get("error")
                        break
            continue
        kind = ev.get("event")
        if kind == "skipped":
            rec["status"] = "skipped"
        elif kind == "injector_error" and rec["status"] == "not_run":  # refused (another pool)
            rec["status"], rec["detail"] = "injector_error", ev.get("error")
        elif kind == "unfired":  # an in-forward flip whose layer never ran: nothing changed
            rec["victims"], rec["exposed"], rec["why"] = {}, {}, {}
            rec["pending"], rec["unfired"], rec["read_at"] = True, True, {}
            rec["wrong_kv"], rec["restarts"], rec["wrong_reads"] = {}, {}, {}
            rec["detail"] = {**(rec["detail"] or {}), **(ev.get("detail") or {})}
        elif kind in ("injected", "victims", "landed", "fired") and not rec.get("unfired"):
            if kind == "injected":
                rec["status"], rec["at_step"] = "injected", ev.get("at_step")
            rec["detail"] = ev.get("detail") if kind != "victims" else rec["detail"]
            rec["pending"] = bool(ev.get("pending"))
            rec["bad_writes"] = ev.get("bad_writes") or rec.get("bad_writes") or [0, 0]
            for rid in ev.get("victims", []):
                rec["victims"].setdefault(rid, ev.get("at_step"))  # first step it was a victim
            for rid in ev.get("exposed", []):
                rec["exposed"].setdefault(rid, ev.get("at_step"))
            for rid, why in (ev.get("why") or {}).items():
                rec["why"].setdefault(rid, why)
            for rid, at in (ev.get("read_at") or {}).items():
                rec["read_at"].setdefault(rid, at)
            for key in ("wrong_kv", "restarts", "wrong_reads"):  # whole state: latest wins
                rec[key].update(ev.get(key) or {})
    for rec in out.values():  # a request first exposed, later a victim, is a victim
        rec["exposed"] = {r: s for r, s in rec["exposed"].items() if r not in rec["victims"]}
    return out


def guard_violations(server_log_events: list[dict]) -> dict[str, list[dict]]:
    """kvguard's ``kv_integrity_violation`` log events by request id, every one in log order
    (a healed request has one per recompute, and perhaps a final abort; an event logged by
    several ranks counts once)."""
    out: dict[str, list[dict]] = {}
    seen: set = set()
    for ev in server_log_events:
        if ev.get("event") == "kv_integrity_violation" and ev.get("request"):
            vid = ev.get("violation_id")
            if vid is not None:
                if (ev["request"], vid) in seen:
                    continue
                seen.add((ev["request"], vid))
            out.setdefault(ev["request"], []).append(ev)
    return out


def recomputes_of(events: list[dict]) -> int:
    """How many times the guard recomputed a request: its events with action ``recompute``, one
    per distinct ``recomputes`` count they name (a step already in flight when the request was
    sent back may flag it again, under the same count); logs from before healing have no
    action: each event an abort."""
    counts: set = set()
    for i, ev in enumerate(events):
        if ev.get("action") == "recompute":
            n = ev.get("recomputes")
            counts.add(n if isinstance(n, int) else ("event", i))
    return len(counts)


def repeated_recompute_events(events: list[dict]) -> int:
    """Recompute events that name a count an earlier one named (the same recompute, flagged
    again by a step already in flight)."""
    recomputes = [ev for ev in events if ev.get("action") == "recompute"]
    return len(recomputes) - recomputes_of(recomputes)


def wrong_kv_spans(inj: dict, rid: str) -> list[list]:
    """[[from, to or None], ...]: the output tokens of ``rid`` computed from wrong KV because of
    the injection (``to``: where a recompute or retraction began computing them again; None:
    never). Logs from before spans were kept name the first token only (``read_at``)."""
    spans = (inj.get("wrong_kv") or {}).get(rid)
    if spans is not None:
        return spans
    at = (inj.get("read_at") or {}).get(rid)
    return [] if at is None else [[at, None]]


def tokens_in_spans(spans: list[list], sent: int) -> int:
    """How many of the first ``sent`` output tokens fall in one of ``spans`` (each counted once)."""
    hit: set[int] = set()
    for lo, hi in spans:
        hit.update(range(lo, sent if hi is None else min(hi, sent)))
    return len(hit)


Output = tuple  # (output token ids, per-token [logprob1, id1, logprob2, id2] or None)


def _first_diff(ref_ids: list[int], ids: list[int], upto: int) -> int | None:
    """The first position below ``upto`` where the two differ (or one of them ends), or None."""
    for n in range(upto):
        if n >= len(ids) or n >= len(ref_ids) or ids[n] != ref_ids[n]:
            return n
    return None


def _tie(ref_top, top, i: int, tie_margin: float, where: dict) -> bool:
    """Both runs undecided at position ``i``, between candidates they share (a two-way tie
    shows the same pair; a three-way tie can show different pairs with a common token)."""
    a = ref_top[i] if ref_top and i < len(ref_top) else None
    b = top[i] if top and i < len(top) else None
    if not (a and b):
        return False
    margins = (a[0] - a[2], b[0] - b[2])
    where["margins"] = [round(m, 4) for m in margins]
    return max(margins) < tie_margin and bool({a[1], a[3]} & {b[1], b[3]})


def compare(ref: Output, got: Output, tie_margin: float = TIE_MARGIN) -> tuple[str, dict]:
    """``clean``, ``near_tie`` or ``escaped``, and where the outputs part."""
    (ref_ids, ref_top), (ids, top) = ref, got
    if ids == ref_ids:
        return "clean", {}
    i = _first_diff(ref_ids, ids, max(len(ids), len(ref_ids)))
    assert i is not None
    where: dict = {"first_diff": i}
    if i < min(len(ids), len(ref_ids)) and _tie(ref_top, top, i, tie_margin, where):
        return "near_tie", where
    return "escaped", where


def compare_stream(
    ref: Output,
    got: Output,
    ref_complete: bool = True,
    rewrites: list | None = None,
    tie_margin: float = TIE_MARGIN,
) -> tuple[str, dict]:
    """The tokens a stream sent its client (``got``: all of them, or those before an abort or
    a drop), against the reference: ``clean`` (each one the reference's at its position),
    ``near_tie`` (the first that differs is a near tie) or ``escaped``. Sent past the end of a
    complete reference is a difference; past a partial one (a clean-pass stream its client
    dropped) is not known. ``rewrites``: [position, token] the stream also sent."""
    (ref_ids, ref_top), (ids, top) = ref, got
    upto = len(ids) if ref_complete else min(len(ids), len(ref_ids))
    i = _first_diff(ref_ids, ids, upto)
    # a position restated with another token: the client was sent that token too
    bad = sorted(p for p, t in rewrites or [] if p < len(ref_ids) and t != ref_ids[p])
    if bad:
        return "escaped", {"first_diff": min(bad) if i is None else min(i, bad[0]), "rewrite": 1}
    if i is None:
        return "clean", {}
    where: dict = {"first_diff": i}
    if i < min(len(ids), len(ref_ids)) and _tie(ref_top, top, i, tie_margin, where):
        return "near_tie", where
    return "escaped", where


def classify(
    reference: dict[str, Output],
    responses: list[Response],
    injections: dict[int, dict],
    violations: dict[str, list[dict]] | dict[str, dict],
    tie_margin: float = TIE_MARGIN,
    partial: dict[str, Output] | None = None,
) -> tuple[list[dict], dict]:
    """Per-request records and per-injection outcomes (the latter updated in ``injections``).
    ``reference``: the clean pass's complete outputs; ``partial``: what the clean pass's streams
    that their client dropped were sent (the reference of the same drop in this pass);
    ``violations``: the guard's events per request (``guard_violations``; one event alone is
    read as a list of one)."""
    victim_of: dict[str, list[int]] = defaultdict(list)
    exposed_to: dict[str, list[int]] = defaultdict(list)
    for inj in injections.values():
        for rid in inj["victims"]:
            victim_of[rid].append(inj["id"])
        for rid in inj.get("exposed", {}):
            exposed_to[rid].append(inj["id"])
    records = []
    for r in responses:
        ids = victim_of.get(r.rid, [])
        ref = reference.get(r.key)  # (output ids, top-2 logprobs) of the clean pass
        guard_abort = r.violation is not None
        evs = violations.get(r.rid) or []
        if isinstance(evs, dict):
            evs = [evs]
        recomputes = recomputes_of(evs)
        first_step = next((ev["step"] for ev in evs if isinstance(ev.get("step"), int)), None)
        # a leak class's victim completed on another tenant's KV, unless the guard recomputed it
        # (from its own KV) before that read: by the step it became that injection's victim
        leaked = any(
            injections[i]["cls"] in LEAK_CLASSES
            and not (
                recomputes
                and first_step is not None
                and first_step <= (injections[i]["victims"].get(r.rid) or 0) + LEAK_HEAL_STEPS
            )
            for i in ids
        )
        where: dict = {}
        # a streamed request: was any token it was sent (before an abort, a drop, or all of
        # them) not the reference's? Then the wrong token reached the client, whatever came next
        stream, swhere = None, {}
        sent = r.stream_ids if r.streamed else None
        sref, complete = (ref, True) if ref is not None else ((partial or {}).get(r.key), False)
        if sent and sref is not None:
            stream, swhere = compare_stream(
                sref, (sent, r.stream_top2), complete, r.stream_rewrites, tie_margin
            )
        stream_error = r.streamed and r.stream_end not in ("done", "dropped") and not guard_abort
        if stream == "escaped":
            outcome, where = "escaped", {**swhere, "streamed_escape": True}
        elif r.client_abort:
            outcome = "client_abort"
        elif guard_abort:
            outcome = (
                "detected" if ids else "collateral" if exposed_to.get(r.rid) else "false_abort"
            )
        elif r.status != 200 or r.output_ids is None or stream_error:
            outcome = "error"
        elif leaked:
            outcome, where = "escaped", {"leak": True}  # another tenant's KV reached it
        elif ref is None:
            outcome = "no_reference"
        else:
            outcome, where = compare(ref, (r.output_ids, r.top2), tie_margin)
            if outcome == "clean" and recomputes:  # healed: recomputed, the reference output
                outcome = (
                    "recomputed"
                    if ids
                    else "recomputed_collateral"
                    if exposed_to.get(r.rid)
                    else "false_recompute"
                )
            elif outcome == "clean" and ids:
                outcome = "exposed"  # read wrong KV bytes, served the reference tokens anyway
        rec = {
            "rid": r.rid,
            "key": r.key,
            "wave": r.wave,
            "outcome": outcome,
            "victim_of": ids,
            "exposed_to": [i for i in exposed_to.get(r.rid, []) if i not in ids],
            "classes": sorted({injections[i]["cls"] for i in ids}),
            "status": r.status,
            "guard_aborted": guard_abort,
            "violation": r.violation,
            "recomputes": recomputes,
            # what the client saw: an error (a guard abort, or any other failure); a request its
            # own client dropped saw none it did not ask for
            "client_error": guard_abort or outcome == "error",
            "latency_s": round(r.latency_s, 3),
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "cached_tokens": r.cached_tokens,
        }
        spans = [sp for i in ids for sp in wrong_kv_spans(injections[i], r.rid)]
        if spans:  # tokens computed from wrong KV that reached the client anyway
            sent_n = len(sent or []) if r.streamed else 0
            if not r.streamed and not guard_abort and r.status == 200:
                sent_n = len(r.output_ids or [])
            rec["wrong_kv_from_token"] = min(lo for lo, _ in spans)
            # tokens computed from wrong KV and dropped by a recompute (or retraction) never
            # left: only those below where it began computing them again count
            rec["tokens_from_wrong_kv"] = tokens_in_spans(spans, sent_n)
            if any(hi is not None for _, hi in spans):
                rec["wrong_kv_spans"] = sorted(spans, key=lambda sp: sp[0])
            reads = [
                x for i in ids for x in (injections[i].get("wrong_reads") or {}).get(r.rid, [])
            ]
            if reads and rec["tokens_from_wrong_kv"]:
                rec["wrong_reads"] = reads[:8]
        restarts = [x for i in ids for x in (injections[i].get("restarts") or {}).get(r.rid, [])]
        if restarts:
            rec["restarts"] = sorted(restarts)
        if r.streamed:
            rec["streamed"] = True
            rec["tokens_sent"] = len(sent or [])
            rec["stream_end"] = r.stream_end
            if r.stream_withdrawn:
                rec["stream_withdrawn"] = r.stream_withdrawn
            if stream == "near_tie":
                rec["stream_near_tie"] = swhere.get("first_diff")
        if outcome in ("escaped", "near_tie"):
            rec.update(where)
        if (outcome in ("error", "false_abort", "collateral") or recomputes) and r.error:
            rec["error"] = r.error[:500]
        if evs:
            rec["guard_step"] = first_step
            rec["guard_kinds"] = sorted({k for e in evs for k in e.get("kinds") or []})
            rec["guard_actions"] = [e.get("action", "abort") for e in evs]
            if repeated_recompute_events(evs):
                rec["repeated_recompute_events"] = repeated_recompute_events(evs)
            why_not = [  # recompute was configured, and the guard aborted it anyway: why
                e["why_not_healed"]
                for e in evs
                if e.get("why_not_healed") and e.get("action", "abort") == "abort"
            ]
            if why_not:  # (action "none": flagged once finished, nothing done to it)
                rec["why_not_healed"] = why_not[-1]
            # did the guard find KV bytes that changed (a digest mismatch), or only a state it
            # distrusts (quarantined page, owner, epoch) over bytes that still verify?
            rec["guard_saw_changed_kv"] = any(
                "digest" in pos.get("why", [])
                for e in evs
                for page in e.get("pages") or []
                for pos in page.get("positions") or []
            )
            lags = [  # from the step the corruption was made to the first flag (the plugin's
                # and the guard's step counters both count forward passes from server start)
                first_step - injections[i]["at_step"]
                for i in ids
                if first_step is not None and injections[i]["at_step"] is not None
            ]
            if lags:
                rec["steps_to_abort"] = min(lags)
            # the guard's account against the client's: an abort it logged that the client
            # never saw, or a request it healed whose client saw an error
            said_abort = any(e.get("action", "abort") == "abort" for e in evs)
            if said_abort and not guard_abort and not r.client_abort:
                rec["guard_abort_unseen"] = True
            if recomputes and rec["client_error"] and not said_abort:
                rec["recompute_then_error"] = True
        if ids or rec["exposed_to"]:
            # the one injection the request is charged to (an escape the guard aborted late: its
            # victim's), so that per-class counts add up to requests
            rec["charged_to"] = _blame(
                r.rid,
                ids or rec["exposed_to"],
                injections,
                "victims" if ids else "exposed",
                rec.get("guard_step"),
            )
            if guard_abort:
                rec["blamed_on"] = rec["charged_to"]
        records.append(rec)

    by_rid = {rec["rid"]: rec for rec in records}
    for inj in injections.values():
        _judge_injection(inj, by_rid)
    return records, injections


def _blame(rid: str, ids: list[int], injections: dict[int, dict], role: str, step) -> int:
    """The one injection an abort is charged to, so that per-class counts add up to requests:
    of those it was a victim of (or only exposed to), the one that reached it last before the
    guard's step (both count forward passes from server start)."""

    def reached(i: int) -> int:
        return injections[i][role].get(rid) or 0

    before = [i for i in ids if not isinstance(step, int) or reached(i) <= step] or ids
    return max(before, key=lambda i: (reached(i), i))


def _judge_injection(inj: dict, by_rid: dict[str, dict]) -> None:
    """An injection's outcome from its victims' outcomes, and the guard's actions (aborts,
    recomputes) and client-visible errors charged to it."""
    victims = [by_rid[v] for v in inj["victims"] if v in by_rid]
    mine = [r for r in by_rid.values() if r.get("charged_to") == inj["id"]]
    aborted = [r for r in mine if r["guard_aborted"]]
    healed = [r for r in mine if r.get("recomputes") and not r["guard_aborted"]]
    inj["victims_aborted"] = sum(1 for r in aborted if r["victim_of"])
    inj["collateral"] = sum(1 for r in aborted if not r["victim_of"])
    inj["aborts"] = inj["victims_aborted"] + inj["collateral"]
    # requests recomputed and not aborted in the end (healed, whatever their output), and the
    # recomputes every request charged to it cost
    inj["victims_recomputed"] = sum(1 for r in healed if r["victim_of"])
    inj["collateral_recomputed"] = sum(1 for r in healed if not r["victim_of"])
    inj["recomputes"] = sum(r.get("recomputes", 0) for r in mine)
    inj["escaped_requests"] = sum(1 for r in mine if r["outcome"] == "escaped")
    inj["client_errors"] = sum(1 for r in mine if r.get("client_error"))
    if inj["status"] != "injected":
        inj["outcome"] = inj["status"]
        return
    seen = Counter(v["outcome"] for v in victims)
    if seen["escaped"]:  # a wrong token reached a client, whether or not an abort followed
        inj["outcome"] = "escaped"
    elif any(v["guard_aborted"] for v in victims):  # a dropped request aborted first counts too
        inj["outcome"] = "detected"
    elif any(v.get("recomputes") for v in victims):  # flagged and healed, none escaped
        inj["outcome"] = "recomputed"
    elif seen["near_tie"]:
        inj["outcome"] = "near_tie"
    elif seen["exposed"]:
        inj["outcome"] = "exposed"
    elif victims:
        inj["outcome"] = "unscored"
    elif (inj.get("detail") or {}).get("refused"):
        inj["outcome"] = "refused"
    elif inj.get("pending"):
        inj["outcome"] = "not_landed"
    else:
        inj["outcome"] = "no_victim"
    inj["victim_outcomes"] = dict(seen)
    lags = [v["steps_to_abort"] for v in victims if "steps_to_abort" in v]
    inj["steps_to_abort"] = min(lags) if lags else None


def canary_flags(log_text: str) -> list[tuple[int, int]]:
    """(slot, position) of every violation SGLang's kv-canary logged."""
    return [(int(m.group(1)), int(m.group(2))) for m in CANARY_LINE.finditer(log_text)]

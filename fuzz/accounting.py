"""Who an injection harmed. Per injection, two sets of request ids:

- **victims**: requests that read, or would read, wrong KV bytes because of it (and the writer
  whose own mapping an injection made wrong);
- **exposed**: requests that only hold a page involved while their own KV stays intact (the new
  owner of a prematurely freed page, the other sharers of a page a bad write aimed at, ...).

A guard abort of a victim is a detection; of a request that is only exposed, a collateral abort.

How: every injection watches some pages, and the tracker keeps, for each watched slot, what the
slot really holds (``Content``): KV a request wrote for itself at one position, or bytes that are
nobody's (a flipped bit, a page never written, a load not landed). Every scheduler step it
follows the batch's writes into watched slots and asks of every live request holding a watched
page: is what each of its positions maps to the KV it computed (or would compute) there? Two KV
rows are the same when their writers had the same token prefix at the same position in the same
prefix-cache namespace: exactly what SGLang's prefix cache relies on. A request reading a page
that sits on the free list would read whatever its next owner writes: a victim already. A victim
that reads wrong KV in a forward writes KV computed from it from then on: those rows are wrong
for anyone who adopts them later (a prefix-cache hit on them), and are followed too.

Tokens from wrong KV: a victim that reads wrong KV in a forward computes that forward's token, and
every later one, from it (``Watch.spans``: from that token on). Until it throws its KV away: a
request whose forward starts below positions it already wrote is prefilled again from its prompt
and the output tokens it kept (kvguard's recompute of a request whose KV it found bad, or SGLang's
retraction), into fresh rows, with fresh reads. The tokens from the kept count on were dropped and
are computed again: its span closes there, and it is no longer poisoned (what it writes from then
on is its own KV; a later read of wrong KV opens a new span).

The plugin runs this inside the scheduler, before and after each forward; nothing here asks the
guard anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvguard.fuzz import kvbytes


# -- what a slot holds -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Written:
    """The KV ``req`` computed for itself at ``pos`` (its tokens are read when compared: under the
    overlap scheduler a decode step's input token is not on the host yet when it is written)."""

    ns: tuple
    pos: int
    req: object
    poisoned: bool = False  # computed while reading wrong KV: wrong for every reader


@dataclass(frozen=True, slots=True)
class Garbage:
    """Bytes that are no request's KV (a flipped bit, a never-written page, a load in flight)."""

    why: str


Content = Written | Garbage
OK, WRONG, FOREIGN = "ok", "wrong", "foreign"  # FOREIGN: the right tokens, another tenant's KV


def namespace(req) -> tuple:
    """SGLang's prefix-cache namespace of a request (its radix key besides the tokens)."""
    return (getattr(req, "extra_key", None), getattr(req, "cache_salt", None) or None)


def written_by(req, pos: int, committed: int | None = None) -> Content:
    """What slot ``pos`` of ``req``'s row holds now: its own KV once written, else garbage."""
    if committed is None:
        committed = req.kv.kv_committed_len
    return Written(namespace(req), pos, req) if pos < committed else Garbage("unwritten")


class Tokens:
    """Token ids of requests (prompt + output so far), built once per step and only when two
    different writers are compared."""

    def __init__(self):
        self._ids: dict[int, list[int]] = {}
        self._common: dict[tuple[int, int], int] = {}

    def of(self, req) -> list[int]:
        ids = self._ids.get(id(req))
        if ids is None:
            ids = self._ids[id(req)] = list(req.origin_input_ids) + list(req.output_ids)
        return ids

    def common(self, a, b) -> tuple[int, int]:
        """(length of the common prefix, length known for both)."""
        key = (id(a), id(b))
        ta, tb = self.of(a), self.of(b)
        if key not in self._common:
            self._common[key] = len(os.path.commonprefix([ta, tb]))
        return self._common[key], min(len(ta), len(tb))


def judge(content: Content, reader, pos: int, tokens: Tokens) -> str:
    """Is ``content`` the KV ``reader`` needs at ``pos``? OK, WRONG, or FOREIGN (the same tokens
    written under another namespace: right bytes, another tenant's cache)."""
    if isinstance(content, Garbage) or content.poisoned or content.pos != pos:
        return WRONG
    if content.req is not reader:
        same, known = tokens.common(content.req, reader)
        if same < min(known, pos + 1):
            return WRONG
    return OK if content.ns == namespace(reader) else FOREIGN


# -- one step as the tracker sees it ----------------------------------------------------------------
@dataclass(slots=True)
class Holder:
    req: object
    rid: str
    in_batch: bool
    committed: int  # positions [0, committed) are written (or written by this forward): read
    slots: list[tuple[int, int]] = field(default_factory=list)  # (watched slot, row position)
    # in the batch: the output token this forward computes (its index in the request's output;
    # 0 for a prefill chunk, whose first token comes later), else None
    computes: int | None = None


def live_requests(sched, batch) -> list:
    """Requests that hold KV now: the batch's, the running batch's, the waiting queue's and a
    chunked prefill between its chunks."""
    seen, out = set(), []
    batch_reqs = list(batch.reqs) if batch is not None else []
    chunked = getattr(sched, "chunked_req", None)
    for req in (
        batch_reqs
        + list(getattr(sched.running_batch, "reqs", []) or [])
        + list(sched.waiting_queue)
        + ([chunked] if chunked is not None else [])
    ):
        if id(req) in seen or not req.kv.holds_kv or req.finished():
            continue
        seen.add(id(req))
        out.append(req)
    return out


def batch_writes(batch) -> list[tuple[object, int, int]]:
    """(request, position, slot) of every KV row this forward writes, from ``out_cache_loc``."""
    if batch is None or batch.out_cache_loc is None or not batch.reqs:
        return []
    slots = batch.out_cache_loc.to(torch.int64).tolist()
    mode = batch.forward_mode
    if mode.is_decode():
        positions = (batch.seq_lens.to(torch.int64) - 1).tolist()
        return list(zip(batch.reqs, positions, slots))
    if not mode.is_extend() or batch.prefix_lens is None or batch.extend_lens is None:
        return []
    out, i = [], 0
    for req, start, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
        out += [(req, start + j, slots[i + j]) for j in range(n)]
        i += n
    return out


def _computes(batch) -> dict[int, int]:
    """id(request) -> index of the output token this forward computes for it: its sequence
    length (positions read, this forward's included) less its prompt (a decode step writing
    position p reads output token p - prompt and computes the next one; a prefill, token 0). A
    prefill again of a request's prompt and the tokens it kept (a recompute, a retraction)
    computes the token after those, whichever chunk of it this is."""
    if batch is None or not batch.reqs:
        return {}
    lens = getattr(batch, "seq_lens_cpu", None)
    if lens is None:
        lens = batch.seq_lens
    if lens is None:
        return {}
    prefills = {id(req) for req, _ in extend_starts(batch).values()}
    return {
        id(req): max(
            0,
            int(n) - len(req.origin_input_ids),
            len(req.output_ids) if id(req) in prefills else 0,
        )
        for req, n in zip(batch.reqs, lens.tolist())
    }


def extend_starts(batch) -> dict[str, tuple[object, int]]:
    """rid -> (request, first position this forward writes), for every request an extend
    forward prefills (a mixed batch's decodes, one token each, left out)."""
    if batch is None or not batch.reqs or batch.prefix_lens is None:
        return {}
    mode = batch.forward_mode
    if not mode.is_extend():
        return {}
    mixed = getattr(mode, "is_mixed", lambda: False)()
    lens = batch.extend_lens if batch.extend_lens is not None else [None] * len(batch.reqs)
    return {
        req.rid: (req, int(start))
        for req, start, n in zip(batch.reqs, batch.prefix_lens, lens)
        if not (mixed and n == 1)
    }


class Scan:
    """One step: which live requests hold which watched slots, what the batch writes, which
    watched pages sit on the free list, and which of this forward's writes landed.

    A write is *contested* when it goes to a slot that another live request reads (maps it below
    its committed length): two rows share it. A write firewall (kvguard's) may refuse such a
    write (it is redirected to the padding slot and the slot keeps its bytes), so whether it
    landed is told by the slot's bytes: snapshotted before the forward, compared after it, once
    per step for every watch alike. So are the writes of a watch's bad writers (``foreign``)."""

    def __init__(self, sched, batch, pages: set[int]):
        self.ps = sched.token_to_kv_pool_allocator.page_size
        self.tokens = Tokens()
        self.writes: list[tuple[object, int, int]] = []
        # rid -> (request, first position an extend forward writes)
        self.starts: dict[str, tuple[object, int]] = {}
        self.holders: list[Holder] = []
        self.by_page: dict[int, list[Holder]] = {}  # watched page -> its live holders
        self.free: set[int] = set()
        self.contested: set[int] = set()  # written slots another live request reads
        self._tracked: list[int] = []  # slots whose landing is told by their bytes
        self._saved: list[torch.Tensor] | None = None
        self._landed: dict[int, bool] | None = None
        if not pages:
            return  # nothing watched: a step costs the plugin nothing more
        self.writes = batch_writes(batch)
        self.starts = extend_starts(batch)
        watched = torch.tensor(sorted(pages), dtype=torch.int64)
        in_batch = {id(r) for r in (batch.reqs if batch is not None else [])}
        computes = _computes(batch)
        table = sched.req_to_token_pool.req_to_token
        written = torch.tensor(sorted({slot for _, _, slot in self.writes}), dtype=torch.int64)
        readers: dict[int, set[int]] = {}  # slot this forward writes -> requests that read it
        for req in live_requests(sched, batch):
            row = table[req.kv.req_pool_idx, : req.kv.kv_allocated_len].to(torch.int64)
            read = row[: req.kv.kv_committed_len]
            for s in read[torch.isin(read, written)].tolist():
                readers.setdefault(s, set()).add(id(req))
            hit = torch.nonzero(torch.isin(row // self.ps, watched)).reshape(-1)
            if hit.numel():
                h = Holder(req, req.rid, id(req) in in_batch, req.kv.kv_committed_len)
                h.computes = computes.get(id(req))
                h.slots = list(zip(row[hit].tolist(), hit.tolist()))
                self.holders.append(h)
                for page in {s // self.ps for s, _ in h.slots}:
                    self.by_page.setdefault(page, []).append(h)
        self.contested = {
            slot for req, _, slot in self.writes if readers.get(slot, set()) - {id(req)}
        }
        alloc = sched.token_to_kv_pool_allocator
        free = alloc.get_all_free_pages() if hasattr(alloc, "get_all_free_pages") else None
        if free is not None and free.numel():
            on_list = torch.isin(watched, free.to(torch.int64).cpu())
            self.free = set(watched[on_list].tolist())

    def track(self, pool, slots) -> None:
        """Tell whether writes to these slots land (their bytes now, compared after the
        forward)."""
        new = [s for s in dict.fromkeys(slots) if s not in self._tracked]
        if new and pool is not None:
            self._tracked += new
            self.snapshot(pool)

    def snapshot(self, pool) -> None:
        """The tracked slots' bytes, as the forward finds them: taken again right before it (an
        injection may write into a slot after a watch asked for it: a stale write landing)."""
        if self._tracked and pool is not None and self._landed is None:
            self._saved = kvbytes.snapshot(pool, torch.tensor(self._tracked, dtype=torch.int64))

    def settle(self, pool) -> None:
        """After the forward, before anything else writes KV (an injection's late load): which
        tracked slots' bytes changed, i.e. which writes landed."""
        if self._landed is not None or self._saved is None:
            return
        slots = torch.tensor(self._tracked, dtype=torch.int64)
        self._landed = dict(zip(self._tracked, kvbytes.changed(pool, slots, self._saved).tolist()))
        self._saved = None

    def landed(self, pool, slot: int) -> bool:
        """Did this forward's write to ``slot`` land? (Untracked slots: yes.)"""
        self.settle(pool)
        return (self._landed or {}).get(slot, True)


# -- one injection's watch ------------------------------------------------------------------------------
SETTLE_STEPS = 48  # an incident stays open this long after its last new victim (or its injection)


class Watch:
    """The pages one injection touched, what their slots hold, and whom it harmed so far.

    Holders of a watched page count as exposed while the incident is open: while one of its
    victims still runs, or within ``SETTLE_STEPS`` of its last new victim. Later holders of a
    page long since reused are nobody's business; late victims (a prefix-cache hit on wrong KV)
    are still found, and reopen it."""

    def __init__(
        self, page_size: int, step: int, contents: dict[int, Content], pages=(), victims=()
    ):
        self.ps = page_size
        self.contents = dict(contents)  # watched slot -> what it holds
        self.pages = {s // page_size for s in self.contents} | set(pages)
        self.victims: dict[str, str] = dict.fromkeys(victims, "writer")  # rid -> why
        # rid -> index of the first output token a victim computed from wrong KV (read in a
        # forward that computes that token): tokens from there on came from wrong bytes
        self.read_at: dict[str, int] = {}
        # rid -> [[first token computed from wrong KV, first token computed again after its KV
        # was thrown away (None: not yet)], ...]: the tokens [from, to) came from wrong bytes
        self.spans: dict[str, list[list]] = {}
        # rid -> [[step, output tokens kept], ...]: prefilled again after reading wrong KV
        self.restarts: dict[str, list[list[int]]] = {}
        # rid -> [[token, slot, position, what the slot held], ...]: the read that opened a span
        self.wrong_reads: dict[str, list[list]] = {}
        self._high: dict[str, int] = {}  # poisoned rid -> positions it has written (0..high-1)
        self.exposed: set[str] = set()
        self.transient: dict[int, Content] = {}  # what this forward's readers see (in flight)
        # rid -> writer whose writes into these pages are bad (a write firewall drops them): the
        # bytes tell whether each landed
        self.foreign: dict[str, object] = {}
        self.poisoned: dict[str, object] = {}  # rid -> request computing from wrong KV
        self.last_event = step
        self.bad_writes = self.bad_writes_landed = 0  # foreign writes: made, and not dropped
        self._running: dict[str, object] = {}  # victims by rid, to tell whether one still runs
        self._checks: list[tuple[int, Content]] = []  # foreign writes: did the bytes change?
        # contested writes of this forward (slot, writer, position): did the bytes change?
        self._contested: list[tuple[int, object, int]] = []
        self._pending: set[int] = set()  # their slots: not judged for this forward's readers yet
        self._in_flight: dict[int, Content] = {}  # ``transient`` of this forward, for after it
        # slot -> step: this step's write there is garbled by the injection itself (a store that
        # never lands, or is changed before its read): it keeps what ``contents`` says
        self.garbled: dict[int, int] = {}
        self._step = step  # the step being judged

    def reopen(self, step: int) -> None:
        self.last_event = step

    def is_open(self, step: int) -> bool:
        if step - self.last_event < SETTLE_STEPS:
            return True
        # a victim sent back to be recomputed holds no KV while it waits for its prefill: the
        # watch stays open until it sees that restart, which closes its span of wrong-KV tokens
        return any(
            not r.finished() and (r.kv.holds_kv or self._span_open(r.rid))
            for r in self._running.values()
        )

    def _span_open(self, rid: str) -> bool:
        spans = self.spans.get(rid)
        return bool(spans) and spans[-1][1] is None

    # before the forward
    def before_forward(self, scan: Scan, pool, step: int) -> bool:
        """Follow this forward's writes into watched slots, then judge every holder. True when
        the victim or exposed set grew (or a victim's tokens from wrong KV changed).

        A write lands before the forward's reads of its slot (each layer writes, then attends),
        so a writer reads its own new row in this very forward. A write that may not land (a bad
        writer's, or a contested one: see ``Scan``) waits for the bytes: applied after the
        forward if it landed, and this forward's readers of its slot are judged then."""
        restarted = self._restarted(scan, step)
        self._step = step
        self._checks, self._contested = [], []
        for req, pos, slot in scan.writes:
            if slot // self.ps not in self.pages or self.garbled.get(slot) == step:
                continue
            content = Written(namespace(req), pos, req, poisoned=req.rid in self.poisoned)
            if req.rid in self.foreign:
                self._checks.append((slot, content))  # lands unless something drops it
            elif slot in scan.contested and pool is not None:
                self._contested.append((slot, req, pos))
            elif not content.poisoned:
                self.contents[slot] = content
        scan.track(pool, [s for s, _ in self._checks] + sorted(scan.contested))
        self._pending = {s for s, _, _ in self._contested}
        grew = self._judge(scan, step)
        self._pending = set()
        # a bad writer that reads wrong KV in this very forward writes wrong KV, if it lands
        self._checks = [
            (s, Written(c.ns, c.pos, c.req, poisoned=True) if c.req.rid in self.poisoned else c)
            for s, c in self._checks
        ]
        self._poison_writes(scan, self._unsure() | scan.contested)
        self._note_written(scan)
        self._in_flight, self.transient = self.transient, {}
        return grew or restarted

    def _unsure(self) -> set[int]:
        """Slots this forward writes whose landing waits for the bytes."""
        return {s for s, _ in self._checks} | {s for s, _, _ in self._contested}

    def _note_written(self, scan: Scan) -> None:
        """How far the requests this watch follows (poisoned ones, bad writers) have written."""
        for req, pos, _ in scan.writes:
            if req.rid in self.poisoned or req.rid in self.foreign:
                self._high[req.rid] = max(self._high.get(req.rid, 0), pos + 1)

    def _restarted(self, scan: Scan, step: int) -> bool:
        """A poisoned request (or a bad writer) prefilled from below the positions it already
        wrote threw its KV away (kvguard's recompute, SGLang's retraction) and computes it again
        from its prompt and the output tokens it kept, into rows it was given afresh: the tokens
        from there on are computed again, from fresh reads, and what it writes is its own KV in
        its own pages. Its span of tokens from wrong KV closes at the kept count."""
        out = False
        for rid, (req, start) in scan.starts.items():
            if start >= self._high.get(rid, 0):
                continue  # followed by nothing here, or the next chunk of the same prefill
            self.poisoned.pop(rid, None)
            self.foreign.pop(rid, None)
            self._high.pop(rid, None)
            kept = len(req.output_ids)
            spans = self.spans.get(rid)
            if spans and spans[-1][1] is None:
                spans[-1][1] = kept
            self.restarts.setdefault(rid, []).append([step, kept])
            out = True
        return out

    def after_forward(self, scan: Scan, pool, step: int) -> bool:
        """Writes that waited for the bytes (bad writers', contested ones) now hold their
        writer's KV if they landed; judge this forward's readers of them again (they read it in
        this very forward, after the write). True when there were bad writes (their count
        changed) or the victims grew."""
        in_flight, self._in_flight = self._in_flight, {}
        poisoned_contested = any(
            req.rid in self.poisoned and slot in scan.contested for req, _, slot in scan.writes
        )
        if not self._checks and not self._contested and not poisoned_contested:
            return False
        # writes that did not land hold nothing (a bad writer's landed ones: applied here)
        unsure = {s for s, _ in self._checks}
        unsure |= {s for s in scan.contested if not scan.landed(pool, s)}
        landed = [scan.landed(pool, slot) for slot, _ in self._checks]
        for (slot, content), hit in zip(self._checks, landed):
            if hit:
                self.contents[slot] = content
        for slot, req, pos in self._contested:
            if scan.landed(pool, slot):
                self.contents[slot] = Written(namespace(req), pos, req)
        self.bad_writes += len(landed)
        self.bad_writes_landed += sum(landed)
        bad = bool(self._checks)
        self._checks, self._contested = [], []
        self.transient = in_flight  # what this forward's readers saw in flight, as before it
        try:
            grew = self._judge(scan, step)
        finally:
            self.transient = {}
        # what a request found reading wrong KV in this forward wrote here is wrong, if it landed
        self._poison_writes(scan, unsure)
        self._note_written(scan)
        return bad or grew

    def _poison_writes(self, scan: Scan, skip: set[int]) -> None:
        """What a request reading wrong KV writes in this forward is wrong for whoever adopts it
        later (a prefix-cache hit on it): watched from now on. Writes whose landing is not known
        yet, or that did not land (``skip``), hold no such KV."""
        for req, pos, slot in scan.writes:
            if req.rid in self.poisoned and slot not in skip:
                self.pages.add(slot // self.ps)
                self.contents[slot] = Written(namespace(req), pos, req, poisoned=True)

    def _judge(self, scan: Scan, step: int) -> bool:
        before = (len(self.victims), len(self.exposed), self._span_count())
        exposing = self.is_open(step)
        mine_of: dict[int, Holder] = {}
        for page in self.pages:
            for h in scan.by_page.get(page, ()):
                mine_of[id(h)] = h
        for h in mine_of.values():
            mine = [(s, p) for s, p in h.slots if s // self.ps in self.pages]
            why = self._harm(h, mine, scan)
            if why is not None:
                if h.rid not in self.victims:
                    self.victims[h.rid] = why
                    self.reopen(step)
                self._running[h.rid] = h.req
            elif exposing:
                self.exposed.add(h.rid)
        return (len(self.victims), len(self.exposed), self._span_count()) != before

    def _span_count(self) -> int:
        return sum(len(s) for s in self.spans.values())

    def _harm(self, h: Holder, mine: list[tuple[int, int]], scan: Scan) -> str | None:
        """Why this holder reads (or will read) wrong KV through a watched page; None if not."""
        why = None
        for slot, pos in mine:
            garbled_now = h.in_batch and self.garbled.get(slot) == self._step
            if pos >= h.committed and not garbled_now:
                continue  # allocated, not written yet: not read
            # (a write of this very forward that the injection garbled: its writer reads it now)
            if h.in_batch and slot in self._pending:
                continue  # what it reads there in this forward is known after it
            if slot // self.ps in scan.free:
                why = why or "page on the free list"  # its next owner overwrites it
            content = (self.transient.get(slot) if h.in_batch else None) or self.contents.get(slot)
            if content is None:
                continue  # what this slot holds is not known: not judged
            verdict = judge(content, h.req, pos, scan.tokens)
            if verdict == WRONG:
                if h.in_batch:
                    self.poisoned.setdefault(h.rid, h.req)  # it reads it in this forward
                    if h.computes is not None:
                        self.read_at.setdefault(h.rid, h.computes)
                        spans = self.spans.setdefault(h.rid, [])
                        if not spans or spans[-1][1] is not None:
                            spans.append([h.computes, None])
                            self._note_read(h, slot, pos, content, scan)
                return "read wrong KV"
            if verdict == FOREIGN:
                why = why or "read another tenant's KV"
        return why

    def _note_read(self, h: Holder, slot: int, pos: int, content: Content, scan: Scan) -> None:
        """Forensics of the read that opened a span: which slot, and what it held."""
        if isinstance(content, Garbage):
            what = f"garbage ({content.why})"
        else:
            writer = getattr(content.req, "rid", "?")
            what = (
                f"poisoned KV of {writer} at {content.pos}"
                if content.poisoned
                else f"KV of {writer} at {content.pos}"
                + ("" if content.pos == pos else " (another position)")
            )
        reads = self.wrong_reads.setdefault(h.rid, [])
        if len(reads) < 4:
            reads.append([h.computes, slot, pos, what])

    @property
    def only_exposed(self) -> list[str]:
        return sorted(self.exposed - set(self.victims))


@dataclass
class Injection:
    """One fault the plugin injected: its class, the step, the watch that follows its pages and
    victims, and the callables the plugin runs around the forward."""

    cls: str
    step: int
    watch: Watch  # the pages it touched, what they hold, whom it harmed
    detail: dict = field(default_factory=dict)
    pending: dict | None = None  # a stale write not landed yet (stale_writer)
    after_forward: object = None  # callable run once after this step's forward
    cleanup: object = None  # callable(sched) -> True once the injected mess is tidied (no leak)
    disarm: object = None  # callable run once after this step's forward, even if it raised

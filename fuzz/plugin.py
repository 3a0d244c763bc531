"""SGLang plugin (entry point ``sglang.srt.plugins: kvguard_fuzz``) that runs fault injectors inside
the scheduler. Inert unless ``KVGUARD_FUZZ_CONTROL`` names a control file; then, before each batch's
forward, it reads new plan entries from that file (only when it changed), injects each one at the
first step where it fits, and follows every injection through later steps (``accounting.Watch``:
its victims and the requests only exposed to it), appending a JSON line to ``KVGUARD_FUZZ_LOG``
per event (``injected``, ``victims``, ``landed``, ``skipped``, ``fired``, ``unfired``,
``injector_error``; and ``read_sets``, how many KV tokens the steps' batches read, every 64 steps).

An injection may act inside the forward (``in_forward_flip``): it wraps the attention backend's
methods as found at that moment and hands back ``disarm``, run right after the forward (even one
that raised); one whose flip never happened is reported ``unfired`` and followed no further.

Entries of class ``guard_fault`` make the guard's own hooks fail instead (``guard_faults``):
they are armed when read, on every rank unless the entry names one. Entries of a prefill/decode
class (``pd_faults.PD_CLASSES``) are armed when read too, and taken by the next transfers the
decode server sets up (its own hook on ``_transfer_page_indices``). An entry of class
``guard_settings`` (``mode``, ``on_violation``) switches the guard when read: a test that shares
one engine between healing and aborting runs.

Control file: ``{"plan": [{"id": 1, "cls": "bit_flip", "seed": 7}, ...]}`` (entries only appended).
"""

from __future__ import annotations

import json
import os
import random

from kvguard.fuzz import guard_faults, pd_faults
from kvguard.fuzz.pd_faults import PD_CLASSES

FUZZ_TARGETS = [
    (
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        "AROUND",
        "inject before the batch's forward; follow whom each injection harms, before and after it",
    ),
    (
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._transfer_page_indices",
        "AROUND",
        "decode server of a PD pair: the destination pages sent to the prefill (pd_faults)",
    ),
]

# Every other SGLang name the fuzz tool reads or calls (a version bump that renames one breaks an
# injector silently: its entries end as injector_error). This table extends the guard's own
# (patches/targets.py SGLANG_NAMES, resolved by tests/test_targets.py): a name listed there is
# not repeated here. Rows as there: (dotted name, kind, fuzz module(s) that use it, why);
# tests/test_fuzz_names.py resolves them.
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
_REQ = "sglang.srt.managers.schedule_batch.Req"
_REQ_KV = "sglang.srt.managers.schedule_batch.ReqKvInfo"
_ALLOC = "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator"
_RADIX = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_KEY = "sglang.srt.mem_cache.radix_cache.RadixKey"
_ATTN = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
# fmt: off
FUZZ_NAMES = [
    (f"{_SCHED}.tp_group", "attribute", "plugin", "a plan entry's tensor-parallel rank"),
    ("sglang.srt.distributed.parallel_state.GroupCoordinator.rank_in_group", "attribute", "plugin", "same"),
    (f"{_BATCH}.forward_mode", "attribute", "accounting", "decode or extend"),
    (f"{_BATCH}.out_cache_loc", "attribute", "accounting", "the slots this forward writes"),
    (f"{_BATCH}.seq_lens", "attribute", "accounting", "decode positions"),
    (f"{_BATCH}.prefix_lens", "attribute", "accounting", "extend: first position written"),
    (f"{_BATCH}.extend_lens", "attribute", "accounting", "extend: tokens written per request"),
    (f"{_REQ}.prefix_len", "attribute", "injectors", "a prefix-cache hit's length"),
    (f"{_REQ_KV}.kv_allocated_len", "attribute", "accounting", "positions its row maps"),
    (f"{_ALLOC}.get_all_free_pages", "callable", "accounting", "pages on the free list"),
    (f"{_ALLOC}.free", "callable", "injectors", "premature free"),
    (f"{_ALLOC}.alloc", "callable", "injectors", "never_written: a page nobody writes"),
    (f"{_RADIX}.match_prefix", "callable", "cross_tenant", "the lookup the injected bug wraps"),
    (f"{_RADIX}.page_size", "attribute", "cross_tenant", "a hit is a page at least"),
    (f"{_KEY}.is_bigram", "attribute", "cross_tenant", "kept as it was"),
    (f"{_KEY}.limit", "attribute", "cross_tenant", "kept as it was"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.attn_backend", "attribute", "injectors", "in_forward_flip wraps its class's methods"),
    (f"{_ATTN}.forward_decode", "callable", "injectors", "in_forward_flip: flips before a decode layer reads"),
    (f"{_ATTN}.forward_extend", "callable", "injectors", "same, for an extend forward"),
    (f"{_BATCH}.seq_lens_cpu", "attribute", "plugin", "KV tokens a step reads (read_sets)"),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue.scheduler", "attribute", "pd_faults", "transfer_into_reused: the running batch"),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue.req_to_token_pool", "attribute", "pd_faults", "the holder's page table row"),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue.token_to_kv_pool_allocator", "attribute", "pd_faults", "page size, the pool"),
    (f"{_ALLOC}.get_kvcache", "callable", "pd_faults", "the pool whose pages a fault leaves unwritten are zeroed"),
    ("sglang.srt.disaggregation.decode.DecodePreallocQueue.transfer_queue", "attribute", "pd_faults", "transfer_wrong_room: transfers in flight"),
    ("sglang.srt.disaggregation.decode.DecodeTransferQueue.queue", "attribute", "pd_faults", "their decode requests"),
    ("sglang.srt.managers.schedule_batch.Req.sampling_params", "attribute", "pd_faults", "max_new_tokens: tokens still to decode"),
]
# fmt: on

_state = None
READ_STATS_EVERY = 64  # steps between two ``read_sets`` log lines


class FuzzState:
    def __init__(self, control: str, log_path: str | None):
        self.control = control
        self.log_path = log_path
        self.mtime = None
        self.seen: set[int] = set()
        self.queue: list[dict] = []
        self.active = []  # injections still being watched (victims, stale writes, cleanups)
        self.pd_armed: list[dict] = []  # PD hand-off faults waiting for a transfer (pd_faults)
        self.step = 0
        self.rank = 0  # tensor-parallel rank, known from the first batch
        # KV tokens read per step (batch seq_lens): steps, largest, steps above 512 / 2048, sum
        self.reads = {"steps": 0, "max": 0, "over_512": 0, "over_2048": 0, "tokens": 0}

    def poll(self):
        try:
            mtime = os.stat(self.control).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self.mtime:
            return
        self.mtime = mtime
        try:
            with open(self.control) as f:
                plan = json.load(f).get("plan", [])
        except (OSError, ValueError):
            self.mtime = None  # partially written: read again next step
            return
        for entry in plan:
            if entry["id"] not in self.seen:
                self.seen.add(entry["id"])
                if entry.get("cls") in PD_CLASSES:
                    self.pd_armed.append(entry)
                    self.log({"event": "armed", **entry})
                elif entry.get("cls") == "guard_fault":
                    if entry.get("rank", self.rank) == self.rank:
                        guard_faults.arm(entry, self.log)
                        self.log({"event": "armed", **entry})
                elif entry.get("cls") == "guard_settings":
                    self.apply_settings(entry)
                else:
                    self.queue.append(entry)

    def apply_settings(self, entry: dict) -> None:
        """A ``guard_settings`` entry: the guard's mode and what a violation does, switched
        before the next step (tests share one engine between healing and aborting runs)."""
        from kvguard.patches import state as guard_state

        guard = guard_state.guard
        if guard is None:
            self.log({"event": "injector_error", "id": entry["id"], "error": "no guard"})
            return
        guard.set_mode(entry.get("mode", guard.config.mode), entry.get("on_violation"))
        self.log({"event": "settings", "id": entry["id"], "mode": guard.config.mode.value,
                  "on_violation": guard.config.on_violation.value})  # fmt: skip

    def note_reads(self, batch):
        """Count the KV tokens this step's batch read (its requests' sequence lengths), and
        every ``READ_STATS_EVERY`` steps log how large read sets were (``read_sets``)."""
        lens = getattr(batch, "seq_lens_cpu", None)
        if lens is None:
            lens = getattr(batch, "seq_lens", None)
        if lens is None:
            return
        try:
            n = int(lens.sum())
        except Exception:
            return
        r = self.reads
        r["steps"] += 1
        r["max"] = max(r["max"], n)
        r["over_512"] += n > 512
        r["over_2048"] += n > 2048
        r["tokens"] += n
        if r["steps"] % READ_STATS_EVERY == 0:
            self.log({"event": "read_sets", "step": self.step, **r})

    def log(self, record: dict):
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(record) + "\n")


def around_run_batch(original, sched, batch, *args, **kwargs):
    from kvguard.fuzz.accounting import Scan
    from kvguard.fuzz.cross_tenant import note_namespaces
    from kvguard.fuzz.injectors import INJECTORS, land_stale_write

    st = _state
    st.step += 1
    st.rank = sched.tp_group.rank_in_group
    try:
        st.poll()
    except Exception as exc:
        st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
    pool = sched.tp_worker.model_runner.token_to_kv_pool
    after, scan, events, new = [], None, [], None
    try:
        note_namespaces(batch)
        for inj in st.active:
            if inj.cleanup is not None and inj.cleanup(sched):
                inj.cleanup = None
        new = _inject(st, sched, batch, INJECTORS)
        if new is not None and new.after_forward is not None:
            after.append(new.after_forward)
        scan = Scan(sched, batch, set().union(*(inj.watch.pages for inj in st.active)))
        for inj in st.active:  # follow every injection still watched through this step
            landed = inj.pending is not None and land_stale_write(sched, scan, inj, st.step)
            grew = inj.watch.before_forward(scan, pool, st.step)
            if inj is new:
                events.append((inj, "injected"))
            elif landed:
                events.append((inj, "landed"))
            elif grew:
                events.append((inj, "victims"))
    except Exception as exc:  # an injector bug is reported, never turned into a scheduler crash
        st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
    if new is not None and all(inj is not new for inj, _ in events):
        events.append((new, "injected"))  # made, even if following it failed
    for inj, kind in events:
        _record(st, inj, kind)
    if scan is not None:
        try:
            scan.snapshot(
                pool
            )  # the bytes of slots whose writes may not land, as the forward finds them
        except Exception as exc:
            st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
    try:
        out = original(sched, batch, *args, **kwargs)
    finally:
        if new is not None and new.disarm is not None:  # an in-forward injection's wrapper
            try:
                new.disarm()
            except Exception as exc:
                st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
    st.note_reads(batch)
    try:
        if scan is not None:
            scan.settle(pool)  # which of them landed: before a late load writes KV (``after``)
        if new is not None and new.detail.get("fired") is False:  # its layer never ran
            st.active.remove(new)
            st.log(
                {
                    "event": "unfired",
                    "id": new.detail.get("id"),
                    "cls": new.cls,
                    "at_step": st.step,
                    "detail": new.detail,
                }
            )
        elif new is not None and new.detail.get("fired"):
            _record(st, new, "fired")  # what the flip did, now that it happened
        for fn in after:
            fn()
        if scan is not None:
            for inj in st.active:
                if inj.watch.after_forward(scan, pool, st.step):
                    _record(st, inj, "victims")
    except Exception as exc:
        st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
    _retire(st)
    return out


MAX_WATCHED = 64  # injections followed each step, beyond those whose incident is still open


def _retire(st: FuzzState) -> None:
    """Stop following the oldest injections past ``MAX_WATCHED``, but only settled ones: a watch
    dropped while a victim still waits for its recompute would never see the restart that
    closes its span of tokens from wrong KV (they would all count as sent)."""
    old = len(st.active) - MAX_WATCHED
    if old > 0:
        st.active[:] = [
            inj for i, inj in enumerate(st.active) if i >= old or inj.watch.is_open(st.step)
        ]


def _inject(st: FuzzState, sched, batch, injectors):
    """Try the queue's head entry at this step; the new injection, or None. An entry whose class
    this pool cannot take (``injectors.refusal``: index-key classes on a pool without index keys)
    is dropped and logged as an ``injector_error`` naming it."""
    from kvguard.fuzz.injectors import known_from, refusal

    rank = sched.tp_group.rank_in_group
    while st.queue and st.queue[0].get("rank", rank) != rank:
        st.queue.pop(0)  # meant for another tensor-parallel rank's KV (e.g. one GPU's bit flip)
    if not st.queue or batch is None:
        return None
    entry = st.queue[0]
    why = refusal(entry["cls"], sched.tp_worker.model_runner.token_to_kv_pool)
    if why is not None:  # a class for another pool kind: dropped, with the reason
        st.queue.pop(0)
        st.log({"event": "injector_error", "id": entry["id"], "cls": entry["cls"],
                "step": st.step, "error": why})  # fmt: skip
        return None
    entry.setdefault("tries", 0)
    entry["tries"] += 1
    rng = random.Random(entry.get("seed", 0) * 1_000_003 + st.step)
    fn = injectors[entry["cls"]]
    known_from(i.watch for i in st.active)  # what earlier injections' watches know of slots
    try:
        inj = fn(sched, batch, rng, st.step)
    finally:
        known_from(())
    if inj is None:
        if entry["tries"] >= entry.get("max_tries", 400):
            st.queue.pop(0)  # the workload never offered a fitting moment
            if hasattr(fn, "disarm"):
                fn.disarm(sched)
            st.log({"event": "skipped", "id": entry["id"], "cls": entry["cls"], "step": st.step})
        return None
    st.queue.pop(0)
    inj.detail["id"] = entry["id"]
    st.active.append(inj)
    return inj


def _record(st, inj, event):
    w = inj.watch
    st.log(
        {
            "event": event,
            "id": inj.detail.get("id"),
            "cls": inj.cls,
            "step": inj.step,
            "at_step": st.step,
            "victims": sorted(w.victims),
            "why": w.victims,  # rid -> how it was harmed (read wrong KV, page on the free list, ...)
            "exposed": w.only_exposed,  # held a page involved, own KV intact
            "read_at": w.read_at,  # rid -> first output token computed from wrong KV
            # rid -> [[from, to or None], ...]: output tokens computed from wrong KV, [from, to):
            # to is where a restart (recompute, retraction) began computing them again
            "wrong_kv": w.spans,
            "restarts": w.restarts,  # rid -> [[step, output tokens kept], ...]
            "wrong_reads": w.wrong_reads,  # rid -> the reads that opened its spans
            "detail": inj.detail,
            "pending": inj.pending is not None,  # a stale write not landed yet
            "bad_writes": [w.bad_writes_landed, w.bad_writes],  # landed, made (shared_write)
        }
    )


def load() -> None:
    global _state
    control = os.environ.get("KVGUARD_FUZZ_CONTROL")
    if not control or _state is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _state = FuzzState(control, os.environ.get("KVGUARD_FUZZ_LOG"))
    hooks = {"run_batch": around_run_batch, "_transfer_page_indices": around_transfer_page_indices}
    for target, hook_type, _why in FUZZ_TARGETS:
        HookRegistry.register(target, hooks[target.rsplit(".", 1)[1]], HookType[hook_type])


def around_transfer_page_indices(original, queue, decode_req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._transfer_page_indices``: the PD hand-off faults
    (``pd_faults``), given this process's plan."""
    return pd_faults.fault_transfer(_state, original, queue, decode_req, *args, **kwargs)

"""SGLang plugin (entry point ``sglang.srt.plugins: kvguard_fuzz``) that runs fault injectors inside
the scheduler. Inert unless ``KVGUARD_FUZZ_CONTROL`` names a control file; then, before each batch's
forward, it reads new plan entries from that file (only when it changed), injects each one at the
first step where it fits, and follows every injection through later steps (``accounting.Watch``:
its victims and the requests only exposed to it), appending a JSON line to ``KVGUARD_FUZZ_LOG``
per event (``injected``, ``victims``, ``landed``, ``skipped``, ``injector_error``).

Control file: ``{"plan": [{"id": 1, "cls": "bit_flip", "seed": 7}, ...]}`` (entries only appended).
"""

from __future__ import annotations

import json
import os
import random

FUZZ_TARGETS = [
    (
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        "AROUND",
        "inject before the batch's forward; follow whom each injection harms, before and after it",
    ),
]

_state = None


class FuzzState:
    def __init__(self, control: str, log_path: str | None):
        self.control = control
        self.log_path = log_path
        self.mtime = None
        self.seen: set[int] = set()
        self.queue: list[dict] = []
        self.active = []  # injections still being watched (victims, stale writes, cleanups)
        self.step = 0

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
                self.queue.append(entry)

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
    st.poll()
    pool = sched.tp_worker.model_runner.token_to_kv_pool
    after, scan, events = [], None, []
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
    for inj, kind in events:
        _record(st, inj, kind)
    out = original(sched, batch, *args, **kwargs)
    try:
        for fn in after:
            fn()
        if scan is not None:
            for inj in st.active:
                if inj.watch.after_forward(scan, pool, st.step):
                    _record(st, inj, "victims")
    except Exception as exc:
        st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
    del st.active[:-64]
    return out


def _inject(st: FuzzState, sched, batch, injectors):
    """Try the queue's head entry at this step; the new injection, or None."""
    rank = sched.tp_group.rank_in_group
    while st.queue and st.queue[0].get("rank", rank) != rank:
        st.queue.pop(0)  # meant for another tensor-parallel rank's KV (e.g. one GPU's bit flip)
    if not st.queue or batch is None:
        return None
    entry = st.queue[0]
    entry.setdefault("tries", 0)
    entry["tries"] += 1
    rng = random.Random(entry.get("seed", 0) * 1_000_003 + st.step)
    fn = injectors[entry["cls"]]
    inj = fn(sched, batch, rng, st.step)
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
    for target, hook_type, _why in FUZZ_TARGETS:
        HookRegistry.register(target, around_run_batch, HookType[hook_type])

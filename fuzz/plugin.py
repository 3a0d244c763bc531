"""SGLang plugin (entry point ``sglang.srt.plugins: kvguard_fuzz``) that runs fault injectors inside
the scheduler. Inert unless ``KVGUARD_FUZZ_CONTROL`` names a control file; then, before each batch's
forward, it reads new plan entries from that file (only when it changed) and injects each one at the
first step where it fits, appending a JSON line per injection to ``KVGUARD_FUZZ_LOG``.

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
        "inject before the batch's forward, land delayed writes after it",
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
    from kvguard.fuzz.injectors import INJECTORS, holders, land_stale_write

    st = _state
    st.step += 1
    st.poll()
    after = []
    try:
        for inj in list(st.active):  # follow earlier injections
            if "pending" in inj.detail and "landed_on" not in inj.detail:
                if land_stale_write(sched, batch, inj):
                    _record(st, inj, "landed")
            if inj.watch_slots is not None:
                new = holders(sched, batch, inj.watch_slots) - inj.victims
                if new:
                    inj.victims |= new
                    _record(st, inj, "victims")
            if inj.cleanup is not None and inj.cleanup(sched):
                inj.cleanup = None
        rank = sched.tp_group.rank_in_group
        while st.queue and st.queue[0].get("rank", rank) != rank:
            st.queue.pop(0)  # meant for another tensor-parallel rank's KV (e.g. one GPU's bit flip)
        if st.queue and batch is not None:
            entry = st.queue[0]
            entry.setdefault("tries", 0)
            entry["tries"] += 1
            rng = random.Random(entry.get("seed", 0) * 1_000_003 + st.step)
            inj = INJECTORS[entry["cls"]](sched, batch, rng, st.step)
            if inj is None and entry["tries"] >= entry.get("max_tries", 400):
                st.queue.pop(0)  # the workload never offered a fitting moment
                st.log(
                    {"event": "skipped", "id": entry["id"], "cls": entry["cls"], "step": st.step}
                )
            if inj is not None:
                st.queue.pop(0)
                inj.detail["id"] = entry["id"]
                st.active.append(inj)
                _record(st, inj, "injected")
                if inj.after_forward is not None:
                    after.append(inj.after_forward)
    except Exception as exc:  # an injector bug is reported, never turned into a scheduler crash
        st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
    out = original(sched, batch, *args, **kwargs)
    for fn in after:
        fn()
    del st.active[:-64]
    return out


def _record(st, inj, event):
    pending = inj.detail.get("pending")
    detail = {k: v for k, v in inj.detail.items() if k != "pending"}
    if pending is not None:
        detail["stale_from"] = pending["from"]
    st.log(
        {
            "event": event,
            "id": inj.detail.get("id"),
            "cls": inj.cls,
            "step": inj.step,
            "at_step": st.step,
            "victims": sorted(inj.victims),
            "detail": detail,
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

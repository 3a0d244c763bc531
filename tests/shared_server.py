"""The session's shared ``kvguard-serve``: one server on the embedded default model for every test
whose arguments agree (HTTP routes, the OpenAI SDK, tenant namespaces, a fault storm), instead of
one start per module (~30 s each on two cores).

Its arguments are the union those tests need: page size 16, a 16,384-token pool, the default
mode (``verified``, healing by recompute), tenant isolation with SGLang's cache report, a plain
chat template (the default model has none), kvguard's JSON log, a quarantine cap of 0.25 (a storm
stays under it) and the fault-injection plugin armed with an empty plan. A test that injects
faults appends to the one plan (ids are unique for the server's life) and must leave the server
healthy and idle; a test that stops the server is marked ``stops_shared_server`` and runs last
(``conftest.py``). A server that died is started again, with a fresh empty plan."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tiny_model import serving_model

from kvguard.serve.child import ServeProcess, ServerDied

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
PAGE_SIZE = 16


class SharedServer:
    def __init__(self, root: Path):
        self.root = root
        self.model, self.is_default = serving_model()
        self.template = root / "plain.jinja"
        self.template.write_text(CHAT_TEMPLATE)
        self.srv: ServeProcess | None = None
        self.starts = 0
        self.failed: str | None = None

    # -- the live server ------------------------------------------------------------------------
    def get(self) -> ServeProcess:
        """The running server, started on first use and again if an earlier test stopped it."""
        if self.failed:
            pytest.fail(self.failed)
        if self.srv is None or not self.srv.running():
            self._start()
        assert self.srv is not None
        return self.srv

    def _start(self) -> None:
        self.starts += 1
        work = self.root / f"server-{self.starts}"
        work.mkdir()
        self.control, self.fuzz_log = work / "control.json", work / "fuzz.jsonl"
        self.plan: list[dict] = []
        self._write_plan()
        args = [
            "--page-size",
            str(PAGE_SIZE),
            "--max-total-tokens",
            "16384",
            "--kvguard-quarantine-cap",
            "0.25",
            "--kvguard-tenant-isolation",
            "--enable-cache-report",
            "--chat-template",
            str(self.template),
            "--log-format",
            "json",
            "--sleep-on-idle",  # an idle scheduler would spin a core the other tests need
        ]
        if not self.is_default:  # the default model is what kvguard-serve starts without it
            args += ["--model-path", str(self.model)]
        env = {"KVGUARD_FUZZ_CONTROL": str(self.control), "KVGUARD_FUZZ_LOG": str(self.fuzz_log)}
        self.srv = ServeProcess(args, work / "server.log", env)
        try:
            self.srv.start()
        except ServerDied as exc:
            self.failed = f"the shared kvguard-serve did not start: {exc}"
            pytest.fail(self.failed)

    def stop(self) -> None:
        if self.srv is not None:
            self.srv.stop(drain=False)

    # -- fault injection ------------------------------------------------------------------------
    def inject(self, entries: list[dict]) -> list[int]:
        """Append ``entries`` (without ids) to the server's plan; returns the ids given them."""
        first = len(self.plan) + 1
        ids = list(range(first, first + len(entries)))
        self.plan += [{**e, "id": i} for e, i in zip(entries, ids)]
        self._write_plan()
        return ids

    def fuzz_events(self, ids: list[int]) -> list[dict]:
        """The injector's log records of plan entries ``ids``."""
        if not self.fuzz_log.exists():
            return []
        wanted = set(ids)
        records = [json.loads(x) for x in self.fuzz_log.read_text().splitlines()]
        return [r for r in records if r.get("id") in wanted]

    def _write_plan(self) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"plan": self.plan}))
        os.replace(tmp, self.control)  # the plugin never reads a half-written file

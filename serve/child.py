"""``kvguard-serve`` as a child process, the one helper tests, benchmarks and fault-injection
campaigns start servers with: its command line in this environment, a free local port, a clean
environment, and :class:`ServeProcess` (start, wait until healthy, probe, stop the whole tree)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import requests

START_TIMEOUT_S = 300  # ~60 s on a loaded 2-core machine (SGLang's tokenizer start dominates)
# Settings a caller may have exported that must not leak into a server it starts.
_INHERITED_SETTINGS = ("KVGUARD_", "PROMETHEUS_MULTIPROC_DIR", "SGLANG_PLUGINS")


class ServerDied(RuntimeError):
    """kvguard-serve exited, or stopped answering /health."""


def kvguard_serve_command() -> list[str]:
    script = Path(sys.executable).with_name("kvguard-serve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvguard.serve.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def clean_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without kvguard/SGLang settings."""
    environ = dict(os.environ) if environ is None else environ
    return {k: v for k, v in environ.items() if not k.startswith(_INHERITED_SETTINGS)}


def stop_process_tree(
    proc: subprocess.Popen[bytes], sig: int | None, timeout_s: float = 90
) -> int | None:
    """Stop ``proc`` and every process under it: ``sig`` to ``proc`` and up to ``timeout_s`` for
    it to exit, or with ``sig`` None SIGKILL to the whole tree at once; whatever is left of the
    tree is killed afterwards. The one teardown of the servers and routers kvguard starts."""
    children: list[psutil.Process] = []
    if proc.poll() is None:
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(proc.pid).children(recursive=True)
        if sig is None:
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            proc.kill()
        else:
            proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    _, alive = psutil.wait_procs(children, timeout=20)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    return proc.returncode


class ServeProcess:
    """One ``kvguard-serve`` on 127.0.0.1 and a free port; ``args`` are the server's other
    arguments, its stdout and stderr go to ``log`` (appended), ``env`` is added to a clean copy
    of this process's environment."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.extra_args = list(args)
        self.log = Path(log)
        self.env = {**clean_env(), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._pick_port()

    def _pick_port(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = kvguard_serve_command() + [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra_args,
        ]

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = START_TIMEOUT_S, port_retries: int = 3) -> None:
        """Start and wait until ``/health`` answers. Raises :class:`ServerDied` (with the log's
        tail) if the server exits or is not healthy in time. If another process took the free
        port between picking and binding it, a new port is picked (``port_retries`` times)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        log_start = self.log_size()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
                new_output = self.log_tail(self.log_size() - log_start)
                if port_retries and "in use" in new_output and str(self.port) in new_output:
                    self._pick_port()
                    return self.start(timeout_s, port_retries - 1)
                raise ServerDied(
                    f"kvguard-serve exited with {self.proc.returncode} during start-up:\n"
                    + self.log_tail()
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerDied(
                    f"kvguard-serve not healthy after {timeout_s:.0f} s:\n" + self.log_tail()
                )
            time.sleep(1)

    def stop(self, timeout_s: float = 90, drain: bool = True) -> int | None:
        """SIGTERM: SGLang drains the requests in flight first (~10 s even when idle). With
        ``drain=False`` (a test's or a finished campaign's teardown: nothing in flight matters)
        the whole tree is killed at once: SIGINT's orderly exit took 4-6 s per server, measured.
        Returns the exit code (None if it was never started)."""
        if self.proc is None:
            return None
        return stop_process_tree(self.proc, signal.SIGTERM if drain else None, timeout_s)

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- probes ---------------------------------------------------------------------------------
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = 20) -> bool:
        if not self.running():
            return False
        try:
            return requests.get(f"{self.url}/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def loads(self) -> dict[str, Any]:
        """SGLang's live scheduler load (``/v1/loads``): running/waiting requests, KV tokens."""
        body = requests.get(
            f"{self.url}/v1/loads", params={"include": "core,queues"}, timeout=30
        ).json()
        load: dict[str, Any] = body["loads"][0]
        return load

    def wait_idle(self, timeout_s: float = 120) -> dict[str, Any]:
        """Wait until no request runs or waits; return the idle load (``num_used_tokens`` is the
        KV held by nothing evictable: with no request left, a leak or a guard quarantine)."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = self.loads()
            if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
                time.sleep(0.5)  # the scheduler's idle pass (leak check, guard flush) runs now
                return self.loads()
            if time.monotonic() > deadline:
                return load
            time.sleep(0.5)

    def flush_cache(self) -> bool:
        return requests.post(f"{self.url}/flush_cache", timeout=60).status_code == 200

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples without labels (kvguard_* counters, ...)."""
        return {name: value for name, value in self._samples() if "{" not in name}

    def metric_totals(self) -> dict[str, float]:
        """Every ``/metrics`` series summed over its labels, by metric name."""
        out: dict[str, float] = {}
        for name, value in self._samples():
            base = name.split("{", 1)[0]
            out[base] = out.get(base, 0.0) + value
        return out

    def _samples(self) -> list[tuple[str, float]]:
        out = []
        for line in requests.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out.append((name, float(value)))
        return out

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def log_tail(self, n: int = 4000) -> str:
        if n <= 0 or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-n:]

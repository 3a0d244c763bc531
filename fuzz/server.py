"""One ``kvguard-serve`` subprocess for a campaign configuration: start, wait until healthy,
probe (health, idle KV usage, metrics), stop. The same start-and-wait logic as
tests/test_serve_http.py, usable outside pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import requests

from kvguard.serve.child import free_port, kvguard_serve_command

START_TIMEOUT_S = 300  # ~60 s on a loaded 2-core machine (SGLang's tokenizer start dominates)


class ServerDied(RuntimeError):
    """kvguard-serve exited, or stopped answering /health."""


def clean_env() -> dict[str, str]:
    """This process's environment without kvguard/SGLang settings a caller may have exported."""
    drop = ("KVGUARD_", "PROMETHEUS_MULTIPROC_DIR", "SGLANG_PLUGINS")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


class ServeProcess:
    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.args = (
            kvguard_serve_command() + ["--host", "127.0.0.1", "--port", str(self.port)] + args
        )
        self.env = {**clean_env(), **(env or {})}
        self.proc: subprocess.Popen | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, env=self.env
            )
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
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

    def stop(self, timeout_s: float = 90) -> int | None:
        """SIGTERM, then SIGKILL for whatever is left of the process tree. Returns the exit code."""
        if self.proc is None:
            return None
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        _, alive = psutil.wait_procs(children, timeout=20)
        for p in alive:
            p.kill()
        return self.proc.returncode

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

    def loads(self) -> dict:
        """SGLang's live scheduler load (``/v1/loads``): running/waiting requests, KV tokens."""
        body = requests.get(
            f"{self.url}/v1/loads", params={"include": "core,queues"}, timeout=30
        ).json()
        return body["loads"][0]

    def wait_idle(self, timeout_s: float = 120) -> dict:
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
        out = {}
        for line in requests.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

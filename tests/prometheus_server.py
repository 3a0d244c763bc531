"""A real Prometheus server for tests: the binaries of Debian's ``prometheus`` package (which
``scripts/setup.sh`` installs when run as root), on 127.0.0.1 and a free port, with its storage
in a temp dir, scraping the given targets and evaluating the given rule files every second."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import requests

from kvguard.serve.child import free_port

T = TypeVar("T")
START_TIMEOUT_S = 60


def binary(name: str) -> str:
    """The path of ``promtool`` or ``prometheus``. Missing: a skip on a developer's machine, a
    failure in CI (``CI=true``), where ``scripts/setup.sh`` installs them."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} not found (Debian: apt-get install prometheus; scripts/setup.sh as root)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message)
    pytest.skip(message)


class PrometheusServer:
    def __init__(self, workdir: Path, targets: list[str], rule_files: list[Path]) -> None:
        self.workdir = Path(workdir)
        self.targets, self.rule_files = targets, rule_files
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def config(self) -> str:
        rules = "".join(f"\n  - {p.resolve()}" for p in self.rule_files)
        targets = ", ".join(f"'{t}'" for t in self.targets)
        return (
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
            f"rule_files:{rules}\n"
            "scrape_configs:\n  - job_name: kvguard\n"
            f"    static_configs:\n      - targets: [{targets}]\n"
        )

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(self.config())
        args = [
            binary("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        self.wait_for(self._ready, START_TIMEOUT_S, "Prometheus ready")

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return requests.get(f"{self.url}/-/ready", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    # -- HTTP API -------------------------------------------------------------------------------
    def api(self, path: str, **params: str) -> Any:
        """``/api/v1/<path>``'s data; an error answer raises with Prometheus's message."""
        body = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        if body.get("status") != "success":
            raise AssertionError(f"/api/v1/{path} {params}: {body.get('error', body)}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (the samples of a vector), or an error with its message."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        result: list[dict[str, Any]] = data["result"]
        return result

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def wait_for(self, probe: Callable[[], T], timeout_s: float, what: str) -> T:
        """``probe()``'s first truthy value, polled every half second."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {what} after {timeout_s:.0f} s; Prometheus log:\n{self.log_tail()}"
                )
            time.sleep(0.5)

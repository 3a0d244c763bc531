"""A prefill/decode pair on one machine: SGLang's router (``sglang-router``, ``--pd-disaggregation``)
in front of a ``kvguard-serve --disaggregation-mode prefill`` and a ``--disaggregation-mode
decode`` server (docs/pd.md). The servers are :class:`kvguard.serve.child.ServeProcess`; this
module adds their PD arguments, the router process and :class:`PrefillDecodePair`, the one
pair starter the tests, the PD fault campaign and the PD benchmark share.

:func:`pd_server_args` starts each server guarded, in kvguard-serve's default mode unless given
another (docs/pd.md: what the guard checks on each side of a pair).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import requests

from kvguard.serve.child import ServeProcess, ServerDied, clean_env, free_port, stop_process_tree

ROUTER_START_TIMEOUT_S = 180
PAIR_START_TIMEOUT_S = 600  # two servers load side by side: far more than one on a busy machine


def pd_server_args(
    mode: str, bootstrap_port: int | None = None, kvguard_mode: str | None = None
) -> list[str]:
    """``kvguard-serve`` arguments of a prefill (``bootstrap_port``: where decode servers fetch
    its KV from) or a decode server, in guard mode ``kvguard_mode`` (None: kvguard-serve's
    default, ``verified``). The transfer backend is SGLang's default, mooncake."""
    args = [] if kvguard_mode is None else ["--kvguard-mode", kvguard_mode]
    args += ["--disaggregation-mode", mode]
    if mode == "prefill":
        assert bootstrap_port is not None, "a prefill server needs its bootstrap port"
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return args


class RouterProcess:
    """``python -m sglang_router.launch_router --pd-disaggregation`` on 127.0.0.1 and a free port,
    for one prefill (``prefill_url``, its ``bootstrap_port``) and one decode server."""

    def __init__(self, prefill_url: str, bootstrap_port: int, decode_url: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self.args = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            prefill_url,
            str(bootstrap_port),
            "--decode",
            decode_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = ROUTER_START_TIMEOUT_S) -> None:
        """Start and wait until the router reports both workers healthy (``/readiness``)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, env=clean_env()
            )
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ServerDied(f"sglang-router did not become ready:\n{self.log_tail()}")
            time.sleep(1)

    def ready(self) -> bool:
        try:
            r = requests.get(f"{self.url}/readiness", timeout=5)
        except requests.RequestException:
            return False
        return r.status_code == 200 and r.json().get("healthy_workers") == 2

    def stop(self, timeout_s: float = 30) -> None:
        if self.proc is not None:
            stop_process_tree(self.proc, signal.SIGTERM, timeout_s)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def __enter__(self) -> RouterProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class PrefillDecodePair:
    """A prefill and a decode ``kvguard-serve`` on loopback, in guard mode ``mode`` (None:
    kvguard-serve's default) with ``args`` on both, logs in ``work``; ``env`` is added to both
    servers' environment, ``prefill_env`` / ``decode_env`` to one; with ``router``, SGLang's
    router in front once both are up. ``tag`` goes into the log names."""

    def __init__(
        self,
        work: Path,
        mode: str | None,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        prefill_env: dict[str, str] | None = None,
        decode_env: dict[str, str] | None = None,
        router: bool = True,
        tag: str = "",
    ):
        self.bootstrap_port = free_port()
        self.prefill = ServeProcess(
            pd_server_args("prefill", self.bootstrap_port, mode) + args,
            work / f"prefill{tag}.log",
            {**(env or {}), **(prefill_env or {})},
        )
        self.decode = ServeProcess(
            pd_server_args("decode", None, mode) + args,
            work / f"decode{tag}.log",
            {**(env or {}), **(decode_env or {})},
        )
        self.servers: tuple[ServeProcess, ...] = (self.prefill, self.decode)
        self.router = (
            RouterProcess(
                self.prefill.url, self.bootstrap_port, self.decode.url, work / f"router{tag}.log"
            )
            if router
            else None
        )

    def start(self, timeout_s: float = PAIR_START_TIMEOUT_S) -> None:
        """Start the servers side by side, then the router; on any failure stop what started
        and raise :class:`ServerDied`."""
        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:
                for started in [pool.submit(s.start, timeout_s) for s in self.servers]:
                    started.result()
            if self.router is not None:
                self.router.start()
        except BaseException:
            self.stop()
            raise

    def stop(self, drain: bool = False) -> None:
        """Router, then the servers (``drain``: SGLang's request drain; default: killed at once,
        the pair's work being done)."""
        if self.router is not None:
            self.router.stop()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda s: s.stop(drain=drain), self.servers))

    def alive(self) -> bool:
        return all(srv.running() and srv.healthy() for srv in self.servers)

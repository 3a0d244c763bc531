"""Running ``kvguard-serve`` as a child process (benchmarks, fault-injection campaigns, tests):
its command line in this environment and a free local port."""

from __future__ import annotations

import socket
import sys
from pathlib import Path


def kvguard_serve_command() -> list[str]:
    script = Path(sys.executable).with_name("kvguard-serve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvguard.serve.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""The guard's health at the server's front door.

The guard runs in the scheduler processes; ``/health`` and the generation routes are served by
the HTTP process. Each scheduler publishes its guard's health as a small file in a directory the
HTTP process creates before it starts them (``KVGUARD_STATE_DIR``, inherited); a middleware in the
HTTP process answers ``/health`` with 503 while any guard failed closed, so a router drains the
server, and refuses new generation requests with a clear error, while the requests already running
finish under the guard."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

ENV_STATE_DIR = "KVGUARD_STATE_DIR"
HEALTH_PATHS = ("/health", "/health_generate")
# New work: refused while the guard cannot vouch for it.
GENERATION_PATHS = (
    "/generate",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/encode",
)
_READ_EVERY_S = 0.25


def ensure_state_dir() -> Path:
    """The directory this server's schedulers publish into (created once per server)."""
    path = os.environ.get(ENV_STATE_DIR)
    if not path:
        path = tempfile.mkdtemp(prefix="kvguard-state-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ[ENV_STATE_DIR] = path
    return Path(path)


def publish(reason: str | None) -> None:
    """This scheduler's guard health (None: healthy), written atomically."""
    path = os.environ.get(ENV_STATE_DIR)
    if not path:
        return
    out = Path(path) / f"health-{os.getpid()}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "healthy": reason is None, "reason": reason}))
    os.replace(tmp, out)


class HealthBoard:
    """What the HTTP process knows of its schedulers' guards (files re-read at most every
    0.25 s: a health probe or a request burst costs no file reads)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._read_at = 0.0
        self._reason: str | None = None

    def reason(self) -> str | None:
        now = time.monotonic()
        if now - self._read_at >= _READ_EVERY_S:
            self._read_at = now
            self._reason = None
            for f in sorted(self.directory.glob("health-*.json")):
                try:
                    state = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                if not state.get("healthy", True):
                    self._reason = str(state.get("reason"))
                    break
        return self._reason


class FailClosedMiddleware:
    """ASGI middleware: 503 on health probes and new generation requests while a guard failed
    closed; everything else (metrics, server info, aborts, running streams) passes."""

    def __init__(self, app, board: HealthBoard) -> None:
        self.app, self.board = app, board

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http":
            path = scope.get("path", "")
            if path in HEALTH_PATHS or path in GENERATION_PATHS:
                reason = self.board.reason()
                if reason is not None:
                    await _refuse(send, path in HEALTH_PATHS, reason)
                    return
        await self.app(scope, receive, send)


async def _refuse(send, probe: bool, reason: str) -> None:
    body = json.dumps(
        {"kvguard": {"healthy": False, "reason": reason}}
        if probe
        else {
            "error": {
                "message": f"server not accepting requests: {reason}",
                "type": "KVGuardFailedClosed",
                "code": 503,
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- http_server.launch_server (BEFORE) -------------------------------------------------------------
def before_launch_server(server_args, *args, **kwargs):
    """In the HTTP process, before its schedulers start: the state directory they inherit, and
    the middleware that reads it."""
    from sglang.srt.entrypoints.http_server import app

    board = HealthBoard(ensure_state_dir())
    app.add_middleware(FailClosedMiddleware, board=board)

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

import structlog

ENV_STATE_DIR = "KVGUARD_STATE_DIR"
# Probes: 503 while a guard failed closed, so a router drains the server.
HEALTH_PATHS = ("/health", "/health_generate", "/ping", "/ready")
# Routes that start no forward pass (server state, tokenizer, aborts, profiling, the docs):
# served while unhealthy. Every other route, SGLang's generation routes and any route kvguard
# does not know (a newer SGLang's, another plugin's), is refused while a guard failed closed.
PASS_PATHS = frozenset(
    {
        "/", "/metrics", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
        "/v1/models", "/abort_request", "/flush_cache", "/tokenize", "/detokenize",
        "/v1/tokenize", "/v1/detokenize", "/configure_logging", "/set_trace_level",
        "/start_profile", "/stop_profile", "/freeze_gc", "/docs", "/docs/oauth2-redirect",
        "/redoc", "/openapi.json", "/get_load", "/version",
    }
)  # fmt: skip
PASS_PREFIXES = ("/metrics/", "/v1/models/", "/kvguard")
# With --tokenizer-worker-num > 1 SGLang's HTTP workers import the app from this path: kvguard's
# wraps SGLang's with the same middleware (the parent's app is not the workers').
APP_PATH_ENV = "SGLANG_HTTP_SERVER_APP_PATH"
GUARDED_APP_PATH = "kvguard.patches.health_endpoint:guarded_app"
SGLANG_APP_PATH = "sglang.srt.entrypoints.http_server:app"
WRAPPED_APP_ENV = "KVGUARD_WRAPPED_APP_PATH"  # an app path the user set: wrapped, not replaced
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
    state = json.dumps({"pid": os.getpid(), "healthy": reason is None, "reason": reason})
    try:
        tmp.write_text(state)
        os.replace(tmp, out)
    except OSError as exc:  # called inside the scheduler's step: never raise there (a directory
        # removed under the server reads as unhealthy at the front door: HealthBoard)
        structlog.get_logger("kvguard").error(
            "kvguard_health_unpublished", path=str(out), healthy=reason is None, error=str(exc)
        )


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
            if not self.directory.is_dir():  # the guards' health cannot be seen: fail closed
                self._reason = (
                    f"kvguard's state directory {self.directory} is gone: the guards' health "
                    "cannot be read; restart the server"
                )
                return self._reason
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
        kind = scope.get("type")
        if kind in ("http", "websocket") and not passes(scope.get("path", "")):
            reason = self.board.reason()
            if reason is not None:
                if kind == "websocket":  # /v1/realtime: "try again later"
                    await send({"type": "websocket.close", "code": 1013, "reason": reason[:120]})
                else:
                    await _refuse(send, scope.get("path") in HEALTH_PATHS, reason)
                return
        await self.app(scope, receive, send)


def passes(path: str) -> bool:
    """Whether ``path`` is served while a guard failed closed."""
    return path not in HEALTH_PATHS and (path in PASS_PATHS or path.startswith(PASS_PREFIXES))


def refused_routes(app) -> list[str]:
    """The paths in ``app``'s route table refused while a guard failed closed (said at start)."""
    paths = set()
    stack = list(app.routes)
    while stack:
        route = stack.pop()
        if hasattr(route, "path"):
            paths.add(route.path)
        stack.extend(getattr(route, "routes", None) or [])
    return sorted(p for p in paths if not passes(p))


def _guard(app):
    """``app`` with the fail-closed middleware, once."""
    if not getattr(app.state, "kvguard_fail_closed", False):
        app.add_middleware(FailClosedMiddleware, board=HealthBoard(ensure_state_dir()))
        app.state.kvguard_fail_closed = True
    return app


def __getattr__(name: str):
    if name == "guarded_app":  # an HTTP worker's import (GUARDED_APP_PATH)
        import importlib

        module, _, attr = os.environ.get(WRAPPED_APP_ENV, SGLANG_APP_PATH).partition(":")
        return _guard(getattr(importlib.import_module(module), attr))
    raise AttributeError(name)


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

    _guard(app)
    if os.environ.get(APP_PATH_ENV, GUARDED_APP_PATH) != GUARDED_APP_PATH:
        os.environ[WRAPPED_APP_ENV] = os.environ[APP_PATH_ENV]
    os.environ[APP_PATH_ENV] = GUARDED_APP_PATH  # HTTP workers (--tokenizer-worker-num > 1)
    structlog.get_logger("kvguard").info(
        "kvguard_fail_closed_routes", refused_while_unhealthy=refused_routes(app)
    )

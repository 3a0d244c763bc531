"""The fail-closed front door (patches/health_endpoint.py) and the guard's health
(kvguard/health.py), issue 31 items 4-5.

* Every route SGLang serves that can start a forward is refused while a guard failed closed,
  read from SGLang's own route table, and so is a route kvguard does not know; probes say 503;
  state, tokenizer, abort and metrics routes still answer.
* With ``--tokenizer-worker-num 2`` SGLang serves HTTP from worker processes that import the app
  by path: they get the same middleware.
* Intermittent guard failures (1 in 8 of the last 64 checks) turn the server unhealthy, not only
  8 in a row; a state directory removed under the server never raises in a scheduler and reads
  as unhealthy at the front door.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvguard.health import CHECK_WINDOW, FAILURES_TO_FAIL_CLOSED, GuardHealth
from kvguard.patches import health_endpoint as front

# SGLang 0.5.23's routes that start a forward pass (generation, scoring, embedding, sessions,
# weight changes): each must be refused while unhealthy
FORWARD_ROUTES = (
    "/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
    "/encode", "/classify", "/v1/classify", "/v1/messages", "/invocations", "/api/chat",
    "/api/generate", "/v1/rerank", "/v1/score", "/vertex_generate", "/open_session",
    "/update_weights_from_disk", "/load_lora_adapter", "/v1/audio/transcriptions",
)  # fmt: skip


def test_refused_routes_come_from_sglangs_route_table():
    pytest.importorskip("sglang")
    from sglang.srt.entrypoints.http_server import app

    refused = front.refused_routes(app)
    assert set(FORWARD_ROUTES) <= set(refused), set(FORWARD_ROUTES) - set(refused)
    for path in ("/get_server_info", "/v1/models", "/abort_request", "/tokenize", "/"):
        assert path not in refused
    assert front.passes("/metrics") and front.passes("/v1/models/m")
    assert not front.passes("/some_route_kvguard_does_not_know")
    assert not any(front.passes(p) for p in front.HEALTH_PATHS)


class _Board:
    def __init__(self, reason):
        self._reason = reason

    def reason(self):
        return self._reason


def _call(reason, kind: str, path: str) -> list[dict]:
    """The messages the middleware sends for one request (the app answers 200 'app')."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"app"})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    mw = front.FailClosedMiddleware(app, _Board(reason))
    asyncio.run(mw({"type": kind, "path": path}, receive, send))
    return sent


def test_middleware_refuses_forward_routes_and_probes_only_while_unhealthy():
    for path in ("/v1/messages", "/invocations", "/not_a_known_route"):
        sent = _call("boom", "http", path)
        assert sent[0]["status"] == 503
        assert json.loads(sent[1]["body"])["error"]["type"] == "KVGuardFailedClosed"
        assert _call(None, "http", path)[0]["status"] == 200
    probe = _call("boom", "http", "/ready")
    assert probe[0]["status"] == 503 and json.loads(probe[1]["body"])["kvguard"]["reason"] == "boom"
    assert _call("boom", "http", "/get_server_info")[0]["status"] == 200
    closed = _call("boom", "websocket", "/v1/realtime")
    assert closed == [{"type": "websocket.close", "code": 1013, "reason": "boom"}]


def test_intermittent_failures_turn_unhealthy():
    health = GuardHealth(quarantine_cap_pages=10)
    for i in range(FAILURES_TO_FAIL_CLOSED):  # never two in a row: the old rule stayed healthy
        assert health.healthy, i
        health.step_failed("check")
        for _ in range(CHECK_WINDOW // FAILURES_TO_FAIL_CLOSED - 1):
            health.step_succeeded()
    assert not health.healthy and f"{FAILURES_TO_FAIL_CLOSED} of its last" in health.reason


def test_rare_failures_stay_healthy():
    health = GuardHealth(quarantine_cap_pages=10)
    for _ in range(20 * CHECK_WINDOW):
        health.step_failed("check")
        for _ in range(CHECK_WINDOW // (FAILURES_TO_FAIL_CLOSED - 1)):
            health.step_succeeded()
    assert health.healthy


def test_a_vanished_state_directory_never_raises_and_reads_unhealthy(tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv(front.ENV_STATE_DIR, str(state))
    front.publish(None)
    board = front.HealthBoard(state)
    assert board.reason() is None
    state.joinpath(next(iter(p.name for p in state.iterdir()))).unlink()
    state.rmdir()
    front.publish("a reason")  # inside a scheduler's step: logged, not raised
    board._read_at = 0.0
    assert "state directory" in (board.reason() or "")


@pytest.mark.engine
def test_tokenizer_workers_fail_closed(serve_processes, tmp_path):
    import requests

    state = tmp_path / "state"
    state.mkdir()
    srv = serve_processes(
        ["--embedded-model", "default", "--tokenizer-worker-num", "2"],
        env={front.ENV_STATE_DIR: str(state)},
    )

    def post(path: str) -> int:
        body = {"text": "def f(x):", "sampling_params": {"max_new_tokens": 4}}
        return requests.post(f"{srv.url}{path}", json=body, timeout=120).status_code

    assert post("/generate") == 200
    sick = state / "health-1.json"  # a scheduler's file, as publish writes it
    sick.write_text(json.dumps({"pid": 1, "healthy": False, "reason": "injected"}))
    time.sleep(2 * front._READ_EVERY_S)  # each worker re-reads the directory at most this often
    for _ in range(8):  # each worker answers in turn: every one refuses
        assert post("/generate") == 503
        assert post("/v1/messages") == 503
        assert requests.get(f"{srv.url}/health", timeout=30).status_code == 503
        assert requests.get(f"{srv.url}/get_server_info", timeout=30).status_code == 200
    sick.unlink()
    time.sleep(2 * front._READ_EVERY_S)
    assert post("/generate") == 200
    srv.stop(drain=False)

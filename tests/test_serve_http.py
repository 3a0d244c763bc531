"""kvguard-serve end to end: a real server (the session's shared one: subprocess, free port, page
size 16) answering /generate, /v1/completions and /metrics with the guard running in SGLang's
scheduler process; then a clean SIGTERM shutdown (last in the session). Bad input must end in one
line, before SGLang starts."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path

import psutil
import pytest
import requests
from tiny_model import tiny_random_llama

from kvguard.fuzz.oracle import read_jsonl
from kvguard.serve.child import clean_env, free_port, kvguard_serve_command


class Server:
    """The session's shared kvguard-serve (``shared_server.py``) and the model it serves."""

    def __init__(self, shared):
        srv = shared.get()
        self.srv, self.model, self.is_default = srv, shared.model, shared.is_default
        self.proc, self.url, self.log = srv.proc, srv.url, srv.log

    def events(self) -> list[dict]:
        """kvguard's structured log lines (--log-format json) from every process of the server."""
        return read_jsonl(self.log)

    def generate(self, text: str, n: int) -> dict:
        r = requests.post(
            f"{self.url}/generate",
            timeout=60,
            json={
                "text": text,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            },
        )
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def server(shared_server) -> Server:
    return Server(shared_server)


@pytest.mark.engine
def test_generate(server):
    out = server.generate("def add(a, b):", 8)
    assert isinstance(out["text"], str)
    assert out["meta_info"]["completion_tokens"] == 8


@pytest.mark.engine
def test_openai_completions(server):
    r = requests.post(
        f"{server.url}/v1/completions",
        timeout=60,
        json={
            "model": "default",
            "prompt": "import os\n",
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] == 5


@pytest.mark.engine
def test_metrics_include_guard_and_sglang_series(server):
    server.generate("class A:\n    def ", 4)
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values.get("kvguard_steps_checked_total", 0) > 0, text[:2000]
    assert values.get("kvguard_tokens_checked_total", 0) > 0
    assert "kvguard_requests_aborted_total" in values
    # the guard's own memory, and no forward served unchecked
    assert values.get("kvguard_state_bytes", 0) > 0
    assert values.get("kvguard_unchecked_forwards_total", 0) == 0
    # the launcher's own (tokenizer-side) series share the same multiprocess registry
    assert any(name.startswith("sglang:prompt_tokens_total") for name in values), sorted(values)[
        :50
    ]


@pytest.mark.engine
def test_guard_runs_in_scheduler_process(server):
    info = requests.get(f"{server.url}/server_info", timeout=30).json()
    status = info["kvguard"]  # reported by the scheduler's start-up handshake
    assert status["active"] and status["mode"] == "verified" and status["page_size"] == 16
    assert status["tenant_isolation"] is True  # a kvguard flag reached the scheduler
    assert status["kernels"] == "cpu" and status["state_bytes"] > 0  # the compiled kernels run
    pid = status["pid"]
    assert pid != server.proc.pid
    scheduler = psutil.Process(pid)
    assert server.proc.pid in [p.pid for p in scheduler.parents()]
    assert "scheduler" in " ".join(scheduler.cmdline()) + scheduler.name()
    events = server.events()
    attached = [e for e in events if e.get("event") == "kvguard_attached"]
    assert [e["pid"] for e in attached] == [pid], events
    starting = [e for e in events if e.get("event") == "kvguard_serve_starting"]
    assert [e["pid"] for e in starting] == [server.proc.pid]
    if server.is_default:
        assert Path(info["model_path"]) == server.model


@pytest.mark.engine
@pytest.mark.stops_shared_server
def test_sigterm_stops_everything(server, shared_server):
    # last in the session: the shared server served every test before it, never restarted (an
    # in-process engine's shutdown once killed it with every other descendant of pytest)
    assert shared_server.starts == 1, f"the shared server was started {shared_server.starts} times"
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(90) == 0
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.pid for p in alive]
    assert "Traceback" not in server.log.read_text(errors="replace")


# -- bad input: one line on stderr, exit 2, SGLang never started ---------------------------------
def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        kvguard_serve_command() + list(args),
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean_env(), **(env or {})},
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("kvguard-serve: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_model_path(tmp_path):
    assert_one_line_error(
        run_cli("--model-path", str(tmp_path / "nope"), "--port", str(free_port())),
        "--model-path",
        "no such model directory",
    )


def test_invalid_model_path(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert_one_line_error(
        run_cli("--model-path", str(tmp_path), "--port", str(free_port())), "config.json"
    )


def test_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_cli("--model-path", str(tiny_random_llama()), "--port", str(port))
    assert_one_line_error(proc, str(port), "in use")


def test_unknown_option():
    assert_one_line_error(
        run_cli(
            "--model-path", str(tiny_random_llama()), "--port", str(free_port()), "--no-such-flag"
        ),
        "unrecognized arguments: --no-such-flag",
    )


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["--kvguard-sweep-tokens-per-step", "-1"], {}, "sweep_tokens_per_step"),
        (["--kvguard-quarantine-cap", "2"], {}, "quarantine_cap"),
        ([], {"KVGUARD_QUARANTINE_CAP": "none"}, "KVGUARD_QUARANTINE_CAP"),
        ([], {"KVGUARD_MODE": "bogus"}, "invalid kvguard mode"),
        (["--kvguard-mode", "bogus"], {}, "--kvguard-mode"),
        (["--kvguard-on-violation", "retry"], {}, "--kvguard-on-violation"),
        ([], {"KVGUARD_ON_VIOLATION": "retry"}, "invalid kvguard on_violation"),
        (["--kvguard-recompute-budget", "-1"], {}, "recompute_budget"),
        ([], {"KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE": "x"}, "RECOMPUTE_BREAKER_PER_MINUTE"),
    ],
)
def test_invalid_guard_config(args, env, fragment):
    assert_one_line_error(
        run_cli("--model-path", str(tiny_random_llama()), *args, env=env), fragment
    )

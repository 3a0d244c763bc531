"""The launcher's structlog choice reaches child processes through KVGUARD_LOG_FORMAT."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvguard import logconfig

CHILD = (
    "from kvguard.logconfig import configure_from_env; import structlog, os; "
    "print(configure_from_env(), flush=True); "
    "structlog.get_logger('kvguard').info('hello', answer=42)"
)


def run_child(**env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_LOG")}
    return subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        check=True,
        env={**base, **env},
    )


def test_json_lines_carry_the_child_pid():
    out = run_child(KVGUARD_LOG_FORMAT="json", KVGUARD_LOG_LEVEL="info")
    assert out.stdout.strip() == "True"
    [line] = out.stderr.strip().splitlines()
    event = json.loads(line)
    assert event["event"] == "hello" and event["answer"] == 42 and event["level"] == "info"
    assert isinstance(event["pid"], int) and event["pid"] != os.getpid()


def test_level_filters():
    out = run_child(KVGUARD_LOG_FORMAT="json", KVGUARD_LOG_LEVEL="warning")
    assert out.stderr.strip() == ""


def test_nothing_configured_without_the_launcher():
    assert run_child().stdout.splitlines()[0] == "False"  # unconfigured structlog prints to stdout
    assert logconfig.configure_from_env({}) is False


def test_unknown_format_falls_back_to_console():
    out = run_child(KVGUARD_LOG_FORMAT="xml")
    assert out.stdout.strip() == "True"
    assert "hello" in out.stderr and not out.stderr.lstrip().startswith("{")


def test_json_tracebacks_carry_frames_not_their_locals():
    """An internal error's traceback names its frames, never their locals: in a scheduler hook
    those are the batch (prompt token ids, request ids) and the step's tensors."""
    child = (
        "from kvguard.logconfig import configure_from_env; import structlog; "
        "configure_from_env()\n"
        "def hook(prompt_ids):\n"
        "    raise RuntimeError('boom')\n"
        "try:\n"
        "    hook([4242, 1717])\n"
        "except RuntimeError as exc:\n"
        "    structlog.get_logger('kvguard').error('kvguard_internal_error', exc_info=exc)\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_LOG")}
    out = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        check=True,
        env={**base, "KVGUARD_LOG_FORMAT": "json"},
    )
    [line] = out.stderr.strip().splitlines()
    event = json.loads(line)
    [exc] = event["exception"]
    assert exc["exc_type"] == "RuntimeError" and exc["exc_value"] == "boom"
    assert [f["name"] for f in exc["frames"]][-1] == "hook"
    assert "4242" not in line and all("locals" not in f for f in exc["frames"])

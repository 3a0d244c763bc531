"""kvguard.install(engine): reads the guard reports of an in-process sglang.Engine's schedulers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from cpu_engine import CPU_ENGINE_ARGS
from tiny_model import tiny_random_llama


def test_package_import_is_light():
    code = (
        "import sys, kvguard; "
        "print(sorted(m for m in ('torch', 'sglang', 'prometheus_client') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


ENGINE_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import kvguard, sglang
    if __name__ == "__main__":
        engine = sglang.Engine(model_path=sys.argv[1], **json.loads(sys.argv[2]))
        try:
            report = {"parent": os.getpid()}
            try:
                report["statuses"] = kvguard.install(engine)
            except kvguard.engine_status.GuardNotActiveError as e:
                report["error"] = str(e)
            from kvguard.config import GuardConfig
            try:  # the schedulers run "tags": asking for "paranoid" must be refused
                kvguard.install(engine, GuardConfig(mode="paranoid"))
            except kvguard.engine_status.GuardNotActiveError as e:
                report["mismatch"] = str(e)
            print("REPORT", json.dumps(report))
            params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
            out = engine.generate("def f(x):", params)
            print("REPORT", json.dumps({"tokens": out["meta_info"]["completion_tokens"]}))
        finally:
            engine.shutdown()
""")


@pytest.mark.engine
def test_install_on_a_real_engine(tmp_path):
    """The guard really runs in the Engine's scheduler process (a pid other than the caller's)."""
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    # the engine runs in a child process: kvguard.install is called where the Engine was made
    engine_args = {
        **CPU_ENGINE_ARGS,
        "page_size": 16,
        "max_total_tokens": 1024,
        "log_level": "error",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD_", "PROMETHEUS_"))}
    env.update(
        SGLANG_USE_CPU_ENGINE="1",
        KVGUARD_MODE="tags",
        SGLANG_CACHE_DIR=str(tmp_path / "sglang-cache"),
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(tiny_random_llama()), json.dumps(engine_args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    reports = [
        json.loads(line.split(" ", 1)[1])
        for line in proc.stdout.splitlines()
        if line.startswith("REPORT ")
    ]
    assert proc.returncode == 0 and len(reports) == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    first, second = reports
    assert "error" not in first, first
    [status] = first["statuses"]
    assert status["active"] and status["mode"] == "tags" and status["page_size"] == 16
    assert status["pid"] != first["parent"]
    assert "KVGUARD_MODE" in first["mismatch"] and "paranoid" in first["mismatch"]
    assert second["tokens"] == 4

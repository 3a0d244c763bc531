"""kvguard-serve's defaults apply only where the user set nothing; SGLang's args pass through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tiny_model import tiny_random_llama

from kvguard.serve.child import free_port

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from kvguard.serve.cli import fp8_kv_supported, prepare
    FIELDS = ("model_path", "device", "attention_backend", "kv_cache_dtype", "enable_metrics",
              "skip_server_warmup", "page_size", "max_total_tokens", "port")
    ENV = ("KVGUARD_MODE", "KVGUARD_SWEEP_TOKENS_PER_STEP", "KVGUARD_LOG_FORMAT",
           "SGLANG_USE_CPU_ENGINE", "PROMETHEUS_MULTIPROC_DIR")
    out = {"fp8_supported": fp8_kv_supported(), "runs": []}
    for argv in json.loads(sys.argv[1]):
        args = prepare(argv)
        run = {f: getattr(args, f) for f in FIELDS}
        run["env"] = {k: os.environ.get(k) for k in ENV}
        out["runs"].append(run)
    print("RESULT", json.dumps(out))
""")


def test_defaults_only_where_unset():
    model, port = str(tiny_random_llama()), str(free_port())
    base = ["--model-path", model, "--port", port]
    argvs = [
        base + ["--page-size", "16", "--max-total-tokens", "1024"],
        base
        + [
            "--attention-backend",
            "triton",
            "--kv-cache-dtype",
            "bf16",
            "--kvguard-mode",
            "tags",
            "--kvguard-sweep-tokens-per-step",
            "7",
            "--log-format",
            "json",
        ],
        base + ["--no-fp8-kv"],
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGUARD_", "PROMETHEUS_"))}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0].split(" ", 1)[1])
    plain, chosen, no_fp8 = out["runs"]
    fp8 = "fp8_e4m3" if out["fp8_supported"] else "auto"

    assert plain["model_path"] == model and plain["port"] == int(port)
    assert (plain["page_size"], plain["max_total_tokens"]) == (16, 1024)
    assert plain["enable_metrics"] is True and plain["kv_cache_dtype"] == fp8
    assert plain["env"]["KVGUARD_MODE"] == "sampled" and plain["env"]["PROMETHEUS_MULTIPROC_DIR"]
    if plain["device"] == "cpu":  # no GPU here
        assert plain["attention_backend"] == "torch_native" and plain["skip_server_warmup"] is True
        assert plain["env"]["SGLANG_USE_CPU_ENGINE"] == "1"

    assert chosen["attention_backend"] == "triton" and chosen["kv_cache_dtype"] == "bf16"
    assert chosen["env"]["KVGUARD_MODE"] == "tags"
    assert chosen["env"]["KVGUARD_SWEEP_TOKENS_PER_STEP"] == "7"
    assert chosen["env"]["KVGUARD_LOG_FORMAT"] == "json"

    assert no_fp8["kv_cache_dtype"] == "auto"

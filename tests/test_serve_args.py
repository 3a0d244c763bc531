"""kvguard-serve's defaults apply only where the user set nothing (the CPU core group per rank
included); SGLang's args pass through."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tiny_model import tiny_random_llama

from kvguard.serve.child import free_port
from kvguard.serve.cli import cpu_threads_bind

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from kvguard.serve.cli import fp8_kv_supported, prepare
    FIELDS = ("model_path", "device", "attention_backend", "kv_cache_dtype", "enable_metrics",
              "skip_server_warmup", "page_size", "max_total_tokens", "port")
    ENV = ("KVGUARD_MODE", "KVGUARD_SWEEP_TOKENS_PER_STEP", "KVGUARD_LOG_FORMAT", "KVGUARD_QUARANTINE_CAP",
           "KVGUARD_ON_VIOLATION", "KVGUARD_RECOMPUTE_BUDGET", "KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE",
           "SGLANG_USE_CPU_ENGINE", "PROMETHEUS_MULTIPROC_DIR", "SGLANG_CPU_OMP_THREADS_BIND")
    from sglang.srt.utils.common import get_cpu_ids_by_node
    out = {"fp8_supported": fp8_kv_supported(), "numa_nodes": len(get_cpu_ids_by_node()),
           "runs": []}
    for argv in json.loads(sys.argv[1]):
        args = prepare(argv)
        run = {f: getattr(args, f) for f in FIELDS}
        run["env"] = {k: os.environ.get(k) for k in ENV}
        out["runs"].append(run)
    print("RESULT", json.dumps(out))
""")


def _prepare(argvs: list[list[str]], env: dict[str, str]) -> dict:
    """kvguard-serve's prepare() on each argv in turn, in a child process with ``env``."""
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out: dict = json.loads(lines[0].split(" ", 1)[1])
    return out


def _env(**extra: str) -> dict[str, str]:
    drop = ("KVGUARD_", "PROMETHEUS_", "SGLANG_CPU_OMP_THREADS_BIND")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(drop)}, **extra}


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
            "--kvguard-quarantine-cap",
            "0.05",
            "--kvguard-on-violation",
            "abort",
            "--kvguard-recompute-budget",
            "3",
            "--kvguard-recompute-breaker-per-minute",
            "0",
            "--log-format",
            "json",
        ],
        base + ["--no-fp8-kv"],
        base + ["--tp-size", "2"],
    ]
    out = _prepare(argvs, _env())
    plain, chosen, no_fp8, tp2 = out["runs"]
    fp8 = "fp8_e4m3" if out["fp8_supported"] else "auto"

    assert plain["model_path"] == model and plain["port"] == int(port)
    assert (plain["page_size"], plain["max_total_tokens"]) == (16, 1024)
    assert plain["enable_metrics"] is True and plain["kv_cache_dtype"] == fp8
    assert plain["env"]["KVGUARD_MODE"] == "verified" and plain["env"]["PROMETHEUS_MULTIPROC_DIR"]
    if plain["device"] == "cpu":  # no GPU here
        assert plain["attention_backend"] == "torch_native" and plain["skip_server_warmup"] is True
        assert plain["env"]["SGLANG_USE_CPU_ENGINE"] == "1"

    assert chosen["attention_backend"] == "triton" and chosen["kv_cache_dtype"] == "bf16"
    assert chosen["env"]["KVGUARD_MODE"] == "tags"
    assert chosen["env"]["KVGUARD_SWEEP_TOKENS_PER_STEP"] == "7"
    assert chosen["env"]["KVGUARD_QUARANTINE_CAP"] == "0.05"
    assert plain["env"]["KVGUARD_QUARANTINE_CAP"] == "0.01"
    assert chosen["env"]["KVGUARD_LOG_FORMAT"] == "json"
    healing = (
        "KVGUARD_ON_VIOLATION",
        "KVGUARD_RECOMPUTE_BUDGET",
        "KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE",
    )
    assert [plain["env"][k] for k in healing] == ["recompute", "2", "60"]
    assert [chosen["env"][k] for k in healing] == ["abort", "3", "0"]

    assert no_fp8["kv_cache_dtype"] == "auto"

    # --tp-size 2 on CPU: a core group per rank where SGLang would want a NUMA node per rank
    assert plain["env"]["SGLANG_CPU_OMP_THREADS_BIND"] is None
    if plain["device"] == "cpu" and out["numa_nodes"] < 2:
        cores = sorted(os.sched_getaffinity(0))
        assert tp2["env"]["SGLANG_CPU_OMP_THREADS_BIND"] == cpu_threads_bind(cores, 2)


def test_cpu_threads_bind_is_kept_where_set():
    model, port = str(tiny_random_llama()), str(free_port())
    argv = ["--model-path", model, "--port", port, "--device", "cpu", "--tp-size", "2"]
    out = _prepare([argv], _env(SGLANG_CPU_OMP_THREADS_BIND="0|0"))
    assert out["runs"][0]["env"]["SGLANG_CPU_OMP_THREADS_BIND"] == "0|0"


def test_cpu_threads_bind_groups():
    assert cpu_threads_bind([0, 1], 2) == "0|1"
    assert cpu_threads_bind([0, 1, 2, 3, 4], 2) == "0,1,2|3,4"
    assert cpu_threads_bind([4, 5, 6, 7, 8, 9, 10, 11], 3) == "4,5,6|7,8,9|10,11"
    assert cpu_threads_bind([0, 1], 3) == "0|1|0"  # fewer cores than ranks: shared in turn

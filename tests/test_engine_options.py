"""Every SGLang option that changes how KV is written, read, moved or shared is in the table of
patches/engine_options.py: guarded (a test serves it with the guard), refused (one line naming it,
exit status 2, before SGLang starts; at attach for python -m sglang.launch_server) or neutral.
Each row is tested here: its field and flag are SGLang's, a refused one is refused in one line,
a guarded or neutral one passes and names a test that exists; the docs show the same table."""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from tiny_model import serving_model

from kvguard.patches.engine_options import (
    BEGIN,
    END,
    GUARDED,
    NEUTRAL,
    OPTIONS,
    REFUSED,
    Row,
    markdown,
    refusals,
)
from kvguard.serve.child import clean_env, free_port, kvguard_serve_command
from kvguard.serve.cli import _parse_sglang_args, prepare
from kvguard.serve.preflight import LaunchError

ROOT = Path(__file__).resolve().parents[1]

# A value that puts each option with an argument in effect (store-true flags need none).
VALUES = {
    "page_size": "16", "chunked_prefill_size": "128", "tp_size": "2",
    "kv_cache_dtype": "fp8_e4m3", "attention_backend": "torch_native",
    "max_total_tokens": "1024", "mem_fraction_static": "0.5", "max_running_requests": "8",
    "max_prefill_tokens": "4096", "prefill_max_requests": "4", "prefill_decode_interval": "2",
    "schedule_policy": "lpm", "schedule_conservativeness": "0.5",
    "num_continuous_decode_steps": "2", "priority_scheduling_preemption_threshold": "5",
    "default_priority_value": "1", "retraction_policy": "priority",
    "radix_eviction_policy": "lfu", "radix_eviction_policy_config": "{}", "dtype": "float32",
    "quantization_param_path": "scales.json", "prefill_attention_backend": "triton",
    "decode_attention_backend": "triton", "cuda_graph_backend_decode": "disabled",
    "cuda_graph_backend_prefill": "disabled", "kv_events_config": "{}", "cpu_offload_gb": "1",
    "ep_size": "2", "swa_full_tokens_ratio": "0.5", "swa_prefix_tails": "2",
    "c128_page_size": "32", "max_mamba_cache_size": "8", "mamba_full_memory_ratio": "0.5",
    "mamba_ssm_dtype": "float16", "mamba_radix_cache_strategy": "no_buffer",
    "mamba_max_states_per_path": "4", "mamba_track_interval": "128", "int8_mamba_ckpt_size": "8",
    "hicache_storage_backend": "file", "hicache_host_memory_mode": "buffer_only",
    "hicache_ratio": "2", "hicache_size": "4", "hicache_host_memory_fraction": "0.5",
    "hicache_write_policy": "write_back", "hicache_io_backend": "direct",
    "hicache_mem_layout": "layer_first", "hicache_storage_prefetch_policy": "best_effort",
    "hicache_storage_backend_extra_config": "{}",
    "hicache_storage_prefetch_retry_poll_interval": "4",
    "hicache_storage_prefetch_retry_max_attempts": "4",
    "unified_cache_external_linker_backend": "mori", "unified_cache_external_linker_config": "{}",
    "hisparse_config": "{}", "lmcache_config_file": "lmcache.yaml",
    "flexkv_config_file": "flexkv.yaml", "radix_cache_backend": "custom",
    "prefill_kv_cache_dequant_dtype": "nvfp4", "qsa_indexer_dtype": "fp8_e4m3",
    "disaggregation_mode": "prefill", "disaggregation_transfer_backend": "nixl",
    "disaggregation_ib_device": "mlx5_0", "disaggregation_decode_retraction_backup": "cpu_tensor",
    "disaggregation_decode_extra_slots": "8", "disaggregation_decode_host_receive_threshold": "0.5",
    "disaggregation_decode_allocation_policy": "prefill_complete",
    "num_reserved_decode_tokens": "256", "optimistic_prefill_attempts": "1",
    "pdmux_config_path": "pdmux.yaml", "pp_size": "2", "pp_max_micro_batch_size": "4",
    "pp_async_batch_depth": "1", "dp_size": "2", "attn_dp_size": "2", "dcp_size": "2",
    "attn_cp_size": "2", "cp_strategy": "zigzag", "speculative_algorithm": "EAGLE",
    "speculative_draft_model_path": "draft", "speculative_num_steps": "3",
    "speculative_eagle_topk": "1", "speculative_num_draft_tokens": "4",
    "speculative_dflash_block_size": "4", "speculative_dspark_block_size": "4",
    "speculative_draft_kv_cache_dtype": "fp8_e4m3", "speculative_draft_window_size": "512",
    "speculative_draft_sink_size": "4", "speculative_attention_mode": "decode",
    "speculative_draft_attention_backend": "triton", "decoupled_spec_role": "verifier",
    "lora_paths": "adapter", "kv_canary": "log", "kv_canary_real_data": "partial",
    "kv_canary_sweep_interval": "8", "dllm_algorithm": "LowConfidence",
}  # fmt: skip
# Rows whose example differs from VALUES (one field, two rows).
ROW_VALUES = {
    ("kv_cache_dtype", REFUSED): "fp8_e5m2",
    ("attention_backend", NEUTRAL): "triton",
}


@functools.cache
def sglang_actions() -> dict[str, list[Any]]:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    out: dict[str, list[Any]] = {}
    for action in parser._actions:
        out.setdefault(action.dest, []).append(action)
    return out


def _action(row: Row) -> Any:
    return next(a for a in sglang_actions()[row.field] if row.flag in a.option_strings)


def example(row: Row) -> list[str]:
    """Command-line arguments that put the row's option in effect."""
    if _action(row).nargs == 0:
        return [row.flag]
    return [row.flag, ROW_VALUES.get((row.field, row.status), VALUES[row.field])]


def _id(row: Row) -> str:
    return f"{row.flag}:{row.status}"


REFUSED_ROWS = [r for r in OPTIONS if r.status == REFUSED]
PASSING_ROWS = [r for r in OPTIONS if r.status != REFUSED]


# -- the table against SGLang ---------------------------------------------------------------------
@pytest.mark.parametrize("row", OPTIONS, ids=_id)
def test_row_is_a_sglang_option(row):
    """The field is a ServerArgs field, the flag is SGLang's for it, the example is in effect."""
    import msgspec
    from sglang.srt.server_args import ServerArgs

    assert row.field in {f.name for f in msgspec.structs.fields(ServerArgs)}, row.field
    assert row.field in sglang_actions(), f"{row.field}: no command-line option"
    assert any(row.flag in a.option_strings for a in sglang_actions()[row.field]), row.flag
    assert row.status in (GUARDED, REFUSED, NEUTRAL) and row.why.strip()
    given, _ = _parse_sglang_args(example(row))
    assert row.when.holds(given[row.field]), (row.flag, given[row.field], row.when.text)


def test_sglang_defaults_are_not_refused():
    """Every refused row is off at SGLang's defaults, as parsed and on a ServerArgs record (a
    'not <default>' row names SGLang's default)."""
    from sglang.srt.server_args import ServerArgs

    _, defaults = _parse_sglang_args([])
    assert refusals(defaults) == []
    assert refusals(ServerArgs(model_path="m")) == []


def test_statuses_say_how_they_are_shown():
    for row in OPTIONS:
        if row.status == REFUSED:
            assert not row.test and row.why.startswith("kvguard "), row
        else:
            assert row.test.startswith("tests/test_") and "::" in row.test, row


@pytest.mark.parametrize("node", sorted({r.test for r in PASSING_ROWS}))
def test_cited_test_exists(node):
    """A guarded or neutral row names a test function that exists (no row cites a test that is
    not there)."""
    path, _, name = node.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    assert name in tests, f"{path} has no {name}"


@pytest.mark.parametrize("row", PASSING_ROWS, ids=_id)
def test_guarded_and_neutral_options_are_not_refused(row):
    given, _ = _parse_sglang_args(example(row))
    assert refusals(given) == []


def test_docs_show_the_code_table():
    text = (ROOT / "docs" / "options.md").read_text()
    assert BEGIN in text and END in text
    table = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    assert table == markdown(), (
        "docs/options.md is not the code table: run "
        ".venv/bin/python -m kvguard.patches.engine_options --write docs/options.md"
    )


# -- kvguard-serve refuses before SGLang starts ---------------------------------------------------
@pytest.fixture
def launcher_env(monkeypatch, tmp_path):
    """What prepare() would set in this process, set (and restored) by the test instead."""
    monkeypatch.delenv("KVGUARD_MODE", raising=False)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_CACHE_DIR", str(tmp_path / "sglang"))


@pytest.mark.parametrize("row", REFUSED_ROWS, ids=_id)
def test_refused_option_is_one_line(row, launcher_env):
    argv = ["--device", "cpu", "--port", str(free_port()), *example(row)]
    with pytest.raises(LaunchError) as exc:
        prepare(argv)
    message = str(exc.value)
    assert "\n" not in message and message.startswith(row.flag), message
    assert f": {row.why}; serve without it or with --kvguard-mode off" in message, message


REACH = textwrap.dedent("""
    import json, sys
    from kvguard.serve.cli import prepare
    out = []
    for argv, fields in json.loads(sys.argv[1]):
        args = prepare(argv)
        out.append({f: getattr(args, f) for f in fields})
    print("RESULT", json.dumps(out, default=str))
""")


def test_neutral_options_reach_sglang():
    """Neutral options pass through kvguard-serve to SGLang unchanged, and with --kvguard-mode off
    (no guard installed) nothing is refused."""
    neutral = [r for r in OPTIONS if r.status == NEUTRAL]
    argv = [a for r in neutral for a in example(r)]
    given, _ = _parse_sglang_args(argv)
    fields = sorted({r.field for r in neutral})
    model = str(serving_model()[0])
    base = ["--model-path", model, "--device", "cpu", "--port", str(free_port())]
    off = [*base, "--kvguard-mode", "off", "--enable-hierarchical-cache"]
    runs = [[base + argv, fields], [off, ["enable_hierarchical_cache"]]]
    env = {k: v for k, v in clean_env().items() if k != "SGLANG_CPU_OMP_THREADS_BIND"}
    proc = subprocess.run(
        [sys.executable, "-c", REACH, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "SGLANG_USE_CPU_ENGINE": "1"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    reached, off_run = json.loads(lines[0].split(" ", 1)[1])
    expected = json.loads(json.dumps({f: given[f] for f in fields}, default=str))
    assert reached == expected
    assert off_run == {"enable_hierarchical_cache": True}


@pytest.mark.engine
def test_kvguard_serve_refuses_before_sglang_starts():
    proc = subprocess.run(
        [*kvguard_serve_command(), "--port", str(free_port()), "--enable-hierarchical-cache"],
        capture_output=True,
        text=True,
        timeout=180,
        env=clean_env(),
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("kvguard-serve: error: --enable-hierarchical-cache: kvguard does ")
    assert "Traceback" not in proc.stdout + proc.stderr


# -- python -m sglang.launch_server: refused before its schedulers start ----------------------------
@pytest.mark.engine
def test_launch_server_refuses_before_its_schedulers_start(tmp_path):
    """SGLang on its own dies inside Scheduler.__init__ building HiCache's host pool on CPU ("Found
    no NVIDIA driver", a traceback per rank). With kvguard installed the HTTP process stops
    before it starts any scheduler: kvguard's line, exit status 2, nothing else.
    (``refuse_unguarded_options`` at Scheduler.__init__ stays as the line for engines started
    another way.)"""
    model = str(serving_model()[0])
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
        "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
        "--max-total-tokens", "1024", "--host", "127.0.0.1", "--port", str(free_port()),
        "--enable-hierarchical-cache",
    ]  # fmt: skip
    env = {**clean_env(), "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=env
    )
    out = proc.stdout
    line = (
        "kvguard: error: --enable-hierarchical-cache: kvguard does not guard HiCache (host and "
        "storage tiers write KV back and load it outside the checked forward); serve without it "
        "or with KVGUARD_MODE=off"
    )
    assert proc.returncode == 2, out[-3000:]
    assert line in out.splitlines(), out[-3000:]
    assert "NVIDIA driver" not in out and "Scheduler hit an exception" not in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    first_error = next(
        i for i, text in enumerate(out.splitlines()) if "Traceback" in text or "error:" in text
    )
    assert out.splitlines()[first_error] == line, out[-3000:]


# -- guarded rows: served with the guard on, clean, and a bit flip caught --------------------------
@pytest.mark.engine
@pytest.mark.parametrize(
    "option",
    [
        {"disable_radix_cache": True},
        {"enable_mixed_chunk": True},
        {"disable_overlap_schedule": True},
    ],
    ids=lambda o: next(iter(o)),
)
def test_guarded_option_serves_and_catches_a_flip(tmp_path, option):
    from guarded_engine import guarded_engine, workload

    with guarded_engine(tmp_path, 16, chunked_prefill_size=64, **option) as eng:
        prompts = workload(8)
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference), reference
        again = eng.run(prompts, tag="again")  # prefix-cache hits where the cache is on
        assert [o.get("output_ids") for o in again] == [r["output_ids"] for r in reference]
        eng.assert_flip_caught(prompts, reference)


@pytest.mark.engine
def test_priority_preemption_is_guarded(tmp_path):
    """Priority scheduling preempts running requests for more urgent ones: their KV is released
    mid-flight and recomputed later. With the guard on, no request is aborted, every preempted
    one completes, and a bit flip afterwards is still caught."""
    from guarded_engine import SAMPLING, guarded_engine, workload

    long = {**SAMPLING, "max_new_tokens": 300}
    with guarded_engine(
        tmp_path, 16, enable_priority_scheduling=True, max_running_requests=4
    ) as eng:
        engine, prompts = eng.engine, workload(8, seed=1)

        decoding = asyncio.Semaphore(0)

        async def streamed(i: int, prompt: str) -> dict:
            last = None
            gen = await engine.async_generate(prompt, long, rid=f"low-{i}", priority=0, stream=True)
            async for chunk in gen:
                if last is None:
                    decoding.release()
                last = chunk
            assert last is not None
            return last

        async def go():
            low = [asyncio.ensure_future(streamed(i, p)) for i, p in enumerate(prompts[:4])]
            for _ in low:  # every low-priority request is decoding: the batch is full
                await decoding.acquire()
            high = [
                engine.async_generate(p, SAMPLING, rid=f"high-{i}", priority=100)
                for i, p in enumerate(prompts[4:])
            ]
            return await asyncio.gather(*low, *high)

        out = engine.loop.run_until_complete(asyncio.wait_for(go(), 600))
        preempted = [o for o in out[:4] if o["meta_info"]["num_retractions"] > 0]
        assert preempted, [o["meta_info"] for o in out[:4]]
        assert [o["meta_info"]["completion_tokens"] for o in out[:4]] == [300] * 4
        reference = eng.run(prompts)
        assert all("error" not in r for r in reference), reference
        eng.assert_flip_caught(prompts, reference)


@pytest.mark.engine
def test_kvguard_serve_tensor_parallel_on_cpu(serve_processes, monkeypatch):
    """kvguard-serve --tp-size 2 on a CPU as it is: without SGLANG_CPU_OMP_THREADS_BIND the
    launcher gives each rank a group of cores, and both ranks serve guarded."""
    import requests

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)  # the launcher's default
    srv = serve_processes(["--tp-size", "2", "--page-size", "16", "--max-total-tokens", "2048"])
    r = requests.post(
        f"{srv.url}/generate",
        json={"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 8}},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 8
    srv.wait_idle()
    totals = srv.metric_totals()
    assert totals.get("kvguard_steps_checked_total", 0) > 0
    assert totals.get("kvguard_violations_total", 0) == 0

"""The Kimi K2 architecture (DeepSeek-V3: MLA + MoE) served and guarded on CPU, with kvguard's
tiny trained Kimi model (serve/kimi_model/).

* HF equality: SGLang (torch_native, patches/mla_cpu.py) and transformers give the same greedy
  tokens at page sizes 1, 16 and 64, with the guard on, and a second pass through the prefix
  cache gives them again. In float32, where both compute the same function without bf16's
  rounding ties deciding an argmax.
* FP8 MLA KV in paranoid mode: ``kvguard-serve --embedded-model kimi --kvguard-mode paranoid``
  (FP8 KV is its default) answers every request, its metrics count the checked steps and
  0 violations, and its greedy output stays close to BF16.
* Any MLA checkpoint: one without rope scaling serves HF-equal too; the two dispatch hooks
  change torch_native and non-YaRN ropes only.
* ``kvguard-serve --embedded-model kimi`` at its defaults (guard sampled, FP8 KV) starts and answers.
* Start-up errors for DeepSeek configs SGLang cannot read, in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from quant_helpers import (  # noqa: E402
    agreement,
    hf_greedy,
    prompt_ids,
    sglang_engine,
    sglang_greedy,
)

from kvguard.serve.kimi_model import ensure_kimi_model  # noqa: E402

N_NEW = 24


@pytest.fixture(scope="module")
def model():
    return ensure_kimi_model()


@pytest.fixture(scope="module")
def ids(model):
    return prompt_ids(model)[:4]


@pytest.fixture(scope="module")
def hf_fp32(model, ids):
    return hf_greedy(model, ids, N_NEW, dtype=torch.float32)


@pytest.mark.engine
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_greedy_equals_transformers(model, ids, hf_fp32, page_size):
    with sglang_engine(
        model,
        guard_mode="sampled",
        page_size=page_size,
        dtype="float32",
        kv_cache_dtype="auto",
    ) as engine:
        first = sglang_greedy(engine, ids, N_NEW)
        again = sglang_greedy(engine, ids[:2], N_NEW)  # prefix-cache hits read the latent rows
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in first + again)
    got = [o["output_ids"] for o in first]
    assert got == hf_fp32
    assert [o["output_ids"] for o in again] == got[:2]


@pytest.mark.engine
def test_plain_rope_checkpoint_equals_transformers(tmp_path, model, ids):
    """An MLA checkpoint without rope scaling (plain RoPE): SGLang's CPU rope factory asserts
    DeepSeek YaRN; served through the generic rope (patches/mla_cpu.py), still HF-equal."""
    ckpt = tmp_path / "plain-rope"
    shutil.copytree(model, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_scaling"] = None
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with sglang_engine(ckpt, guard_mode="sampled", dtype="float32", kv_cache_dtype="auto") as e:
        got = [o["output_ids"] for o in sglang_greedy(e, ids[:2], N_NEW)]
    assert got == hf_greedy(ckpt, ids[:2], N_NEW, dtype=torch.float32)


def test_torch_native_gets_the_absorbed_mla_method():
    from sglang.srt.models.deepseek_common import attention_backend_handler as h

    from kvguard.patches import mla_cpu

    registry = h.AttentionBackendRegistry
    original = registry.get_handler.__func__
    original = getattr(original, "__wrapped__", original)  # SGLang's, hooked or not
    assert original(registry, "torch_native") is h.handle_attention_triton  # the bug: Triton's
    assert mla_cpu.around_get_handler(original, registry, "torch_native") is h._dispatch_mla_subtype
    for name in ("triton", "flashinfer", "fa3"):
        assert mla_cpu.around_get_handler(original, registry, name) is original(registry, name)


def test_cpu_rope_without_yarn():
    from sglang.srt.layers.rotary_embedding import factory

    from kvguard.patches import mla_cpu

    original = getattr(factory.get_rope_cpu, "__wrapped__", factory.get_rope_cpu)
    with pytest.raises(AssertionError):
        original(16, 16, 2048, 10000, False, None, torch.float32, 1.0, "cpu")
    rope = mla_cpu.around_get_rope_cpu(
        original, 16, 16, 2048, 10000, False, None, torch.float32, 1.0, "cpu"
    )
    q, k = torch.randn(3, 4 * 16), torch.randn(3, 16)
    q2, _k2 = rope.forward_native(torch.arange(3), q.clone(), k.clone())
    assert q2.shape == q.shape and torch.equal(q2[0], q[0])  # position 0: no rotation
    assert not torch.equal(q2[1], q[1])
    yarn = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    kept = mla_cpu.around_get_rope_cpu(
        original, 16, 16, 2048, 10000, False, yarn, torch.float32, 1.0, "cpu"
    )
    assert type(kept).__name__ == "DeepseekScalingRotaryEmbedding"  # SGLang's own CPU rope


def _generate(srv, ids, n: int) -> list[dict]:
    import requests

    r = requests.post(
        f"{srv.url}/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.engine
def test_fp8_mla_kv_paranoid_guard_zero_violations(serve_processes, model, ids):
    srv = serve_processes(
        ["--embedded-model", "kimi", "--kvguard-mode", "paranoid", "--page-size", "16"]
    )
    first = _generate(srv, ids, N_NEW)
    again = _generate(srv, ids, N_NEW)  # every token re-read from the FP8 pool (prefix cache)
    info = srv.wait_idle()
    assert info is not None
    totals = srv.metric_totals()
    assert totals.get("kvguard_steps_checked_total", 0) > 0
    assert totals.get("kvguard_tokens_checksummed_total", 0) > 0
    assert totals.get("kvguard_violations_total", 0) == 0
    assert totals.get("kvguard_requests_aborted_total", 0) == 0
    assert totals.get("kvguard_unchecked_forwards_total", 0) == 0
    log = srv.log_tail(200_000)
    assert "kvguard_cpu_fp8_kv" in log and "pool=mla" in log  # SGLang's MLA pool, FP8 bytes
    assert "paranoid" in log
    got = [o["output_ids"] for o in first]
    assert [o["output_ids"] for o in again] == got
    assert agreement(got, hf_greedy(model, ids, N_NEW)) >= 0.75


@pytest.mark.engine
def test_kvguard_serve_kimi_at_defaults(serve_processes):
    import requests

    srv = serve_processes(["--embedded-model", "kimi"])
    r = requests.post(
        f"{srv.url}/generate",
        json={"text": "def __init__(self", "sampling_params": {"max_new_tokens": 16}},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 16
    info = requests.get(f"{srv.url}/server_info", timeout=30).json()
    assert info["kv_cache_dtype"] == "fp8_e4m3"
    assert info["model_path"] == str(ensure_kimi_model())
    srv.wait_idle()
    totals = srv.metric_totals()
    assert totals.get("kvguard_steps_checked_total", 0) > 0
    assert totals.get("kvguard_violations_total", 0) == 0


# ------------------------------------------------------------------------- start-up checks
def _launch(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvguard.serve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _saved_without(model, out, drop=("moe_layer_freq", "topk_method", "scoring_func"), **set_):
    """The checkpoint with config.json as transformers 5 saves it (no SGLang MoE fields)."""
    shutil.copytree(model, out)
    cfg = json.loads((out / "config.json").read_text())
    for key in drop:
        cfg.pop(key)
    cfg.update(set_)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_moe_fields_transformers_fixes_are_supplied_to_sglang(tmp_path, model):
    """DeepseekV3 (Kimi K2): transformers' model code fixes sigmoid/noaux_tc routing and MoE from
    first_k_dense_replace on; a config lacking the fields means those values."""
    from kvguard.serve.preflight import deepseek_moe_overrides

    ckpt = _saved_without(model, tmp_path / "hf-saved")
    assert deepseek_moe_overrides(str(ckpt)) == {
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    }
    assert deepseek_moe_overrides(str(model)) == {}  # the committed config has them


@pytest.mark.engine
def test_transformers_saved_kimi_served_equals_transformers(
    serve_processes, tmp_path, model, ids, hf_fp32
):
    """The committed model with config.json as transformers 5 saves it, through kvguard-serve:
    the supplied fields are transformers' semantics (greedy in float32 equal to transformers')."""
    ckpt = _saved_without(model, tmp_path / "hf-saved-served")
    srv = serve_processes(
        ["--model-path", str(ckpt), "--dtype", "float32", "--kv-cache-dtype", "auto"]
    )
    assert [o["output_ids"] for o in _generate(srv, ids, N_NEW)] == hf_fp32
    assert "model_config_fields_supplied" in srv.log_tail(200_000)


def test_moe_fields_nothing_fixes_are_one_line(tmp_path, model):
    v2 = _saved_without(model, tmp_path / "v2", architectures=["DeepseekV2ForCausalLM"])
    proc = _launch(["--model-path", str(v2)])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "moe_layer_freq, topk_method, scoring_func" in lines[0], lines
    cfg = json.loads((model / "config.json").read_text())
    n, k = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    odd = ["sparse"] * n  # MoE in a layer SGLang keeps dense
    assert k > 0
    moved = _saved_without(model, tmp_path / "moved", drop=(), mlp_layer_types=odd)
    proc = _launch(["--model-path", str(moved)])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mlp_layer_types" in lines[0], lines


def test_embedded_model_and_model_path_conflict(model):
    proc = _launch(["--embedded-model", "kimi", "--model-path", str(model)])
    assert proc.returncode == 2
    assert "give one of them" in proc.stderr


def test_embedded_kimi_and_the_cpu_pool_default():
    """``--embedded-model kimi`` is the committed checkpoint; on CPU the pool is bounded unless
    the user sizes it (SGLang alone would give the 80-byte FP8 latent rows tens of millions of
    slots, and the guard's state grows with them)."""
    from kvguard.serve.child import free_port

    script = (
        "import json, sys\n"
        "from kvguard.serve.cli import prepare\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    a = prepare(argv)\n"
        "    out.append([a.model_path, a.max_total_tokens, a.mem_fraction_static, a.device])\n"
        "print('RESULT', json.dumps(out))\n"
    )
    port = str(free_port())
    argvs = [
        ["--embedded-model", "kimi", "--port", port],
        ["--embedded-model", "kimi", "--port", port, "--max-total-tokens", "4096"],
        ["--embedded-model", "kimi", "--port", port, "--mem-fraction-static", "0.5"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    default, sized, fraction = json.loads(lines[0].split(" ", 1)[1])
    assert default[0] == str(ensure_kimi_model())
    if default[3] == "cpu":
        from kvguard.serve.cli import CPU_MAX_TOTAL_TOKENS

        assert default[1] == CPU_MAX_TOTAL_TOKENS
        assert fraction[1] is None and fraction[2] == 0.5
    assert sized[1] == 4096

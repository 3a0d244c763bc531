"""GLM-5 and Kimi K2 checkpoints shaped as their released configs (tests/released_configs.py),
saved by transformers, served by ``kvguard-serve`` (issue 32, item 3).

* float32, guard at its default mode: greedy tokens equal transformers'; for the DSA models past
  ``index_topk`` equal to transformers with SGLang's FP8 indexer logits (glm_dsa_reference).
  The YaRN DSA checkpoint (DeepSeek-V3.2's rope) runs at ``--tp 2``: it crashed the first prefill
  in the CPU indexer's rope before, and DSA at TP 2 had never been served.
* GLM-5 at kvguard-serve's defaults (FP8 KV, verified reads): answers, every step checked, no
  violation, and the log says which config fields were supplied (the indexer's interleaved
  rope among them: transformers' GlmMoeDsa always applies it and saves no key for it).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

import released_configs  # noqa: E402
from quant_helpers import hf_greedy, prompt_ids  # noqa: E402

N_NEW = 8
LONG = list(range(100, 250))  # 150 tokens: past index_topk (32), over three 64-token pages


def _prompts(model) -> list[list[int]]:
    short = [p for p in prompt_ids(model) if len(p) + N_NEW <= released_configs.INDEX_TOPK][:2]
    assert len(short) == 2
    return [*short, LONG]


def _want(model) -> list[list[int]]:
    """transformers' greedy tokens in float32; a DSA model's long prompt with SGLang's FP8
    indexer logits (transformers' own score in full precision: the top-k boundary moves)."""
    *short, long = _prompts(model)
    want = hf_greedy(model, short, N_NEW, dtype=torch.float32)
    if "index_topk" not in json.loads((model / "config.json").read_text()):
        return want + hf_greedy(model, [long], N_NEW, dtype=torch.float32)
    from glm_dsa_reference import fp8_indexer

    with fp8_indexer():
        return want + hf_greedy(model, [long], N_NEW, dtype=torch.float32)


def _served(srv, prompts: list[list[int]]) -> list[list[int]]:
    import requests

    out = []
    for ids in prompts:
        r = requests.post(
            f"{srv.url}/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True},
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text
        out.append(r.json()["output_ids"])
    return out


def _guarded_clean(srv) -> None:
    """Every step checked, nothing flagged; then the server stops (an idle server left running
    beside the next one's start slows it on a 2-core machine)."""
    srv.wait_idle()
    totals = srv.metric_totals()
    srv.stop(drain=False)
    assert totals.get("kvguard_steps_checked_total", 0) > 0
    assert totals.get("kvguard_violations_total", 0) == 0


@pytest.mark.engine
@pytest.mark.parametrize(
    ("build", "extra"),
    [(released_configs.dsa_yarn, ["--tp", "2"]), (released_configs.kimi_k2, [])],
    ids=["dsa-yarn-tp2", "kimi-k2"],
)
def test_released_config_equals_transformers(serve_processes, build, extra):
    model = build()
    want = _want(model)
    srv = serve_processes(
        ["--model-path", str(model), "--dtype", "float32", "--kv-cache-dtype", "auto",
         "--max-total-tokens", "4096", *extra]
    )  # fmt: skip
    assert _served(srv, _prompts(model)) == want
    _guarded_clean(srv)


@pytest.mark.engine
def test_glm5_released_config_at_defaults(serve_processes):
    import requests

    model = released_configs.glm5()
    srv = serve_processes(["--model-path", str(model)])
    got = _served(srv, _prompts(model))
    assert [len(o) for o in got] == [N_NEW] * 3
    info = requests.get(f"{srv.url}/server_info", timeout=30).json()
    assert info["kv_cache_dtype"] == "fp8_e4m3"
    log = srv.log_tail(200_000)
    assert "model_config_fields_supplied" in log and "indexer_rope_interleave" in log
    _guarded_clean(srv)


def test_fields_transformers_fixes_are_supplied(tmp_path):
    """A GlmMoeDsa config without ``indexer_rope_interleave`` means interleaved (transformers'
    GlmMoeDsa indexer); a key the config has, or another architecture, supplies nothing."""
    from kvguard.serve.preflight import supplied_model_fields

    def config(**fields) -> str:
        path = tmp_path / str(len(list(tmp_path.iterdir())))
        path.mkdir()
        (path / "config.json").write_text(json.dumps(fields))
        return str(path)

    moe = dict(n_routed_experts=8, num_hidden_layers=2, first_k_dense_replace=1)
    routing = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    glm = config(architectures=["GlmMoeDsaForCausalLM"], **moe)
    assert supplied_model_fields(glm) == {**routing, "indexer_rope_interleave": True}
    glm_neox = config(architectures=["GlmMoeDsaForCausalLM"], indexer_rope_interleave=False)
    assert supplied_model_fields(glm_neox) == {}
    v32 = config(architectures=["DeepseekV32ForCausalLM"], **moe, **routing)
    assert supplied_model_fields(v32) == {}  # transformers' DeepseekV32: NeoX, SGLang's default

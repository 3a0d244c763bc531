"""The GLM-5 architecture (GlmMoeDsaForCausalLM: MLA + DeepSeek Sparse Attention indexer + MoE)
served on CPU through patches/dsa_cpu.py, with a tiny random-init checkpoint
(tiny_model.tiny_random_glm_dsa: index_topk 16, page size 64, which DSA requires).

* Up to index_topk tokens every position is selected: SGLang's greedy output equals
  transformers' in float32.
* Past index_topk the selection is the indexer's: SGLang equals transformers whose indexer
  computes SGLang's FP8 logits (glm_dsa_reference.fp8_indexer); its agreement with plain
  transformers (no FP8 in the indexer) is reported. Deterministic across two cold runs and
  through the prefix cache.
* The index-key bytes dsa_cpu.py writes decode, by the note's layout, to the FP8 keys computed
  from transformers' indexer weights.
* FP8 KV (--kv-cache-dtype fp8_e4m3, packed DSA rows) equals transformers reading the latent
  as those rows hold it (glm_dsa_reference.fp8_latent); its distance to float32 KV is reported.

Engines run with the guard in paranoid mode, a violation aborting the request.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
transformers = pytest.importorskip("transformers")

from cpu_engine import cpu_engine  # noqa: E402
from glm_dsa_reference import decode_index_page_bytes, fp8_indexer, fp8_latent  # noqa: E402
from quant_helpers import agreement, sglang_greedy  # noqa: E402
from tiny_model import GLM_INDEX_TOPK, GLM_PAGE_SIZE, tiny_random_glm_dsa  # noqa: E402

N_SHORT = 6  # new tokens after a short prompt: the whole sequence stays within index_topk
N_LONG = 12
SHORT_LENS = (4, GLM_INDEX_TOPK - N_SHORT)
LONG_LENS = (40, 100)  # past index_topk; 100 spans two 64-token pages
# The guard checks every step; a violation aborts the request (its finish reason is not "length")
GUARD = {"KVGUARD_MODE": "paranoid", "KVGUARD_ON_VIOLATION": "abort"}


def dsa_engine(model, kv_cache_dtype: str):
    return cpu_engine(
        model,
        GUARD,
        page_size=GLM_PAGE_SIZE,
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        max_total_tokens=2048,
    )


@pytest.fixture(scope="module")
def model():
    return tiny_random_glm_dsa()


@pytest.fixture(scope="module")
def prompts(model):
    import inspect

    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    ids = tok(inspect.getsource(inspect)[:4000])["input_ids"]
    short = [ids[i * 7 : i * 7 + n] for i, n in enumerate(SHORT_LENS)]
    long = [ids[500 + i * 150 : 500 + i * 150 + n] for i, n in enumerate(LONG_LENS)]
    assert all(len(p) == n for p, n in zip(short + long, SHORT_LENS + LONG_LENS))
    return short, long


@pytest.fixture(scope="module")
def hf_fp32(model):
    return transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()


def hf_greedy(hf, ids: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuations, each step a full forward (no cache)."""
    out = []
    with torch.no_grad():
        for row in ids:
            x = torch.tensor([row])
            for _ in range(n):
                x = torch.cat([x, hf(input_ids=x).logits[0, -1].argmax().view(1, 1)], dim=1)
            out.append(x[0, len(row) :].tolist())
    return out


def forced_logprobs(engine, prompts: list[list[int]], continuations: list[list[int]]):
    """The engine's log-probabilities of ``continuations`` after ``prompts`` (teacher forced)."""
    outs = engine.generate(
        input_ids=[p + c for p, c in zip(prompts, continuations)],
        sampling_params={"temperature": 0, "max_new_tokens": 1},
        return_logprob=True,
        logprob_start_len=[len(p) - 1 for p in prompts],
    )
    return [
        torch.tensor([lp for lp, _tok, _ in o["meta_info"]["input_token_logprobs"][1:]])
        for o in outs
    ]


@pytest.fixture(scope="module")
def served_fp32(model, prompts):
    """One float32 engine: short and long prompts cold, the long ones cold again after a cache
    flush, then once more through the prefix cache; the log-probabilities of its own long
    continuations."""
    short, long = prompts
    with dsa_engine(model, "auto") as engine:
        out = {
            "short": sglang_greedy(engine, short, N_SHORT),
            "long": sglang_greedy(engine, long, N_LONG),
        }
        engine.flush_cache()
        out["long_again"] = sglang_greedy(engine, long, N_LONG)
        out["long_cached"] = sglang_greedy(engine, long, N_LONG)
        out["forced"] = forced_logprobs(engine, long, _ids(out["long"]))
    return out


def _ids(outs: list[dict]) -> list[list[int]]:
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    return [o["output_ids"] for o in outs]


@pytest.mark.engine
def test_within_index_topk_equals_transformers(hf_fp32, prompts, served_fp32):
    short, _ = prompts
    assert _ids(served_fp32["short"]) == hf_greedy(hf_fp32, short, N_SHORT)


@pytest.mark.engine
def test_past_index_topk_equals_transformers_with_fp8_indexer(hf_fp32, prompts, served_fp32):
    _, long = prompts
    got = _ids(served_fp32["long"])
    with fp8_indexer():
        assert got == hf_greedy(hf_fp32, long, N_LONG)
    plain = agreement(got, hf_greedy(hf_fp32, long, N_LONG))
    print(f"agreement with transformers' full-precision indexer: {plain:.3f}")


@pytest.mark.engine
def test_deterministic_and_through_the_prefix_cache(served_fp32):
    got = _ids(served_fp32["long"])
    assert _ids(served_fp32["long_again"]) == got
    cached = served_fp32["long_cached"]
    assert _ids(cached) == got
    # page-aligned hits: every full 64-token page of each prompt came from the cache
    hits = [o["meta_info"]["cached_tokens"] for o in cached]
    assert hits == [n // GLM_PAGE_SIZE * GLM_PAGE_SIZE for n in LONG_LENS], hits


@pytest.mark.engine
def test_fp8_kv_equals_transformers_reading_fp8_rows(model, hf_fp32, prompts, served_fp32):
    """FP8 KV (packed DSA rows): equal to transformers whose attention reads the latent as the
    FP8 rows hold it and whose indexer computes SGLang's FP8 logits; how close to float32 KV is
    reported."""
    short, long = prompts
    with dsa_engine(model, "fp8_e4m3") as engine:
        got_short = _ids(sglang_greedy(engine, short, N_SHORT))
        got_long = _ids(sglang_greedy(engine, long, N_LONG))
        again = _ids(sglang_greedy(engine, long, N_LONG))  # FP8 rows re-read from the cache
        forced = forced_logprobs(engine, long, _ids(served_fp32["long"]))
    assert again == got_long
    with fp8_indexer(), fp8_latent():
        assert got_short == hf_greedy(hf_fp32, short, N_SHORT)
        ref_long = hf_greedy(hf_fp32, long, N_LONG)
    # past index_topk a float rounding difference (absorbed vs expanded MLA) can move a value
    # across an FP8 code boundary and the random model's greedy path with it: measured 19/24
    same_long = agreement(got_long, ref_long)
    assert [g[0] for g in got_long] == [r[0] for r in ref_long] and same_long >= 0.75
    gap = max((a - b).abs().max().item() for a, b in zip(forced, served_fp32["forced"]))
    near_short = agreement(got_short, _ids(served_fp32["short"]))
    near_long = agreement(got_long, _ids(served_fp32["long"]))
    print(
        f"FP8 KV vs its transformers reference: long {same_long:.3f}; vs float32 KV: greedy "
        f"agreement short {near_short:.3f}, long {near_long:.3f}, largest log-probability gap "
        f"on float32's continuation {gap:.4f}"
    )


# -- the index-key bytes (no engine) ------------------------------------------------------------
class _Linear:
    """An nn.Linear called the way SGLang's linear layers are: (output, bias)."""

    def __init__(self, linear):
        self.weight = linear.weight
        self._linear = linear

    def __call__(self, x):
        return self._linear(x), None


def test_index_key_bytes_decode_to_the_reference(model):
    from sglang.srt.layers.rotary_embedding.factory import get_rope
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
        apply_rotary_pos_emb_interleave,
    )

    from kvguard.patches import dsa_cpu

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    hf_ix = hf.model.layers[0].self_attn.indexer
    cfg = hf.config
    rope = cfg.qk_rope_head_dim
    indexer = types.SimpleNamespace(  # the parts of SGLang's Indexer dsa_cpu.py uses
        wq_b=_Linear(hf_ix.wq_b),
        wk=_Linear(hf_ix.wk),
        k_norm=hf_ix.k_norm,
        weights_proj=_Linear(hf_ix.weights_proj),
        rotary_emb=get_rope(rope, rope, 2048, 10000.0, False, None, torch.float32, 1.0),
        rope_head_dim=rope,
        n_heads=cfg.index_n_heads,
        head_dim=cfg.index_head_dim,
        softmax_scale=cfg.index_head_dim**-0.5,
        index_topk=cfg.index_topk,
    )
    hf_ix.weights_proj.to(torch.bfloat16)  # SGLang keeps them bf16
    torch.manual_seed(1)
    n = 70
    x, q_lora = torch.randn(n, cfg.hidden_size), torch.randn(n, cfg.q_lora_rank)
    positions = torch.arange(n)
    buf = _dsa_pool(torch.float32).get_index_k_with_scale_buffer(layer_id=0)  # SGLang's own
    loc = torch.arange(n) + 2 * 64 + 10  # from the middle of page 2 into page 3
    with torch.no_grad():
        key, _query, _w = dsa_cpu.indexer_qkw(indexer, x, q_lora, positions)
        dsa_cpu.store_index_keys(buf, loc, key)
        # reference: transformers' keys, rope pairs back in SGLang's interleaved order
        k = hf_ix.k_norm(hf_ix.wk(x))[None, :, None, :]
        cos, sin = hf.model.rotary_emb(k, positions[None, :])
        _, k_rot = apply_rotary_pos_emb_interleave(
            k[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2
        )
    k_ref = k[0, :, 0].clone()
    k_ref[:, 0:rope:2], k_ref[:, 1:rope:2] = (
        k_rot[0, :, 0, : rope // 2],
        k_rot[0, :, 0, rope // 2 :],
    )
    kb = k_ref.to(torch.bfloat16).float()
    s_ref = kb.abs().amax(-1).clamp_min(1e-4) / 448
    codes_ref = (kb / s_ref[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)

    codes, scales = decode_index_page_bytes(buf, loc)
    torch.testing.assert_close(scales, s_ref, rtol=1e-2, atol=0)
    same = (codes == codes_ref).float().mean().item()
    print(f"index-key FP8 codes equal to the reference: {same:.4f}")
    assert same >= 0.99
    values = codes.view(torch.float8_e4m3fn).float() * scales[:, None]
    torch.testing.assert_close(values, kb, rtol=0.07, atol=2e-3)  # within e4m3's step
    written = torch.zeros(buf.shape[0] * 64, dtype=torch.bool)
    written[loc] = True
    untouched = torch.nonzero(~written).view(-1)
    other_codes, other_scales = decode_index_page_bytes(buf, untouched)
    assert not other_codes.any() and not other_scales.any()  # nothing written elsewhere


def test_fp8_latent_rows_pack_as_sglang_lays_them_out():
    from kvguard.patches import dsa_cpu

    torch.manual_seed(2)
    r, rope = 256, 64
    nope, k_rope = torch.randn(5, r) * 3, torch.randn(5, rope)
    packed = dsa_cpu.pack_fp8_rows(nope, k_rope)
    assert packed.dtype == torch.uint8 and packed.shape == (5, r + r // 128 * 4 + rope * 2)
    scales = packed[:, r : r + 8].contiguous().view(torch.float32)
    torch.testing.assert_close(scales, nope.view(5, 2, 128).abs().amax(-1) / 448)
    rope_back = packed[:, r + 8 :].contiguous().view(torch.bfloat16)
    assert torch.equal(rope_back, k_rope.to(torch.bfloat16))
    rows = dsa_cpu.unpack_fp8_rows(packed, r)
    torch.testing.assert_close(rows[:, :r], nope, rtol=0.07, atol=0)
    assert torch.equal(rows[:, r:], k_rope.to(torch.bfloat16).float())


# -- the pool parts (a real DSATokenToKVPool on CPU, no engine) ----------------------------------
def _dsa_pool(dtype, pages: int = 5):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    r, rope = 128, 64
    return DSATokenToKVPool(
        size=(pages - 1) * 64, page_size=64, kv_lora_rank=r, dtype=dtype, qk_rope_head_dim=rope,
        layer_num=2, device="cpu", index_head_dim=128, enable_memory_saver=False,
        kv_cache_dim=r + rope if dtype != torch.float8_e4m3fn else r + r // 128 * 4 + rope * 2,
        index_buf_size=(pages - 1) * 64,
    )  # fmt: skip


def test_fp8_latent_rows_round_trip_through_a_dsa_pool():
    from kvguard.patches import dsa_cpu

    pool = _dsa_pool(torch.float8_e4m3fn)
    assert pool.dsa_kv_cache_store_fp8 and pool.kv_buffer[0].shape[-1] == 260
    layer = types.SimpleNamespace(layer_id=1)
    torch.manual_seed(3)
    k = torch.randn(10, 1, 192)
    loc = torch.arange(10) * 7 + 64
    dsa_cpu.write_latent(pool, layer, loc, k)
    assert torch.equal(
        pool.kv_buffer[1][loc, 0], dsa_cpu.pack_fp8_rows(k[:, 0, :128], k[:, 0, 128:])
    )
    assert not pool.kv_buffer[0].any()  # the other layer untouched
    rows = dsa_cpu.read_latent(pool, layer, loc)
    torch.testing.assert_close(rows[:, :128], k[:, 0, :128], rtol=0.07, atol=0)
    assert torch.equal(rows[:, 128:], k[:, 0, 128:].to(torch.bfloat16).float())


def test_retraction_offload_of_a_cpu_dsa_pool():
    """SGLang's offload of a retracted request calls torch.cuda.synchronize(), which raises
    without a driver; through dsa_cpu.around_offload it copies the latent rows and the index
    pages out and back."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    from kvguard.patches import dsa_cpu

    pool = _dsa_pool(torch.float8_e4m3fn)
    torch.manual_seed(4)
    for buf in pool.kv_buffer + pool.index_k_with_scale_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    before = [b.clone() for b in pool.kv_buffer + pool.index_k_with_scale_buffer]
    slots = torch.arange(64, 192)  # pages 1 and 2
    get_copy, load_copy = DSATokenToKVPool.get_cpu_copy, DSATokenToKVPool.load_cpu_copy
    get_copy = getattr(get_copy, "__wrapped__", get_copy)  # SGLang's, hooked or not
    load_copy = getattr(load_copy, "__wrapped__", load_copy)
    with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0):
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError):
                get_copy(pool, slots)
        saved = dsa_cpu.around_offload(get_copy, pool, slots)
        for buf in pool.kv_buffer:
            buf[slots] = 0
        for buf in pool.index_k_with_scale_buffer:
            buf[1:3] = 0
        dsa_cpu.around_offload(load_copy, pool, saved, slots)
    for was, now in zip(before, pool.kv_buffer + pool.index_k_with_scale_buffer):
        assert torch.equal(was, now)


def test_cpu_argument_passes():
    from kvguard.patches import dsa_cpu

    def view(kv, prefill=None, decode=None):
        return types.SimpleNamespace(
            kv_cache_dtype=kv, dsa_prefill_backend=prefill, dsa_decode_backend=decode
        )

    assert dsa_cpu.cpu_dsa_kv_cache_dtype(view("auto")) == {}  # the model's dtype
    assert dsa_cpu.cpu_dsa_kv_cache_dtype(view("fp8_e4m3")) == {}
    assert dsa_cpu.cpu_dsa_kv_cache_dtype(view("bf16")) == {"kv_cache_dtype": "bfloat16"}
    with pytest.raises(dsa_cpu.DSAConfigError, match="fp8_e5m2"):
        dsa_cpu.cpu_dsa_kv_cache_dtype(view("fp8_e5m2"))
    assert dsa_cpu.cpu_dsa_backends(view("auto")) == {}
    with pytest.raises(dsa_cpu.DSAConfigError, match="--dsa-decode-backend"):
        dsa_cpu.cpu_dsa_backends(view("auto", decode="flashmla_kv"))


def test_topk_selection_is_causal_and_padded():
    """A token with at most index_topk causal positions selects exactly those (then -1); a later
    token selects the top index_topk of the FP8 logits (glm_dsa_reference's arithmetic)."""
    from glm_dsa_reference import fp8_rows

    from kvguard.patches import dsa_cpu

    torch.manual_seed(5)
    n_keys, heads, topk = 40, 4, 16
    query, weights = torch.randn(n_keys, heads, 128), torch.randn(n_keys, heads)
    k8, s_k = fp8_rows(torch.randn(n_keys, 128).to(torch.bfloat16).float())
    positions = torch.arange(n_keys)
    got = dsa_cpu.select_topk(query, weights, k8, s_k[:, 0], positions, topk)
    assert got.shape == (n_keys, topk) and got.dtype == torch.int32
    for t in range(topk):
        assert got[t].tolist() == list(range(t + 1)) + [-1] * (topk - t - 1)
    q8, s_q = fp8_rows(query)
    logits = torch.einsum("thd,jd->thj", q8, k8).relu()
    logits = torch.einsum("th,thj->tj", weights * s_q[..., 0], logits) * s_k[None, :, 0]
    for t in range(topk, n_keys):
        want = logits[t, : t + 1].topk(topk).indices
        assert sorted(got[t].tolist()) == sorted(want.tolist())


def test_query_tiles_give_the_same_selection_and_attention(monkeypatch):
    """A long prefill chunk over a long context is scored and attended in query tiles (bounded
    temporaries): the result is the untiled one."""
    from glm_dsa_reference import fp8_rows

    from kvguard.patches import dsa_cpu

    torch.manual_seed(6)
    n, heads, topk, dim = 50, 4, 16, 48
    query, weights = torch.randn(n, heads, 128), torch.randn(n, heads)
    k8, s_k = fp8_rows(torch.randn(n, 128).to(torch.bfloat16).float())
    positions = torch.arange(n)
    whole = dsa_cpu.select_topk(query, weights, k8, s_k[:, 0], positions, topk)
    q, rows = torch.randn(n, heads, dim), torch.randn(n, dim)
    attended = dsa_cpu.sparse_mla(q, rows, whole.to(torch.int64), 0.1, 32)
    monkeypatch.setattr(dsa_cpu, "TILE_ELEMENTS", 7 * heads * n)  # tiles of 7 queries
    assert len(list(dsa_cpu._tiles(n, heads * n))) == 8
    assert torch.equal(dsa_cpu.select_topk(query, weights, k8, s_k[:, 0], positions, topk), whole)
    tiled = dsa_cpu.sparse_mla(q, rows, whole.to(torch.int64), 0.1, 32)
    torch.testing.assert_close(tiled, attended, rtol=1e-6, atol=1e-6)

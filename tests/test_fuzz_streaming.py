"""The fuzz oracle scores streamed requests token by token, and injects bit flips inside the
forward (issue text, item 5).

Fast tests: how a stream's chunks are folded into what its client was sent; how the oracle judges
streams (a wrong token sent before an abort is an escape, a victim that completed with the
reference tokens is exposed, tokens computed from wrong KV are counted); the sensitivity of a
guard-off arm; the workload's streaming and long-prompt options; the exponent flip on SGLang's
real pools; and the in-forward flip's wrapper on a stand-in attention backend (fires at its
layer before the layer reads, composes with a wrapper already installed, restores the class).

Campaign tests (``-m campaign``, ~2 and ~1 min on two cores): a streaming campaign with bit
flips before and inside the forward, in kvguard-serve's default mode at page sizes 16 and 1,
healing (recompute, the default), fails on any streamed token that differs from the clean run
(a healed stream's too: no token repeated, missing or changed), on any token computed from wrong
KV that reached a client, a victim that completed unnoticed, or a client error; the same
workload in mode ``tags`` (no checksum at all) must show harm, so that the test can fail. The
second runs the default mode aborting instead (``on_violation`` abort) with read sets past the
sampled budget (a 65,536-token pool, long prompts)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from kvguard.fuzz import kvbytes
from kvguard.fuzz.client import Response, StreamFold
from kvguard.fuzz.injectors import ATTENTION_METHODS, in_forward_flip
from kvguard.fuzz.oracle import classify, compare_stream, injections_from_log
from kvguard.fuzz.report import sensitivity, summarize
from kvguard.fuzz.workload import build_workload


# -- the client: what a stream sent ----------------------------------------------------------------
def _chunk(ids, done=None, top=None, reason=None):
    meta = {"completion_tokens": len(ids) if done is None else done}
    if top is not None:
        meta["output_top_logprobs"] = [[[lp, t, ""], [lp - 1, t + 1, ""]] for lp, t in top]
    if reason is not None:
        meta["finish_reason"] = reason
    return {"output_ids": ids, "meta_info": meta}


def _fold(chunks) -> Response:
    out = Response("r", "k", 0, streamed=True)
    fold = StreamFold(out)
    for c in chunks:
        fold.chunk(c)
    return out


def test_stream_fold_cumulative_chunks():
    """SGLang's default: each chunk repeats every token so far."""
    out = _fold(
        [
            _chunk([5], top=[(-0.1, 5)]),
            _chunk([5, 6, 7], top=[(-0.1, 5), (-0.2, 6), (-0.3, 7)]),
            _chunk([5, 6, 7, 8], top=[(-0.1, 5), (-0.2, 6), (-0.3, 7), (-0.4, 8)]),
        ]
    )
    assert out.stream_ids == [5, 6, 7, 8]
    assert out.stream_chunks == [1, 2, 1]
    assert [t[1] for t in out.stream_top2] == [5, 6, 7, 8]
    assert out.stream_rewrites == []


def test_stream_fold_incremental_chunks_and_an_empty_abort_chunk():
    """--incremental-streaming-output: each chunk has only its new tokens (completion_tokens
    counts them on top); an abort chunk may carry none."""
    out = _fold(
        [
            _chunk([5], done=1, top=[(-0.1, 5)]),
            _chunk([5, 9], done=3, top=[(-0.2, 5), (-0.3, 9)]),  # new: 5, 9 (5 again, as a token)
            _chunk([], done=3, reason={"type": "abort", "message": "x"}),
        ]
    )
    assert out.stream_ids == [5, 5, 9]
    assert out.stream_chunks == [1, 2, 0]
    assert [t[1] for t in out.stream_top2] == [5, 5, 9]


def test_stream_fold_keeps_a_rewritten_position():
    out = _fold([_chunk([5, 6]), _chunk([5, 7, 8])])  # position 1 restated as 7
    assert out.stream_ids == [5, 6, 8]
    assert out.stream_rewrites == [[1, 7]]


# -- the oracle: streams ---------------------------------------------------------------------------
TOP = [[-0.1, 1, -3.0, 0], [-0.1, 2, -3.0, 0], [-0.50, 3, -0.55, 30], [-0.1, 4, -3.0, 0]]
REF = ([1, 2, 3, 4], TOP)


def test_compare_stream():
    assert compare_stream(REF, ([1, 2], TOP[:2]))[0] == "clean"  # a prefix, before an abort
    outcome, where = compare_stream(REF, ([1, 9], [TOP[0], [-0.1, 9, -3.0, 0]]))
    assert outcome == "escaped" and where["first_diff"] == 1
    tie = [TOP[0], TOP[1], [-0.52, 30, -0.54, 3]]
    assert compare_stream(REF, ([1, 2, 30], tie))[0] == "near_tie"
    assert compare_stream(REF, ([1, 2, 3, 4, 5], TOP + [None]))[0] == "escaped"  # past the end
    partial = ([1, 2], TOP[:2])  # what the clean pass's stream was sent before its client left
    assert compare_stream(partial, ([1, 2, 3], TOP[:3]), ref_complete=False)[0] == "clean"
    assert compare_stream(REF, ([1, 2], TOP[:2]), rewrites=[[1, 7]])[0] == "escaped"


def _stream(rid, ids, end, violation=None, client_abort=False, top=None):
    return Response(
        f"i-{rid}",
        rid,
        1,
        status=200,
        output_ids=list(ids),
        top2=top,
        violation=violation,
        error=None if violation is None else f"KV cache integrity violation {violation}",
        client_abort=client_abort,
        streamed=True,
        stream_ids=list(ids),
        stream_top2=top or [None] * len(ids),
        stream_end=end,
    )


def test_oracle_scores_streams_token_by_token():
    ref = {k: REF for k in "abcdefgh"}
    partial = {"f": ([1, 2], TOP[:2]), "g": ([1, 2], TOP[:2])}
    wrong_top = [TOP[0], [-0.1, 9, -3.0, 0]]
    responses = [
        _stream("a", [1, 9], "abort", "kvg-1", top=wrong_top),  # wrong token, then aborted
        _stream("b", [1, 2], "abort", "kvg-2"),  # aborted, every token sent right
        _stream("c", [1, 2, 30], "abort", "kvg-3", top=[TOP[0], TOP[1], [-0.52, 30, -0.54, 3]]),
        _stream("d", [1, 2, 3, 4], "done"),  # victim, completed with the reference: exposed
        _stream("e", [1, 2, 3], "cut"),  # the server went away mid-stream
        _stream("f", [1, 9], "dropped", client_abort=True, top=wrong_top),
        _stream("g", [1, 2], "dropped", client_abort=True),
        _stream("h", [1, 9, 3, 4], "done", top=[TOP[0], [-0.1, 9, -3.0, 0], TOP[2], TOP[3]]),
    ]
    events = [
        {
            "event": "injected",
            "id": 1,
            "cls": "in_forward_flip",
            "at_step": 10,
            "victims": ["i-a", "i-b", "i-c", "i-d"],
            "read_at": {"i-a": 1, "i-b": 2, "i-c": 2, "i-d": 1},
        },
        {"event": "fired", "id": 1, "cls": "in_forward_flip", "at_step": 10, "victims": []},
        {"event": "injected", "id": 2, "cls": "exponent_flip", "at_step": 11, "victims": ["i-f"]},
        {"event": "injected", "id": 3, "cls": "in_forward_flip", "at_step": 12, "victims": []},
        {"event": "unfired", "id": 3, "cls": "in_forward_flip", "at_step": 12},
        {"event": "victims", "id": 3, "cls": "in_forward_flip", "at_step": 13, "victims": ["i-h"]},
    ]
    planned = [
        {"id": 1, "cls": "in_forward_flip"},
        {"id": 2, "cls": "exponent_flip"},
        {"id": 3, "cls": "in_forward_flip"},
    ]
    injections = injections_from_log(events, planned)
    records, injections = classify(ref, responses, injections, {}, partial=partial)
    by = {r["key"]: r for r in records}
    assert {k: r["outcome"] for k, r in by.items()} == {
        "a": "escaped",  # a streamed escape: the abort came after the wrong token went out
        "b": "detected",
        "c": "detected",  # first differs at a near tie: judged by how it ended
        "d": "exposed",
        "e": "error",
        "f": "escaped",  # its client dropped it, after a wrong token (the clean drop's reference)
        "g": "client_abort",
        "h": "escaped",  # no victim (injection 3 never fired): an unattributed escape
    }
    assert by["a"]["streamed_escape"] and by["a"]["guard_aborted"] and by["a"]["first_diff"] == 1
    assert by["c"]["stream_near_tie"] == 2 and "streamed_escape" not in by["c"]
    # tokens that reached the client although computed from wrong KV
    assert [by[k]["tokens_from_wrong_kv"] for k in "abcd"] == [1, 0, 1, 3]
    assert injections[1]["outcome"] == "escaped"  # a victim escaped: escape wins over detected
    assert injections[2]["outcome"] == "escaped"
    assert injections[3]["outcome"] == "not_landed" and injections[3]["victims"] == {}
    cfg = {"requests": records, "injections": list(injections.values())}
    s = summarize(cfg)
    assert s["streamed_escapes"] == 3 and s["streamed_escapes_aborted"] == 1
    assert s["streamed_escapes_dropped"] == 1 and s["requests"]["exposed"] == 1
    assert s["tokens_from_wrong_kv"] == 5 and s["requests_sent_tokens_from_wrong_kv"] == 3


def test_sensitivity_of_the_off_arm():
    def cfg(mode, escaped, exposed, victims_escaped):
        return {
            "mode": mode,
            "page_size": 16,
            "summary": {
                "injections": {"escaped": escaped, "exposed": exposed, "detected": 0},
                "victims_scored": escaped + exposed,
                "escapes_from_victims": victims_escaped,
                "streamed_escapes": victims_escaped,
            },
        }

    sens = sensitivity([cfg("default", 0, 0, 0), cfg("off", 2, 6, 2)])
    assert sens["off_arm"]["escape_rate"] == 0.25 and sens["off_arm"]["measuring"]
    assert sens["configs"]["default-ps16"]["injection_escape_rate"] is None
    assert not sensitivity([cfg("off", 0, 8, 0)])["off_arm"]["measuring"]
    assert "off_arm" not in sensitivity([cfg("default", 0, 0, 0)])


def test_cli_settings_for_a_streaming_campaign():
    from kvguard.fuzz.cli import clamp_long_tokens, parser, settings_from

    argv = "--guard-mode default --page-size 16,1 --off-arm --stream --large-reads"
    s = settings_from(parser().parse_args(argv.split()))
    assert s.configs == (("default", 16), ("default", 1), ("off", 16), ("off", 1))
    assert s.stream_fraction == 1.0 and s.long_fraction == 0.25
    assert (s.max_total_tokens, s.chunked_prefill_size, s.long_tokens) == (65536, 512, (1500, 3000))
    plain = settings_from(parser().parse_args(["--stream", "0.5", "--max-total-tokens", "4096"]))
    assert plain.stream_fraction == 0.5 and plain.long_fraction == 0.0
    assert (plain.max_total_tokens, plain.chunked_prefill_size) == (4096, 64)
    assert clamp_long_tokens((1500, 3000), 2048) == (1500, 1984)  # room for 32 output tokens
    assert clamp_long_tokens((1500, 3000), 1024) == (960, 960)
    assert clamp_long_tokens((1500, 3000), None) == (1500, 3000)


# -- the workload ------------------------------------------------------------------------------------
def test_workload_streams_and_long_prompts():
    def count(text):
        return len(text) // 3

    plain = [r for w in build_workload(4, 120, 24) for r in w.requests]
    waves = build_workload(
        4, 120, 24, stream_fraction=0.5, long_fraction=0.25, long_tokens=(600, 900),
        count_tokens=count,
    )  # fmt: skip
    reqs = [r for w in waves for r in w.requests]
    assert 30 < sum(r.stream for r in reqs) < 90
    assert all(r.streamed for r in reqs if r.cancel_after_chunks is not None)
    longs = [r for r in reqs if r.long]
    assert 15 < len(longs) < 50
    assert all(600 - 50 <= count(r.text) <= 900 for r in longs)
    same = [a.text == b.text for a, b in zip(reqs, plain) if not a.long]
    assert all(same)  # every other request is the seed's
    everything = [r for w in build_workload(4, 120, 24, stream_fraction=1.0) for r in w.requests]
    assert all(r.streamed for r in everything)


# -- the flips -------------------------------------------------------------------------------------
def _mha(dtype, layers=3):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(
        size=64,
        page_size=16,
        dtype=dtype,
        head_num=2,
        head_dim=8,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
    )
    gen = torch.Generator().manual_seed(0)
    for b in kvbytes.kv_buffers(pool):
        b.copy_((torch.randn(b.shape, generator=gen) * 0.5).to(b.dtype))
    return pool


def _mla(dtype):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    pool = MLATokenToKVPool(
        size=64,
        page_size=16,
        dtype=dtype,
        kv_lora_rank=8,
        qk_rope_head_dim=8,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )
    gen = torch.Generator().manual_seed(0)
    for b in kvbytes.kv_buffers(pool):
        b.copy_((torch.randn(b.shape, generator=gen) * 0.5).to(b.dtype))
    return pool


@pytest.mark.parametrize(
    "make, name",
    [
        (lambda: _mha(torch.bfloat16), "k"),
        (lambda: _mha(torch.float8_e4m3fn), "k"),
        (lambda: _mha(torch.float8_e4m3fn), "v"),
        (lambda: _mla(torch.bfloat16), "kv"),
    ],
    ids=["mha-bf16-k", "mha-fp8-k", "mha-fp8-v", "mla-bf16"],
)
def test_flip_exponent_one_bit_worst_element(make, name):
    pool = make()
    buf = kvbytes.layer_buffers(pool, 1)[name]
    assert kvbytes.num_layers(pool) == 3
    before = buf.clone()
    where = kvbytes.flip_exponent(buf, 5)
    diff = buf.view(torch.uint8) != before.view(torch.uint8)
    assert int(diff.sum()) == 1 and bool(diff[5].any())  # one byte of slot 5 only
    flipped = (buf.view(torch.uint8) ^ before.view(torch.uint8))[diff]
    assert int(flipped) == 0x40  # its highest exponent bit
    old, new = where["value"]
    assert abs(new) > 100 * abs(old) and torch.isfinite(torch.tensor(new))
    # aimed: the element whose change raises the reader's logit most
    buf.copy_(before)
    gain = torch.randn(before[5].shape, generator=torch.Generator().manual_seed(1))
    where = kvbytes.flip_exponent(buf, 5, gain)
    vals = before[5].to(torch.float32).reshape(-1)
    elem = where["element"]
    effect = gain.reshape(-1)[elem] * (where["value"][1] - vals[elem])
    assert effect > 0


class _Backend:
    """A stand-in attention backend: records, per layer, the byte its read of the slot saw."""

    def __init__(self, pool, slot):
        self.pool, self.slot, self.seen = pool, slot, {}

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        raw = self.pool.k_buffer[layer.layer_id].view(torch.uint8)[self.slot].clone()
        rawv = self.pool.v_buffer[layer.layer_id].view(torch.uint8)[self.slot].clone()
        self.seen[layer.layer_id] = (raw, rawv)
        return q

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return q


class _SubBackend(_Backend):
    """Its forward methods are inherited: the wrapper must not leave a class attribute behind."""


def _sched(backend_cls, pool, layers):
    row = torch.arange(0, 64, dtype=torch.int32).reshape(1, 64)  # request row 0 -> slots 0..63
    req = SimpleNamespace(
        rid="victim",
        kv=SimpleNamespace(req_pool_idx=0, kv_committed_len=40, holds_kv=True),
        origin_input_ids=list(range(30)),
        output_ids=[1] * 10,
        finished=lambda: False,
    )
    mode = SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)
    batch = SimpleNamespace(reqs=[req], forward_mode=mode)
    backend = backend_cls(pool, slot=None)
    sched = SimpleNamespace(
        tp_worker=SimpleNamespace(
            model_runner=SimpleNamespace(token_to_kv_pool=pool, attn_backend=backend)
        ),
        req_to_token_pool=SimpleNamespace(req_to_token=row),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=16),
    )
    return sched, batch, backend, req


def _forward(backend, layers, req):
    fb = SimpleNamespace(
        req_pool_indices=torch.tensor([req.kv.req_pool_idx]),
        forward_mode=SimpleNamespace(is_decode=lambda: True),
    )
    q = torch.randn(1, 2 * 8)
    for lid in range(layers):
        layer = SimpleNamespace(layer_id=lid, tp_q_head_num=2, tp_k_head_num=2, qk_head_dim=8)
        backend.forward_decode(q, None, None, layer, fb)


@pytest.mark.parametrize("backend_cls", [_Backend, _SubBackend])
def test_in_forward_flip_lands_before_its_layer_reads(backend_cls):
    layers = 4
    pool = _mha(torch.float8_e4m3fn, layers)
    sched, batch, backend, req = _sched(backend_cls, pool, layers)
    own = {m: backend_cls.__dict__.get(m) for m in ATTENTION_METHODS}
    calls = []
    installed = backend_cls.forward_decode  # a wrapper already there (kvguard's, say)

    def outer(self, *a, **kw):
        calls.append(a[3].layer_id)
        return installed(self, *a, **kw)

    backend_cls.forward_decode = outer
    try:
        for seed in range(40):  # draws: K or V, layer L, L's own buffer or an earlier one
            inj = None
            for step in range(20):
                inj = in_forward_flip(sched, batch, random.Random(seed * 100 + step), step)
                if inj is not None:
                    break
            assert inj is not None
            d = inj.detail
            backend.slot = d["slot"]
            before = kvbytes.snapshot(pool, torch.tensor([d["slot"]]))
            calls.clear()
            _forward(backend, layers, req)
            inj.disarm()
            assert d["fired"] and d["at_layer"] >= 1 and d["layer"] <= d["at_layer"]
            assert calls == list(range(layers))  # the installed wrapper ran, inside ours
            assert backend_cls.forward_decode is outer  # restored as found
            which = 0 if d["buffer"] == "k" else 1
            seen = backend.seen[d["layer"]][which]
            pre = before[2 * d["layer"] + which][0].view(torch.uint8).reshape(-1)
            changed = bool((seen.reshape(-1) != pre).any())
            # layer L reads the flip in this forward; an earlier layer read the slot before it
            assert changed == (d["layer"] == d["at_layer"]), d
            after = kvbytes.snapshot(pool, torch.tensor([d["slot"]]))
            diff = sum(
                int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                for a, b in zip(after, before)
            )
            assert diff == 1  # one byte of one buffer, in the pool
            if d["layer"] < d["at_layer"]:  # its readers this step read it intact
                assert inj.watch.transient
    finally:
        del backend_cls.forward_decode
        if own["forward_decode"] is not None:
            backend_cls.forward_decode = own["forward_decode"]
    assert {m: backend_cls.__dict__.get(m) for m in ATTENTION_METHODS} == own


def test_in_forward_flip_that_never_fires_restores_the_class():
    pool = _mha(torch.float8_e4m3fn, 2)
    sched, batch, _, _ = _sched(_SubBackend, pool, 2)
    inj = in_forward_flip(sched, batch, random.Random(3), 1)
    assert "forward_decode" in _SubBackend.__dict__  # armed on the class itself
    inj.disarm()  # no forward ran
    assert not inj.detail["fired"]
    assert "forward_decode" not in _SubBackend.__dict__ and "forward_extend" not in (
        _SubBackend.__dict__
    )


# -- the campaign ------------------------------------------------------------------------------------
FLIPS = ("exponent_flip", "in_forward_flip", "bit_flip")


def _streaming_campaign(tmp_path, **kw) -> tuple[dict, str]:
    from tiny_model import serving_model

    from kvguard.fuzz.campaign import Settings
    from kvguard.fuzz.cli import run_campaign

    model, _ = serving_model()
    settings = {
        "classes": FLIPS,
        "num_requests": 48,
        "num_injections": 9,
        "out": tmp_path,
        "model_path": str(model),
        "wave_size": 12,
        "max_tries": 40,
        "stream_fraction": 1.0,
        **kw,
    }
    settings.setdefault("modes", tuple(dict.fromkeys(m for m, _ in settings["configs"])))
    settings.setdefault("page_sizes", tuple(dict.fromkeys(p for _, p in settings["configs"])))
    run_campaign(Settings(**settings), progress=False)
    report = json.loads((tmp_path / "report.json").read_text())
    configs = {f"{c['mode']}-ps{c['page_size']}": c for c in report["configs"]}
    return configs, f"see {tmp_path / 'report.md'}"


def _no_streamed_harm(cfg: dict, where: str) -> None:
    """No token a client was sent differs from the clean run's, none was computed from wrong
    KV, no victim went unnoticed; and everything ``_no_harm`` asks of a guarded configuration."""
    from test_fuzz_campaign import _no_harm

    summary = cfg["summary"]
    streamed = [r for r in cfg["requests"] if r.get("streamed_escape")]
    assert summary["streamed_escapes"] == 0, (streamed[:5], where)
    wrong = [r for r in cfg["requests"] if r.get("tokens_from_wrong_kv")]
    assert summary["tokens_from_wrong_kv"] == 0, (wrong[:5], where)
    exposed = [r for r in cfg["requests"] if r["outcome"] == "exposed"]
    assert summary["requests"]["exposed"] == 0, (exposed[:5], where)
    _no_harm(cfg, where)
    assert summary["streamed_requests"] > 30, where
    flips = summary["by_class"].get("in_forward_flip", {})
    assert flips.get("detected", 0) + flips.get("recomputed", 0) >= 1, (summary["by_class"], where)


@pytest.mark.campaign
def test_streaming_campaign_no_streamed_escape(tmp_path):
    """Streamed requests, bit flips before and inside the forward, kvguard-serve's default mode
    at page sizes 16 and 1: no token a client is sent may differ from the clean run's (even
    one the guard aborts afterwards), none may have been computed from wrong KV; and in mode
    tags (tags only, no checksum) the same flips must harm, or the campaign measured nothing."""
    configs, where = _streaming_campaign(
        tmp_path, seed=31, configs=(("default", 16), ("default", 1), ("tags", 16))
    )
    from test_fuzz_campaign import _healed

    for name in ("default-ps16", "default-ps1"):
        _no_streamed_harm(configs[name], f"{name}: {where}")
        _healed(configs[name], f"{name}: {where}", FLIPS)
    tags = configs["tags-ps16"]["summary"]
    assert tags["tokens_from_wrong_kv"] > 0 and (
        tags["requests"]["escaped"] + tags["requests"]["exposed"] > 0
    ), (tags["by_class"], where)


@pytest.mark.campaign
def test_streaming_campaign_large_reads(tmp_path):
    """The same with read sets past the sampled budget: a 65,536-token pool and a quarter of
    the prompts 1,500-3,000 tokens long (context 4,096), default mode, page size 16, the guard
    aborting instead of healing: every flagged victim aborted, none recomputed."""
    configs, where = _streaming_campaign(
        tmp_path,
        seed=32,
        configs=(("default", 16),),
        max_total_tokens=65536,
        chunked_prefill_size=512,
        long_fraction=0.25,
        long_tokens=(1500, 3000),
        context_length=4096,
        on_violation="abort",
    )
    cfg = configs["default-ps16"]
    _no_streamed_harm(cfg, where)
    assert cfg["on_violation"] == "abort", where
    assert cfg["summary"]["requests_recomputed"] == 0, (cfg["summary"]["aborts_by_class"], where)
    assert cfg["summary"]["requests"]["detected"] >= 1, (cfg["summary"]["by_class"], where)
    reads = cfg["summary"]["read_sets"]
    assert reads["max"] > 2048 and reads["over_512"] > reads["steps"] // 4, (reads, where)

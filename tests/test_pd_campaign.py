"""The PD campaign (fuzz/pd_campaign.py) and what its SGLang-checksum arm rests on: the host
Adler-32 that stands in for SGLang's CUDA kernel on CPU (patches/pd_cpu.py), the campaign's
scoring, and a short campaign on a real pair (campaign tier)."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace

import pytest
import torch

from kvguard.fuzz import pd_campaign
from kvguard.fuzz.client import Response
from kvguard.patches import pd_cpu


def _computer(buffers: list[torch.Tensor]) -> SimpleNamespace:
    """SGLang's KvChecksumComputer's fields for ``buffers`` (one page per row)."""
    return SimpleNamespace(
        _kv_data_ptrs=[b.data_ptr() for b in buffers],
        _kv_item_lens=[b[0].numel() * b.element_size() for b in buffers],
        _state_data_ptrs=[],
        _state_item_lens=[],
    )


def test_host_adler32_is_adler32_of_the_selected_pages_buffer_by_buffer() -> None:
    """The CUDA kernel's contract (sglang/kernels/ops/memory/adler32.py): Adler-32 over the
    selected items of every buffer, buffers in order, items in index order; on the host the
    same over the same bytes. A byte changed in a selected page changes it; one elsewhere not."""
    g = torch.Generator().manual_seed(0)
    k = torch.randint(-128, 127, (8, 64), dtype=torch.int8, generator=g).view(torch.int8)
    v = torch.randn(8, 32, generator=g).to(torch.bfloat16)
    pages = torch.tensor([5, 1, 3])
    want = zlib.adler32(
        b"".join(k[i].numpy().tobytes() for i in pages.tolist())
        + b"".join(v[i].view(torch.int16).numpy().tobytes() for i in pages.tolist())
    )
    comp = _computer([k, v])
    never = lambda *a: pytest.fail("the CUDA path on host indices")
    assert pd_cpu.around_kv_checksum(never, comp, pages) == want
    v.view(torch.int16)[2, 0] ^= 1  # page 2 is not sent
    assert pd_cpu.around_kv_checksum(never, comp, pages) == want
    v.view(torch.int16)[3, 7] ^= 1
    assert pd_cpu.around_kv_checksum(never, comp, pages) != want
    assert pd_cpu.adler32_items([], [], []) == 1  # nothing selected: the kernel answers 1


def _resp(rid: str, ids: list[int] | None, status: int = 200, **kw) -> Response:
    r = Response(rid=rid, key=rid.split("-", 1)[1], wave=0, status=status, output_ids=ids, **kw)
    r.top2 = [[-0.1, t, -3.0, t + 1] for t in ids or []]
    return r


def test_judge_scores_victims_holders_bystanders_and_escapes() -> None:
    clean = [_resp(f"c-{i}", [1, 2, 3]) for i in range(5)]
    abort = {"status": 500, "error": "KV cache integrity violation kvg-1-2", "violation": "kvg-1-2"}
    injected = [
        _resp("i-0", None, **abort),  # victim, aborted
        _resp("i-1", [1, 2, 3]),  # victim served: wrong KV, whatever its tokens
        _resp("i-2", None, **abort),  # the holder of the page a transfer reached, aborted
        _resp("i-3", None, status=500, error="KV checksum mismatch"),  # touched by nothing
        _resp("i-4", [1, 9, 3]),  # a wrong token served
    ]
    events = [
        {"event": "injected", "cls": "transfer_truncated", "detail": {"rid": "i-0"}},
        {"event": "injected", "cls": "transfer_misdirected", "detail": {"rid": "i-1"}},
        {"event": "armed", "id": 3},
    ]
    events[0]["detail"].update(holder_rid="i-2")
    got = pd_campaign.judge(clean, injected, events)
    assert got["injections_landed"] == 2 and got["victims"] == 2 and got["holders"] == 1
    assert got["victims_aborted"] == 1 and got["victims_served"] == ["i-1"]
    assert got["holders_aborted"] == 1
    assert got["false_aborts"] == ["i-3"]
    assert [e["rid"] for e in got["escapes"]] == ["i-4"]
    assert got["aborted_by"] == {"kvguard": 2, "sglang-checksum": 1}
    assert got["clean_aborts"] == []


def test_workload_plans_every_injection_and_drops_no_stream(tmp_path) -> None:
    s = pd_campaign.Settings(tmp_path, num_requests=24, num_injections=5)
    waves = pd_campaign.workload(s)
    entries = [e for w in waves for e in w.injections]
    assert sorted(e["id"] for e in entries) == [1, 2, 3, 4, 5]
    assert {e["cls"] for e in entries} == set(s.classes)
    specs = [r for w in waves for r in w.requests]
    assert len(specs) == 24 and all(r.cancel_after_chunks is None for r in specs)
    assert any(r.stream for r in specs) and not all(r.stream for r in specs)


@pytest.mark.campaign
def test_pd_campaign_guarded_and_sglang_checksum(tmp_path) -> None:
    """A short campaign on a real pair, two arms: the guard on both servers catches every
    hand-off fault (no victim served, nothing changed reached a client, no false abort, servers
    alive); SGLang's checksum, on the same schedule, catches the faults in a request's own pages
    too. Which requests a transfer reaches besides its own depends on timing: docs/pd.md has a
    full campaign's comparison."""
    s = pd_campaign.Settings(
        tmp_path, num_requests=16, num_injections=6, arms=("verified", "sglang-checksum")
    )
    results = [pd_campaign.run_arm(s, arm, pd_campaign.workload(s)) for arm in s.arms]
    (tmp_path / "report.json").write_text(json.dumps(results, default=str))
    guarded, checksum = results
    for r in results:
        assert r.get("alive") and "error" not in r, r
        # misdirected and truncated fit any transfer of two pages; the classes that reach
        # another request need one running or in flight at the time (not every run has one)
        landed = r["landed_by_class"]
        assert landed["transfer_misdirected"] == landed["transfer_truncated"] == 2, r
        assert r["injector_errors"] == 0, r
        assert r["clean_aborts"] == [] and r["false_aborts"] == [], r
        assert r["victims_aborted"] == r["victims"] and r["victims_served"] == [], r
    assert guarded["escapes"] == [] and guarded["changed_served"] == [], guarded
    assert set(guarded["aborted_by"]) == {"kvguard"}, guarded
    assert set(checksum["aborted_by"]) == {"sglang-checksum"}, checksum

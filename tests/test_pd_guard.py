"""The guard on both servers of a prefill/decode pair (docs/pd.md, "Guarding the pair"), in the
default mode (verified): greedy outputs through the pair equal a single server's and nothing is
flagged; on the decode server a transfer is a writer the guard checks, so a byte of transferred KV
changed after it landed and before its first read is caught, for that request only.

The decode server runs with kvguard's test switch ``KVGUARD_TEST_PD_FLIP_ROOM`` (patches/pd_guard.py):
one byte of the request with that bootstrap room is flipped right after its transfer landed and
was sealed. ``KVGUARD_TEST_PD_FLIP_IN_FLIGHT_ROOM`` flips one before the seal, as bytes changed in
flight land: the decode server's seal of them then differs from the prefill's seal, which came in
the request's metadata row. Those requests are routed by hand (the room is the client's); the
router's requests pick random rooms and are never touched.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from pd_servers import (
    MAX_NEW_TOKENS,
    PROMPTS,
    PDPair,
    assert_pair_serves_the_single_server_s_outputs,
    generate,
    violations,
)

from kvguard.serve.child import ServerDied

FLIP_ROOM = 4_242_424_242
FLIP_IN_FLIGHT_ROOM = 4_242_424_243


@dataclass
class GuardedPair:
    """The module's one pair, guarded, with its runtime switches: the decode server's fault
    plan (``control``, ``fuzz_log``: fuzz/plugin.py) and each server's mode file (the mode
    switches at a flush), so guard off and guard on share one start."""

    pair: PDPair
    control: Path
    fuzz_log: Path
    mode_files: dict[str, Path]

    def set_mode(self, mode: str, servers: tuple[str, ...] = ("prefill", "decode")) -> None:
        for name in servers:
            self.mode_files[name].write_text(mode)
            assert getattr(self.pair, name).flush_cache()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardedPair]:
    root = tmp_path_factory.mktemp("pd-guard")
    control, fuzz_log = root / "control.json", root / "fuzz.jsonl"
    control.write_text(json.dumps({"plan": []}))
    modes = {name: root / f"{name}.mode" for name in ("prefill", "decode")}
    for path in modes.values():
        path.write_text("verified")
    pair = PDPair(
        root,
        kvguard_mode=None,  # kvguard-serve's default: verified
        prefill_env={"KVGUARD_MODE_FILE": str(modes["prefill"])},
        decode_env={
            "KVGUARD_TEST_PD_FLIP_ROOM": str(FLIP_ROOM),
            "KVGUARD_TEST_PD_FLIP_IN_FLIGHT_ROOM": str(FLIP_IN_FLIGHT_ROOM),
            "KVGUARD_FUZZ_CONTROL": str(control),
            "KVGUARD_FUZZ_LOG": str(fuzz_log),
            "KVGUARD_MODE_FILE": str(modes["decode"]),
        },
    )
    try:
        pair.start()
    except ServerDied as exc:
        pair.stop()
        pytest.fail(str(exc))
    yield GuardedPair(pair, control, fuzz_log, modes)
    pair.stop()


@pytest.fixture
def guarded_pair(guarded: GuardedPair) -> Iterator[PDPair]:
    """The shared pair, guarded (verified) on both servers, as every test finds it."""
    yield guarded.pair
    for name, path in guarded.mode_files.items():
        if path.read_text() != "verified":
            guarded.set_mode("verified", (name,))


def _guard_reports(url: str) -> list[dict]:
    info = requests.get(f"{url}/server_info", timeout=30).json()
    reports = info.get("kvguard")
    assert reports, f"{url}: no kvguard report in /server_info"
    return reports if isinstance(reports, list) else [reports]


@pytest.mark.engine
def test_guarded_pair_serves_a_single_server_s_outputs(guarded_pair: PDPair) -> None:
    pair = guarded_pair
    for server in (pair.prefill, pair.decode):
        assert all(r["mode"] == "verified" for r in _guard_reports(server.url))
    before = violations(pair)
    assert_pair_serves_the_single_server_s_outputs(pair)
    for server in (pair.prefill, pair.decode):
        server.wait_idle()
    assert violations(pair) == before, "a clean run through the guarded pair was flagged"
    for server in (pair.prefill, pair.decode):
        totals = server.metric_totals()
        assert totals.get("kvguard_steps_checked_total", 0) > 0, server.url
        assert totals.get("kvguard_unchecked_forwards_total", 0) == 0, server.url
        assert totals.get("kvguard_internal_errors_total", 0) == 0, server.url


@pytest.mark.engine
def test_pair_with_the_guard_off_serves_a_single_server_s_outputs(
    guarded: GuardedPair, guarded_pair: PDPair
) -> None:
    """The CPU prefill/decode path itself (patches/pd_cpu.py), the guard switched off on both
    servers: what test_pd_pair.py's transfer test moves byte for byte serves a whole model."""
    guarded.set_mode("off")
    assert_pair_serves_the_single_server_s_outputs(guarded.pair)


def _by_hand(pair: PDPair, prompt: str, room: int, **fields: object) -> requests.Response:
    """Route one request by hand (docs/pd.md): the same body, with the bootstrap fields, posted
    to both servers at once; the decode server's answer is the completion. ``fields``: more of
    the request's JSON body."""
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pair.bootstrap_port,
        "bootstrap_room": room,
        **fields,
    }
    with ThreadPoolExecutor(2) as pool:
        pre = pool.submit(requests.post, f"{pair.prefill.url}/generate", json=body, timeout=180)
        dec = pool.submit(requests.post, f"{pair.decode.url}/generate", json=body, timeout=180)
        pre.result()
        return dec.result()


@pytest.mark.engine
@pytest.mark.parametrize(
    ("room", "kind"), [(FLIP_ROOM, "read_mismatch"), (FLIP_IN_FLIGHT_ROOM, "transfer_mismatch")]
)
def test_transferred_kv_changed_before_its_first_read_flags_only_its_request(
    guarded_pair: PDPair, room: int, kind: str
) -> None:
    """After it landed (caught at its first read, by the decode server's own seal) or in flight
    (caught as it lands, against the prefill's seal)."""
    pair = guarded_pair
    clean_prompt = PROMPTS[1]
    expected = generate(pair.single.url, clean_prompt)
    before = pair.decode.metric_totals()
    prefill_before = violations(pair)[0]
    with ThreadPoolExecutor(2) as pool:
        clean = pool.submit(generate, pair.router.url, clean_prompt)
        flipped = _by_hand(pair, PROMPTS[2], room)
        clean_out = clean.result()
    assert "KV cache integrity violation" in flipped.text, (flipped.status_code, flipped.text[:500])
    assert flipped.status_code != 200
    assert clean_out["output_ids"] == expected["output_ids"]
    pair.decode.wait_idle()
    after = pair.decode.metric_totals()
    assert after["kvguard_violations_total"] - before.get("kvguard_violations_total", 0) >= 1
    assert after["kvguard_requests_aborted_total"] - before.get(
        "kvguard_requests_aborted_total", 0
    ) == 1  # fmt: skip
    assert violations(pair)[0] == prefill_before  # the prefill sent intact KV
    log = pair.decode.log_tail(200_000)
    assert "kvguard_test_flip" in log and kind in log
    assert "kvguard_transfer_unsealed" not in log  # every transfer came with the prefill's seal
    # both servers go on serving, guarded
    assert (
        generate(pair.router.url, PROMPTS[0])["output_ids"]
        == (generate(pair.single.url, PROMPTS[0])["output_ids"])
    )
    assert pair.prefill.running() and pair.decode.running()


@pytest.mark.engine
def test_transfers_misdirected_or_truncated_are_caught_by_the_prefill_s_seal(
    guarded: GuardedPair, guarded_pair: PDPair
) -> None:
    """The fuzz tool's PD classes (fuzz/pd_faults.py), through SGLang's real transfer path: the
    destination pages the decode server sends the prefill name one page twice (two pages'
    KV land in one page's slots, the other keeps what it held) or lose their last page (the prefill sends fewer
    pages than it holds). Ownership sees nothing wrong; the bytes that land do not match the
    prefill's seal: each such request is aborted, and the next one is served."""
    pair, control, fuzz_log = guarded_pair, guarded.control, guarded.fuzz_log
    classes = ["transfer_misdirected", "transfer_truncated"]
    expected = generate(pair.single.url, PROMPTS[2])
    mismatches = pair.decode.log_tail(1_000_000).count("transfer_mismatch")
    plan: list[dict] = []
    for i, cls in enumerate(classes):
        plan.append({"id": i + 1, "cls": cls})
        control.write_text(json.dumps({"plan": plan}))
        room = 4_242_424_250 + i
        hit = _by_hand(pair, PROMPTS[2], room)
        assert hit.status_code != 200, (cls, hit.text[:300])
        assert "KV cache integrity violation" in hit.text, (cls, hit.text[:300])
        events = [json.loads(line) for line in fuzz_log.read_text().splitlines()]
        injected = [e for e in events if e["event"] == "injected" and e["cls"] == cls]
        assert [e["detail"]["room"] for e in injected] == [room], events
    pair.decode.wait_idle()
    caught = pair.decode.log_tail(1_000_000).count("transfer_mismatch") - mismatches
    assert caught >= len(classes), caught
    assert generate(pair.router.url, PROMPTS[2])["output_ids"] == expected["output_ids"]
    assert violations(pair)[0] == 0  # the prefill sent intact KV
    # the fault is real: with the decode server's guard off the request is answered from the
    # misplaced KV (the tiny model's greedy tokens may survive it; its logprobs do not)
    guarded.set_mode("off", ("decode",))

    def logprobs(room: int) -> list[float]:
        r = _by_hand(pair, PROMPTS[2], room, return_logprob=True)
        assert r.status_code == 200, r.text[:300]
        return [lp for lp, *_ in r.json()["meta_info"]["output_token_logprobs"]]

    clean_off = logprobs(4_242_424_258)
    plan.append({"id": len(plan) + 1, "cls": "transfer_misdirected"})
    control.write_text(json.dumps({"plan": plan}))
    assert logprobs(4_242_424_259) != clean_off
    assert logprobs(4_242_424_260) == clean_off  # and the next transfer is intact again

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

import pytest
import requests
from pd_servers import (
    MAX_NEW_TOKENS,
    PROMPTS,
    PDPair,
    assert_pair_serves_the_single_server_s_outputs,
    generate,
)

from kvguard.serve.child import ServerDied

FLIP_ROOM = 4_242_424_242
FLIP_IN_FLIGHT_ROOM = 4_242_424_243


@pytest.fixture(scope="module")
def guarded_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    pair = PDPair(
        tmp_path_factory.mktemp("pd-guard"),
        kvguard_mode=None,  # kvguard-serve's default: verified
        decode_env={
            "KVGUARD_TEST_PD_FLIP_ROOM": str(FLIP_ROOM),
            "KVGUARD_TEST_PD_FLIP_IN_FLIGHT_ROOM": str(FLIP_IN_FLIGHT_ROOM),
        },
    )
    try:
        pair.start()
    except ServerDied as exc:
        pair.stop()
        pytest.fail(str(exc))
    yield pair
    pair.stop()


def _violations(pair: PDPair) -> tuple[float, float]:
    return tuple(  # type: ignore[return-value]
        s.metric_totals().get("kvguard_violations_total", 0.0) for s in (pair.prefill, pair.decode)
    )


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
    before = _violations(pair)
    assert_pair_serves_the_single_server_s_outputs(pair)
    for server in (pair.prefill, pair.decode):
        server.wait_idle()
    assert _violations(pair) == before, "a clean run through the guarded pair was flagged"
    for server in (pair.prefill, pair.decode):
        totals = server.metric_totals()
        assert totals.get("kvguard_steps_checked_total", 0) > 0, server.url
        assert totals.get("kvguard_unchecked_forwards_total", 0) == 0, server.url
        assert totals.get("kvguard_internal_errors_total", 0) == 0, server.url


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
    prefill_before = _violations(pair)[0]
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
    assert _violations(pair)[0] == prefill_before  # the prefill sent intact KV
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
def test_retracted_requests_are_restored_checked_and_served(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """SGLang's test switch SGLANG_TEST_RETRACT retracts a running decode request every third
    forward; its KV goes to the cpu_tensor backup (kvguard-serve's default on CPU) and is
    restored on resume. The guard seals the backup and checks the restore as a landing: the
    pair serves the single server's outputs with nothing flagged (a restore the guard did not
    model would be flagged at its first read). SGLang's own hand-off checksum runs beside the
    guard on both servers (--disaggregation-enable-kv-checksum; its digest on the host,
    patches/pd_cpu.py) and aborts nothing either."""
    pair = PDPair(
        tmp_path_factory.mktemp("pd-retract"),
        kvguard_mode=None,
        decode_env={"SGLANG_TEST_RETRACT": "1"},
        pair_args=["--disaggregation-enable-kv-checksum"],
    )
    try:
        pair.start()
        assert_pair_serves_the_single_server_s_outputs(pair)
        pair.decode.wait_idle()
        totals = pair.decode.metric_totals()
        assert totals.get("sglang:num_retracted_requests_total", 0) > 0, "nothing was retracted"
        assert _violations(pair) == (0.0, 0.0)
        assert totals.get("kvguard_internal_errors_total", 0) == 0
        assert totals.get("kvguard_transfers_checked_total", 0) > 0
        log = pair.decode.log_tail(1_000_000)
        # SGLang's checksum compared every transfer (a layout it cannot compare says "skipped")
        assert "KV checksum mismatch" not in log and "KV checksum skipped" not in log
    except ServerDied as exc:
        pytest.fail(str(exc))
    finally:
        pair.stop()


@pytest.mark.engine
def test_transfers_misdirected_or_truncated_are_caught_by_the_prefill_s_seal(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The fuzz tool's PD classes (fuzz/pd_faults.py), through SGLang's real transfer path: the
    destination pages the decode server sends the prefill name one page twice (two pages'
    KV land in one page's slots, the other keeps what it held) or lose their last page (the prefill sends fewer
    pages than it holds). Ownership sees nothing wrong; the bytes that land do not match the
    prefill's seal: each such request is aborted, and the next one is served."""
    root = tmp_path_factory.mktemp("pd-fuzz")
    control, fuzz_log, mode = root / "control.json", root / "fuzz.jsonl", root / "mode"
    control.write_text(json.dumps({"plan": []}))
    mode.write_text("verified")
    pair = PDPair(
        root,
        kvguard_mode=None,
        decode_env={
            "KVGUARD_FUZZ_CONTROL": str(control),
            "KVGUARD_FUZZ_LOG": str(fuzz_log),
            "KVGUARD_MODE_FILE": str(mode),  # the guard-off arm below
        },
    )
    classes = ["transfer_misdirected", "transfer_truncated"]
    try:
        pair.start()
        expected = generate(pair.single.url, PROMPTS[2])
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
        assert pair.decode.log_tail(200_000).count("transfer_mismatch") >= len(classes)
        assert generate(pair.router.url, PROMPTS[2])["output_ids"] == expected["output_ids"]
        assert _violations(pair)[0] == 0  # the prefill sent intact KV
        # the fault is real: with the decode server's guard off the request is answered from the
        # misplaced KV (the tiny model's greedy tokens may survive it; its logprobs do not)
        mode.write_text("off")
        assert pair.decode.flush_cache()  # the mode switches at the flush

        def logprobs(room: int) -> list[float]:
            r = _by_hand(pair, PROMPTS[2], room, return_logprob=True)
            assert r.status_code == 200, r.text[:300]
            return [lp for lp, *_ in r.json()["meta_info"]["output_token_logprobs"]]

        clean_off = logprobs(4_242_424_258)
        plan.append({"id": len(plan) + 1, "cls": "transfer_misdirected"})
        control.write_text(json.dumps({"plan": plan}))
        assert logprobs(4_242_424_259) != clean_off
        assert logprobs(4_242_424_260) == clean_off  # and the next transfer is intact again
    except ServerDied as exc:
        pytest.fail(str(exc))
    finally:
        pair.stop()

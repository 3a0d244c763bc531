"""A prefill/decode pair for the engine tests (test_pd_pair.py: guard off; test_pd_guard.py: guard
on): ``kvguard-serve --disaggregation-mode prefill`` and ``decode`` on the embedded default model,
SGLang's router in front, and a single server with the same arguments as the reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from kvguard.serve.child import ServeProcess
from kvguard.serve.pd import PrefillDecodePair

MAX_NEW_TOKENS = 24
SERVER_ARGS = ["--max-total-tokens", "2048"]
_LONG = (
    "The guard keeps a ledger of every page of the key-value cache: which request owns it, at "
    "which epoch, which positions it holds and the digest of the bytes written there. When a "
    "page is freed, reused, shared through the prefix cache or moved between servers, the "
    "ledger follows it, and a reader that finds a page it does not own, or bytes that do not "
    "match what was sealed, is stopped before a single token computed from them reaches the "
    "client. This is the long prompt of the test, several sentences of plain prose so that it "
    "spans well over a hundred tokens of the embedded model's vocabulary."
)
PROMPTS = [
    "Hello there",
    "A prefill server and a decode server share one request:",
    _LONG,
    _LONG + " Now answer briefly: what does the ledger follow?",
]


class PDPair(PrefillDecodePair):
    """Prefill, decode and router (``kvguard.serve.pd``) in guard mode ``kvguard_mode`` (None:
    kvguard-serve's default), plus a single server with the same arguments, guard off (the
    reference), started beside them. ``prefill_env``, ``decode_env``: added to that server's
    environment; ``pair_args``: more arguments of both servers of the pair."""

    def __init__(
        self,
        root: Path,
        kvguard_mode: str | None,
        decode_env: dict[str, str] | None = None,
        pair_args: list[str] | None = None,
        prefill_env: dict[str, str] | None = None,
    ):
        super().__init__(
            root,
            kvguard_mode,
            SERVER_ARGS + (pair_args or []),
            prefill_env=prefill_env,
            decode_env=decode_env,
        )
        self.single = ServeProcess(["--kvguard-mode", "off", *SERVER_ARGS], root / "single.log")
        self.servers = (*self.servers, self.single)  # the three load side by side


def violations(pair: PDPair) -> tuple[float, float]:
    """kvguard_violations_total of the prefill and of the decode server."""
    prefill, decode = (
        s.metric_totals().get("kvguard_violations_total", 0.0) for s in (pair.prefill, pair.decode)
    )
    return prefill, decode


def generate(url: str, prompt: str, **fields: object) -> dict:
    """A greedy completion of ``prompt`` (``fields``: more of the request's JSON body)."""
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
        **fields,
    }
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text[:500]
    out: dict = r.json()
    return out


def assert_pair_serves_the_single_server_s_outputs(pair: PDPair) -> None:
    """Greedy outputs through the router equal the single server's, for PROMPTS sent one by one
    and batched together (the last shares the third's prefix: the prefill's prefix cache)."""
    for server, mode in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        info = requests.get(f"{server.url}/server_info", timeout=30).json()
        assert info["disaggregation_mode"] == mode

    expected = [generate(pair.single.url, p) for p in PROMPTS]
    lengths = [e["meta_info"]["prompt_tokens"] for e in expected]
    assert min(lengths) < 10 and max(lengths) > 120, lengths  # short to long prompts

    one_by_one = [generate(pair.router.url, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the same prompts batched together
        together = list(pool.map(lambda p: generate(pair.router.url, p), PROMPTS))

    for name, got in (("one by one", one_by_one), ("together", together)):
        for prompt, want, out in zip(PROMPTS, expected, got):
            assert len(out["output_ids"]) == MAX_NEW_TOKENS, (name, prompt[:30])
            assert out["output_ids"] == want["output_ids"], (name, prompt[:30])
    assert pair.prefill.running() and pair.decode.running()

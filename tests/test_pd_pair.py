"""A prefill/decode pair on loopback (docs/pd.md): ``kvguard-serve --disaggregation-mode prefill``
and ``decode`` on the embedded default model, KV moved by SGLang's mooncake transfer code over TCP,
requests routed by ``sglang-router``. Greedy outputs through the pair equal a single server's.

On a CPU-only machine this runs through kvguard's PD CPU path (patches/pd_cpu.py): the no-device
libraries the transfer engine links, the prefill's host-index send, the early send of a cached
prefix (the last prompt shares the third's prefix, so the prefill's prefix cache serves it).
The guard is off on both servers: it does not check PD yet.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from kvguard.serve.child import ServeProcess, ServerDied, free_port
from kvguard.serve.pd import RouterProcess, pd_server_args

MAX_NEW_TOKENS = 24
START_TIMEOUT_S = (
    600  # three servers load side by side: ~90 s on 2 idle cores, far more on busy ones
)
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


class PDPair:
    """Prefill, decode and router, plus a single server with the same arguments (the reference)."""

    def __init__(self, root: Path):
        self.bootstrap_port = free_port()
        self.prefill = ServeProcess(
            pd_server_args("prefill", self.bootstrap_port) + SERVER_ARGS, root / "prefill.log"
        )
        self.decode = ServeProcess(pd_server_args("decode") + SERVER_ARGS, root / "decode.log")
        self.single = ServeProcess(["--kvguard-mode", "off", *SERVER_ARGS], root / "single.log")
        self.router = RouterProcess(
            self.prefill.url, self.bootstrap_port, self.decode.url, root / "router.log"
        )
        self.servers = (self.prefill, self.decode, self.single)

    def start(self) -> None:
        with ThreadPoolExecutor(len(self.servers)) as pool:  # the three load side by side
            for started in [pool.submit(s.start, START_TIMEOUT_S) for s in self.servers]:
                started.result()
        self.router.start()

    def stop(self) -> None:
        self.router.stop()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda s: s.stop(), self.servers))


# Two mooncake transfer engines in one process, loaded as pd_cpu loads them for SGLang (in a
# subprocess: the no-device libraries stay out of the test session).
_TRANSFER = textwrap.dedent(
    """
    import os, torch
    from kvguard.patches import pd_cpu
    os.environ.update(pd_cpu.TCP_TRANSPORT)
    print("substituted", pd_cpu.load_no_device_libraries())
    from mooncake.engine import TransferEngine
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    engines = []
    for buf in (src, dst):
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert e.register_memory(buf.data_ptr(), buf.numel()) == 0
        engines.append(e)
    peer = f"127.0.0.1:{engines[1].get_rpc_port()}"
    ret = engines[0].transfer_sync_write(peer, src.data_ptr(), dst.data_ptr(), src.numel())
    print("transfer", ret, bool(torch.equal(src, dst)))
    """
)


def test_transfer_engine_moves_kv_bytes_over_tcp() -> None:
    """mooncake's engine imports with the no-device libraries standing in for the missing ones,
    and its TCP transport moves a buffer's bytes to another engine's registered buffer."""
    out = subprocess.run(
        [sys.executable, "-c", _TRANSFER], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "transfer 0 True" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.fixture(scope="module")
def pd_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    pair = PDPair(tmp_path_factory.mktemp("pd"))
    try:
        pair.start()
    except ServerDied as exc:
        pair.stop()
        pytest.fail(str(exc))
    yield pair
    pair.stop()


def generate(url: str, prompt: str) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
    }
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text[:500]
    out: dict = r.json()
    return out


@pytest.mark.engine
def test_pair_serves_greedy_outputs_equal_to_a_single_server(pd_pair: PDPair) -> None:
    for server, mode in ((pd_pair.prefill, "prefill"), (pd_pair.decode, "decode")):
        info = requests.get(f"{server.url}/server_info", timeout=30).json()
        assert info["disaggregation_mode"] == mode

    expected = [generate(pd_pair.single.url, p) for p in PROMPTS]
    lengths = [e["meta_info"]["prompt_tokens"] for e in expected]
    assert min(lengths) < 10 and max(lengths) > 120, lengths  # short to long prompts

    one_by_one = [generate(pd_pair.router.url, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # the same prompts batched together
        together = list(pool.map(lambda p: generate(pd_pair.router.url, p), PROMPTS))

    for name, got in (("one by one", one_by_one), ("together", together)):
        for prompt, want, out in zip(PROMPTS, expected, got):
            assert len(out["output_ids"]) == MAX_NEW_TOKENS, (name, prompt[:30])
            assert out["output_ids"] == want["output_ids"], (name, prompt[:30])
    assert pd_pair.prefill.running() and pd_pair.decode.running()

"""A prefill/decode pair on loopback (docs/pd.md): ``kvguard-serve --disaggregation-mode prefill``
and ``decode`` on the embedded default model, KV moved by SGLang's mooncake transfer code over TCP,
requests routed by ``sglang-router``. Greedy outputs through the pair equal a single server's.

On a CPU-only machine this runs through kvguard's PD CPU path (patches/pd_cpu.py): the no-device
libraries the transfer engine links, the prefill's host-index send, the early send of a cached
prefix (the last prompt shares the third's prefix, so the prefill's prefix cache serves it).
The guard is off on both servers here; tests/test_pd_guard.py runs the pair guarded.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
from pd_servers import PDPair, assert_pair_serves_the_single_server_s_outputs

from kvguard.serve.child import ServerDied

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
    pair = PDPair(tmp_path_factory.mktemp("pd"), kvguard_mode="off")
    try:
        pair.start()
    except ServerDied as exc:
        pair.stop()
        pytest.fail(str(exc))
    yield pair
    pair.stop()


@pytest.mark.engine
def test_pair_serves_greedy_outputs_equal_to_a_single_server(pd_pair: PDPair) -> None:
    assert_pair_serves_the_single_server_s_outputs(pd_pair)

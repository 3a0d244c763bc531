"""A prefill/decode pair on loopback (docs/pd.md): ``kvguard-serve --disaggregation-mode prefill``
and ``decode`` on the embedded default model, KV moved by SGLang's mooncake transfer code over TCP,
requests routed by ``sglang-router``. Greedy outputs through the pair equal a single server's.

On a CPU-only machine this runs through kvguard's PD CPU path (patches/pd_cpu.py): the no-device
libraries the transfer engine links, the prefill's host-index send, the early send of a cached
prefix (the last prompt shares the third's prefix, so the prefill's prefix cache serves it).
tests/test_pd_guard.py serves through one pair, guard on and off; here a pair whose decode
server retracts requests (SGLang's test switch, fixed at start) has its restores checked.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from pd_servers import PDPair, assert_pair_serves_the_single_server_s_outputs, violations

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
        assert violations(pair) == (0.0, 0.0)
        assert totals.get("kvguard_internal_errors_total", 0) == 0
        assert totals.get("kvguard_transfers_checked_total", 0) > 0
        log = pair.decode.log_tail(1_000_000)
        # SGLang's checksum compared every transfer (a layout it cannot compare says "skipped")
        assert "KV checksum mismatch" not in log and "KV checksum skipped" not in log
    except ServerDied as exc:
        pytest.fail(str(exc))
    finally:
        pair.stop()

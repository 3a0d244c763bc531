"""Shared set-up of the test suite.

Tiers (markers declared in pyproject.toml, ``--strict-markers``): ``engine`` tests start a real
SGLang engine or ``kvguard-serve``, ``campaign`` tests run a fault-injection campaign against a
live server, ``slow`` tests are long CPU-only matrices, ``gpu`` tests need CUDA.
``scripts/test.sh --fast`` runs everything else.

Helpers: ``cpu_engine.py`` (an in-process SGLang engine on CPU), ``tiny_model.py`` and
``quant_helpers.py`` (models built offline), the ``serve_processes`` fixture below
(``kvguard-serve`` subprocesses, :class:`kvguard.serve.child.ServeProcess`) and the session's
``shared_server`` (``shared_server.py``: one kvguard-serve for every test whose arguments agree;
a server start costs ~30 s on two cores, so a new test uses it unless it needs other arguments).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvguard.serve.child import ServeProcess, ServerDied

# SGLang reads this when its modules are first imported, and test modules import SGLang at
# collection: it must be set before any of them loads. The whole session is a CPU session.
os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

# Tier markers for tests in files whose owners have not marked them in the file yet (node id ->
# marker). A row is a no-op once the test carries the marker itself; then delete the row.
PENDING_MARKS = {
    "test_fp8_kv.py::test_engine_fp8_kv_paranoid_guard_close_to_bf16": "engine",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse",
        action="store_true",
        help="run the collected tests in reverse order (tests must not depend on their order)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()
    # a test that stops the shared server goes last, whatever the order: the others keep it
    last = [i for i in items if i.get_closest_marker("stops_shared_server")]
    items[:] = [i for i in items if i not in last] + last
    for item in items:
        marker = PENDING_MARKS.get(f"{item.path.name}::{getattr(item, 'originalname', item.name)}")
        if marker and item.get_closest_marker(marker) is None:
            item.add_marker(marker)
        if item.get_closest_marker("gpu") and not _cuda_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


StartServer = Callable[..., ServeProcess]


@pytest.fixture(scope="module")
def serve_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartServer]:
    """``start(args, env=None)``: a healthy ``kvguard-serve`` (on 127.0.0.1, a free port, a clean
    environment plus ``env``, its log in a temp dir); every server started through it is stopped,
    with its whole process tree, when the module's tests are done. A server that does not come
    up fails the test with its log's tail."""
    root: Path = tmp_path_factory.mktemp("serve")
    started: list[ServeProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServeProcess:
        if not any(a.startswith(("--sleep-on-idle", "--disaggregation-mode")) for a in args):
            # an idle SGLang scheduler spins a core (10 CPU-s per 10 s measured), taken from the
            # next server a module starts on a 2-core machine. Not for a PD pair: its loops call
            # the sleeper while transfers are in flight, which no socket it polls announces
            args = [*args, "--sleep-on-idle"]
        srv = ServeProcess(args, root / f"server-{len(started)}.log", env)
        started.append(srv)
        try:
            srv.start()
        except ServerDied as exc:
            pytest.fail(str(exc))
        return srv

    yield start
    for srv in started:
        srv.stop(drain=False)  # a teardown: nothing in flight to drain


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The session's shared kvguard-serve (``shared_server.py``), started on first use."""
    from shared_server import SharedServer  # after SGLANG_USE_CPU_ENGINE is set above

    shared = SharedServer(tmp_path_factory.mktemp("shared-server"))
    yield shared
    shared.stop()

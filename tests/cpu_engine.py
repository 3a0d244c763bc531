"""The one way tests start an in-process SGLang engine on CPU: the CPU argument set, and the
environment (``KVGUARD_*`` and the like) set before the Engine starts its scheduler processes,
which inherit it, and restored afterwards (through pytest's MonkeyPatch)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

# What an SGLang engine needs on a machine without a GPU (kvguard-serve sets the same by default).
CPU_ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu",
    attention_backend="torch_native",
    disable_cuda_graph=True,
    skip_server_warmup=True,
    sleep_on_idle=True,  # an idle scheduler otherwise spins a core the test itself needs
    log_level="warning",
)
SGLANG_CACHE_DIR = os.path.join(tempfile.gettempdir(), "kvguard-sglang-cache")


@contextmanager
def cpu_engine(model_dir: Path, env: dict[str, str] | None = None, **engine_args: Any) -> Iterator:
    """``sglang.Engine`` for ``model_dir`` with :data:`CPU_ENGINE_ARGS` (``engine_args`` add to
    or override them), ``env`` set in this process while the engine lives; shut down on exit."""
    import sglang

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_USE_CPU_ENGINE", "1")
        mp.setenv("SGLANG_CACHE_DIR", SGLANG_CACHE_DIR)
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        others = _descendants()  # processes that are not the engine's: servers a test started
        engine = sglang.Engine(model_path=str(model_dir), **{**CPU_ENGINE_ARGS, **engine_args})
        try:
            yield engine
        finally:
            import sglang.srt.entrypoints.engine as engine_module

            mp.setattr(engine_module, "kill_process_tree", _sparing(others))
            engine.shutdown()


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _sparing(others: set[int]):
    """SGLang's ``Engine.shutdown`` kills every descendant of this process
    (``kill_process_tree(os.getpid(), include_parent=False)``): in a test session that includes
    servers started beside the engine (the session's shared kvguard-serve, a module's server),
    which then died without a word. This kills the engine's own processes only: every
    descendant but those that were there before the engine, and theirs."""
    from sglang.srt.utils import kill_process_tree

    def kill_engine_tree(parent_pid=None, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid not in (None, os.getpid()) or include_parent:
            return kill_process_tree(parent_pid, include_parent, skip_pid, wait_timeout)
        spared = set(others)
        for pid in others:
            with contextlib.suppress(psutil.NoSuchProcess):
                spared |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
        own = [p for p in psutil.Process().children(recursive=True) if p.pid not in spared]
        for p in own:
            if p.pid != skip_pid:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        psutil.wait_procs(own, timeout=wait_timeout)
        return None

    return kill_engine_tree

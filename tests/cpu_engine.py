"""The one way tests start an in-process SGLang engine on CPU: the CPU argument set, and the
environment (``KVGUARD_*`` and the like) set before the Engine starts its scheduler processes,
which inherit it, and restored afterwards (through pytest's MonkeyPatch)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
        engine = sglang.Engine(model_path=str(model_dir), **{**CPU_ENGINE_ARGS, **engine_args})
        try:
            yield engine
        finally:
            engine.shutdown()

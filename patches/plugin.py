"""SGLang general plugin (entry point ``sglang.srt.plugins: kvguard``): runs at the start of every
SGLang process that calls ``load_plugins()`` (scheduler, detokenizer, engine) and registers the hooks
listed in ``targets.py``. Registration is idempotent per process; nothing here imports torch-heavy
SGLang modules (the registry resolves targets after all plugins ran). Once SGLang applied the hooks,
every row registered here is checked to be in place, or the process refuses to start
(``hook_check.py``); a plugin that fails to load refuses alike, instead of SGLang's log line."""

from __future__ import annotations

import importlib
import multiprocessing

from kvguard.config import GuardConfig
from kvguard.logconfig import configure_from_env
from kvguard.patches.hook_check import HooksNotApplied, require, rows_registered
from kvguard.patches.targets import (
    CANARY_TARGETS,
    DSA_TARGETS,
    GUARD_TARGETS,
    HTTP_TARGETS,
    MLA_TARGETS,
    PD_CPU_TARGETS,
    PD_GUARD_TARGETS,
    QUANT_TARGETS,
    READ_TARGETS,
    TP_TARGETS,
    WRITE_TARGETS,
)

_registered = False


def load() -> None:
    global _registered
    if _registered:
        return
    try:
        _load()
    except Exception as e:  # SGLang's loader would log it and serve on without kvguard's hooks
        lines = str(e).strip().splitlines()
        why = lines[0] if lines else type(e).__name__
        raise HooksNotApplied(f"kvguard's SGLang plugin could not load: {why}") from e
    _registered = True


def _load() -> None:
    configure_from_env()  # the kvguard-serve launcher's log format, if it set one
    config = GuardConfig.from_env()  # an invalid setting fails loudly here, at start-up
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # the guard (and, on a prefill/decode pair, its transfer hooks); features: any guard mode
    # the stores' digests first: innermost, they see what SGLang's own store gets
    rows = WRITE_TARGETS + GUARD_TARGETS + PD_GUARD_TARGETS if config.enabled else []
    rows += QUANT_TARGETS
    rows += READ_TARGETS  # torch_native's KV read: FP8 dequantization, the guard's verified reads
    if config.enabled and multiprocessing.parent_process() is None:
        rows += HTTP_TARGETS  # the process that serves HTTP (its schedulers are its children)
    rows += CANARY_TARGETS  # SGLang's --kv-canary on CPU; no-ops elsewhere
    rows += TP_TARGETS  # --tp N on CPU; no-op with CUDA
    rows += MLA_TARGETS  # MLA (DeepSeek-V3 / Kimi K2 architecture) on CPU torch_native
    rows += PD_CPU_TARGETS  # prefill/decode disaggregation on CPU; no-ops elsewhere
    rows += DSA_TARGETS  # DSA (GLM-5) on CPU; after READ_TARGETS: its attention hook is outermost
    require(rows)  # each checked once SGLang applied the hooks: every one in place, or no start
    for target, hook_type, hook_path, _why in rows_registered(rows):
        module_name, fn_name = hook_path.rsplit(".", 1)
        module = importlib.import_module(f"kvguard.patches.{module_name}")
        HookRegistry.register(target, getattr(module, fn_name), HookType[hook_type])

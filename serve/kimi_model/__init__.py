"""kvguard's tiny Kimi-K2-architecture model (DeepSeek-V3 text architecture: MLA + MoE).

A ~2M-parameter ``DeepseekV3ForCausalLM`` with the default model's tokenizer, trained by
``python -m kvguard.serve.kimi_model.build`` on the Python standard library source and committed
under ``checkpoint/``: the MLA/MoE model kvguard is served and tested with, offline. Serve it
with ``kvguard-serve --embedded-model kimi`` (or ``--model-path`` pointing at
:data:`KIMI_MODEL_DIR`). See ``README.md`` and ``checkpoint/build_report.json``.

This module imports nothing heavy (no torch / transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvguard.serve.default_model import checked_checkpoint

KIMI_MODEL_DIR = Path(__file__).parent / "checkpoint"


class KimiModelMissingError(FileNotFoundError):
    """The embedded Kimi-architecture checkpoint is missing or incomplete."""


def ensure_kimi_model() -> Path:
    """The directory of the embedded Kimi-architecture checkpoint; raises
    :class:`KimiModelMissingError` (a ``FileNotFoundError``) naming the missing files."""
    return checked_checkpoint(
        KIMI_MODEL_DIR, KimiModelMissingError, "Kimi-architecture", "kvguard.serve.kimi_model.build"
    )


def build_report() -> dict:
    """The ``build_report.json`` written next to the checkpoint."""
    return json.loads((ensure_kimi_model() / "build_report.json").read_text())


__all__ = ["KIMI_MODEL_DIR", "KimiModelMissingError", "build_report", "ensure_kimi_model"]

"""kvguard's tiny GLM-5-architecture model (GlmMoeDsa: MLA + DeepSeek Sparse Attention + MoE).

A ~2M-parameter ``GlmMoeDsaForCausalLM`` with the default model's tokenizer, built by
``python -m kvguard.serve.glm_model.build`` on the Python standard library source into
``checkpoint/`` (committed): the DSA model kvguard is served and tested with, offline. Serve it
with ``kvguard-serve --embedded-model glm``. See ``README.md`` and ``checkpoint/build_report.json``.

This module imports nothing heavy (no torch / transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvguard.serve.default_model import checked_checkpoint

GLM_MODEL_DIR = Path(__file__).parent / "checkpoint"


class GlmModelMissingError(FileNotFoundError):
    """The embedded GLM-architecture checkpoint is missing or incomplete."""


def ensure_glm_model() -> Path:
    """The directory of the embedded GLM-architecture checkpoint; raises
    :class:`GlmModelMissingError` (a ``FileNotFoundError``) naming the missing files."""
    return checked_checkpoint(
        GLM_MODEL_DIR, GlmModelMissingError, "GLM-architecture", "kvguard.serve.glm_model.build"
    )


def build_report() -> dict:
    """The ``build_report.json`` written next to the checkpoint."""
    return json.loads((ensure_glm_model() / "build_report.json").read_text())


__all__ = ["GLM_MODEL_DIR", "GlmModelMissingError", "build_report", "ensure_glm_model"]

"""kvguard's embedded default model.

A tiny Llama (byte-level BPE tokenizer, ~4M parameters, bfloat16) trained by
``python -m kvguard.serve.default_model.build`` on the Python standard library
source, committed under ``checkpoint/`` so that kvguard can be served and
tested without any model hub.  See ``checkpoint/build_report.json``.

This module deliberately imports nothing heavy (no torch / transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "checkpoint"

REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class DefaultModelMissingError(FileNotFoundError):
    """The embedded default-model checkpoint is missing or incomplete."""


def checked_checkpoint(
    d: Path, missing_error: type[FileNotFoundError], what: str, builder: str
) -> Path:
    """``d`` if it holds every file of :data:`REQUIRED_FILES`; else ``missing_error`` naming
    the missing files and the command (``python -m <builder> --out d``) that rebuilds them.
    Every embedded model's ``ensure_*`` is this."""
    missing = [name for name in REQUIRED_FILES if not (d / name).is_file()]
    if missing:
        raise missing_error(
            f"kvguard {what} checkpoint at {d} is missing {', '.join(missing)}; rebuild it with "
            f"`python -m {builder} --out {d}` or reinstall kvguard with its package data"
        )
    return d


def ensure_default_model() -> Path:
    """Return the directory of the embedded default model checkpoint.

    Raises :class:`DefaultModelMissingError` (a ``FileNotFoundError``) naming
    the missing files if the checkpoint is incomplete, e.g. when the package
    was installed without its package data.
    """
    return checked_checkpoint(
        DEFAULT_MODEL_DIR,
        DefaultModelMissingError,
        "default model",
        "kvguard.serve.default_model.build",
    )


def build_report() -> dict:
    """The ``build_report.json`` written next to the checkpoint."""
    return json.loads((ensure_default_model() / "build_report.json").read_text())


__all__ = [
    "DEFAULT_MODEL_DIR",
    "REQUIRED_FILES",
    "DefaultModelMissingError",
    "build_report",
    "checked_checkpoint",
    "ensure_default_model",
]

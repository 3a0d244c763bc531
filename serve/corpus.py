"""The training and evaluation corpus of kvguard's embedded models: the running interpreter's
standard library source, listed in a fixed order, with every HELDOUT_EVERY-th file held out.

Shared by the model builder (``kvguard.serve.tiny_builder``, every ``serve/*_model/build.py``),
the quantizer's calibration and the quantization benchmark, so that they agree on what is held out.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "site-packages",
        # pydoc_data/topics.py: one 750 KB string of rendered docs
        "pydoc_data",
    }
)
# Machine-generated data tables, not Python code people write: the charmap
# codecs in encodings/ (cp1252.py, mac_roman.py, ...) made by gencodec.py.
GENERATED_HEADER = b'""" Python Character Mapping Codec'

HELDOUT_EVERY = 50


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the stdlib, skipping SKIP_DIRS and generated
    charmap codec tables."""
    root = stdlib_root() if root is None else Path(root)
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            with open(path, "rb") as fh:
                if fh.read(len(GENERATED_HEADER)) == GENERATED_HEADER:
                    continue
            out.append(path)
    out.sort(key=lambda p: p.relative_to(root).as_posix())
    return out


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, heldout): every HELDOUT_EVERY-th file (0, 50, ...) is held out."""
    train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != 0]
    held = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == 0]
    return train, held


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def corpus_digest(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()

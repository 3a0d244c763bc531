"""Serve ``sgl_kernel_compat.py`` (beside this file) as ``sgl_kernel`` when no real one is installed.

SGLang's scheduler runs in spawned child processes that import ``sgl_kernel`` while importing
the scheduler module, before any SGLang plugin loads. A ``.pth`` file (written by
``scripts/setup.sh``) calls :func:`install` at interpreter start-up in every process of the venv.
The finder sits at the END of ``sys.meta_path``: it answers only after every regular finder failed,
so a real ``sgl_kernel`` always wins. Importing this file must stay cheap (no torch).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_COMPAT_MODULE = Path(__file__).with_name("sgl_kernel_compat.py")


class SglKernelCompatFinder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sgl_kernel":
            return None
        return importlib.util.spec_from_file_location("sgl_kernel", _COMPAT_MODULE)


def install() -> None:
    if not any(isinstance(f, SglKernelCompatFinder) for f in sys.meta_path):
        sys.meta_path.append(SglKernelCompatFinder())

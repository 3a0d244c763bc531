"""Print the SGLang source files kvguard hooks or touches (every row of every table in
patches/targets.py), one per line: the files to read when SGLang's version changes.

    .venv/bin/python scripts/sglang-touched.py            # paths of the installed SGLang
    .venv/bin/python scripts/sglang-touched.py --modules  # module names instead
"""

from __future__ import annotations

import inspect
import pkgutil
import sys
from types import ModuleType

from kvguard.patches import targets


def names() -> list[str]:
    rows = [
        row[0] for key, table in vars(targets).items() if key.endswith("_TARGETS") for row in table
    ]
    return rows + [row[0] for row in targets.SGLANG_NAMES]


def module_of(dotted: str) -> ModuleType:
    """The module that defines ``dotted`` (its longest importable prefix, or the owner's module)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = pkgutil.resolve_name(".".join(parts[:i]))
        except (ImportError, AttributeError, ValueError):
            continue
        module = obj if isinstance(obj, ModuleType) else inspect.getmodule(obj)
        if module is not None:
            return module
    raise SystemExit(f"{dotted}: does not resolve in the installed SGLang")


def main() -> int:
    modules = {module_of(name) for name in names()}
    modules = {m for m in modules if m.__name__.startswith("sglang.")}
    as_names = "--modules" in sys.argv[1:]
    for line in sorted(m.__name__ if as_names else str(m.__file__) for m in modules):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

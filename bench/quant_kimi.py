"""``python -m kvguard.bench.quant_kimi [ARGS]`` is ``python -m kvguard.bench.quant_mla --family
kimi [ARGS]`` (writing ``bench/quant_kimi_results.md`` by default)."""

from __future__ import annotations

import sys

from kvguard.bench.quant_mla import main

if __name__ == "__main__":
    sys.exit(main(["--family", "kimi", *sys.argv[1:]]))

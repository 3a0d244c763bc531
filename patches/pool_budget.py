"""The guard's own memory counted in SGLang's KV budget.

SGLang sizes the KV pool from the memory it finds free, then the guard allocates its ledger on
the pool's device (72 bytes per page, plus the compiled backend's workspaces). Unaccounted, that
comes out of the slack SGLang keeps for activations, and on a CPU whose pool is sized from system
memory it can exhaust it. The budget SGLang divides by its bytes per token is shrunk by the
guard's share first, so pool and guard together fit what SGLang measured.
"""

from __future__ import annotations

from kvguard.config import GuardConfig
from kvguard.kernels.guard_state import (
    TRITON_WORKSPACE_BYTES_PER_PAGE,
    WORKSPACE_BYTES_PER_PAGE,
    PageArrays,
)

LEDGER_BYTES_PER_PAGE = PageArrays.empty(1, "meta").nbytes()


def guard_bytes_per_token(page_size: int) -> float:
    """The larger backend workspace of the two (CPU 4, CUDA 25 bytes per page): the budget is
    taken before the guard exists, and the difference is 21 bytes per page."""
    workspace = max(WORKSPACE_BYTES_PER_PAGE, TRITON_WORKSPACE_BYTES_PER_PAGE)
    return (LEDGER_BYTES_PER_PAGE + workspace) / max(page_size, 1)


# -- DefaultPoolConfigurator.calculate_pool_sizes (AROUND) ---------------------------------------
def around_calculate_pool_sizes(original, configurator, available_bytes, page_size, *a, **kw):
    cell = getattr(configurator, "_cell_size", 0) or 0
    if cell > 0 and GuardConfig.from_env().enabled:
        per_token = guard_bytes_per_token(page_size)
        available_bytes = int(available_bytes * cell / (cell + per_token))
    return original(configurator, available_bytes, page_size, *a, **kw)

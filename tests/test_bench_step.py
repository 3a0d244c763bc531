"""bench_step's synthetic pool stays clean in every mode (it raises on any violation), and its
operator count per step does not grow with the batch or the context: no Python loop over pages."""

from __future__ import annotations

import pytest

from kvguard.bench.step import run


@pytest.mark.parametrize("page_size", [1, 16])
def test_ops_per_step_do_not_grow_with_batch_or_context(page_size):
    # 16 decode steps cross exactly one page boundary per request at either prompt length, so
    # both runs take the same CPU branches (a claim step, a sweep step): only the sizes differ.
    for mode in ("tags", "sampled", "paranoid"):
        _, small = run(mode, batch=2, prompt=8, new=16, reps=1, page_size=page_size, count_ops=True)
        _, large = run(
            mode, batch=12, prompt=100, new=16, reps=1, page_size=page_size, count_ops=True
        )
        assert small == large, (mode, small, large)

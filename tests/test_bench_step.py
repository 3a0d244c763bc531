"""bench.step's synthetic pool stays clean in every mode (it raises on any violation), and a
decode step dispatches a fixed, small number of operations, flat in batch size and context:
at most 16 in tags, 24 in sampled and paranoid (aten operators + compiled kernel calls)."""

from __future__ import annotations

import pytest

from kvguard.bench.step import run

LIMIT = {"tags": 16, "sampled": 24, "paranoid": 24}


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["tags", "sampled", "paranoid"])
def test_dispatches_per_decode_step_are_few_and_flat(mode, page_size):
    _, small = run(mode, batch=2, prompt=8, new=4, reps=1, page_size=page_size, count_ops=True)
    _, large = run(mode, batch=24, prompt=300, new=4, reps=1, page_size=page_size, count_ops=True)
    assert small == large, (mode, page_size, small, large)
    assert 0 < large <= LIMIT[mode], (mode, page_size, large)

"""The checker's two paths agree: the branch-free one (what runs on GPU: no host read of a device
value) and the CPU one (checks the clean case at once, diagnoses only on failure). Synthetic pool,
no engine: B requests prefill, then decode; corruptions are made between steps the way engine bugs
make them (page table, allocator, KV bytes) and both paths must reach the same verdicts."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch

from kvguard.config import GuardConfig
from kvguard.guard import Guard
from kvguard.step import StepView

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))

B, P, PS_ROWS = 4, 40, 64


class Pool:
    def __init__(self, page_size: int, mode: str, host_reads_free: bool, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ps = page_size
        self.num_slots = 4096 + page_size
        self.bufs = [
            torch.randint(0, 255, (self.num_slots, 2, 8), dtype=torch.uint8, generator=g)
            for _ in range(4)
        ]
        self.table = torch.zeros(PS_ROWS, 256, dtype=torch.int32)
        self.guard = Guard(
            GuardConfig(mode=mode),
            num_slots=self.num_slots,
            page_size=page_size,
            num_rows=PS_ROWS,
            max_len=256,
            kv_buffers=self.bufs,
            device="cpu",
        )
        self.guard.checker.host_reads_free = host_reads_free
        self.rows = torch.arange(1, B + 1)
        width = 128
        self.slots = torch.arange(page_size, page_size + B * width).view(B, width)
        self.table[1 : B + 1, :width] = self.slots.to(torch.int32)
        self.len = 0
        self.step = 0
        self.tokens = torch.randint(0, 1000, (B, 256), generator=g)

    def forward(self, n: int):
        """n new tokens per request (prefill when the pool is empty, else decode)."""
        L, ps = self.len, self.ps
        pos = torch.arange(L, L + n).repeat(B)
        wb = torch.arange(B).repeat_interleave(n)
        slots = self.table[self.rows[wb], pos].to(torch.int64)
        fresh = slots[(pos % ps) == 0]
        if fresh.numel():
            self.guard.on_alloc(fresh)
        self.step += 1
        view = StepView(
            step=self.step,
            rows=self.rows,
            prefix_lens=torch.full((B,), L),
            max_prefix_len=L,
            write_slots=slots,
            write_batch=wb,
            write_pos=pos,
            write_tokens=self.tokens[wb, pos],
            page_table=self.table,
        )
        verdict = self.guard.before_forward(view)
        for b in self.bufs:  # the forward writes new KV
            b[slots] = (b[slots].to(torch.int32) + 7).to(torch.uint8)
        self.guard.after_forward(view)
        kinds = verdict.kinds.clone()
        taint = verdict.taint.clone()
        self.guard.resolve(verdict, [None] * B)
        self.len += n
        return kinds, taint


CORRUPTIONS = {
    "none": lambda pool: None,
    "bit_flip": lambda pool: pool.bufs[1][int(pool.slots[2, 5])]
    .view(-1)
    .bitwise_xor_(torch.tensor([0, 0, 0, 4] + [0] * 12, dtype=torch.uint8)),
    "table_redirect": lambda pool: pool.table.__setitem__(
        (int(pool.rows[0]), 3), int(pool.slots[1, 3])
    ),
    "table_swap": lambda pool: pool.table[int(pool.rows[3])].index_copy_(
        0, torch.tensor([2, 9]), pool.table[int(pool.rows[3]), [9, 2]].clone()
    ),
    "premature_free": lambda pool: pool.guard.on_release(
        torch.unique(pool.slots[1, : pool.ps] // pool.ps)
    ),
    "double_alloc": lambda pool: pool.guard.on_alloc(pool.slots[2, :1]),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mode", ["tags", "sampled", "paranoid"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_paths_agree(page_size, mode, corruption):
    results = []
    for host_reads_free in (False, True):
        pool = Pool(page_size, mode, host_reads_free)
        steps = [pool.forward(P)]
        steps += [pool.forward(1) for _ in range(3)]
        CORRUPTIONS[corruption](pool)
        steps += [pool.forward(1) for _ in range(3)]
        results.append(steps)
    for (k0, t0), (k1, t1) in zip(*results):
        assert torch.equal(k0, k1), (k0, k1)
        assert torch.equal(t0, t1)
    flagged = torch.stack([k for k, _ in results[1]])
    if corruption == "none":
        assert not bool(flagged.any()), flagged
    elif corruption == "bit_flip" and mode == "tags":
        assert not bool(flagged.any())  # tags carry no checksum: a flipped bit is sampled's job
    else:
        assert bool(flagged.any()), f"{corruption} not detected in {mode}"


def test_clean_decode_flags_nothing_on_either_path():
    for host_reads_free in (False, True):
        pool = Pool(16, "paranoid", host_reads_free)
        kinds, _ = pool.forward(P)
        for _ in range(20):
            kinds, taint = pool.forward(1)
            assert not bool(kinds.any()) and not bool(taint.any())

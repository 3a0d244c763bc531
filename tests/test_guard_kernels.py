"""The compiled CPU kernels reach the reference's verdicts and leave its state, bit for bit.

Every scenario of ``guard_scenarios`` (each violation kind, the clean case, reclaim, rebind,
tenants) in every mode at page sizes 1, 16 and 64 runs twice on the synthetic pool, once with the
torch reference (the specification) and once with the compiled kernels; after every forward the
verdicts (kinds, taint, reclaim, landed writes, the firewalled write targets) and every ledger
and record array must be identical, and so must the KV bytes.
"""

from __future__ import annotations

import pytest
import torch
from guard_scenarios import SCENARIOS
from synthetic_pool import SyntheticPool


def test_compiled_cpu_kernels_are_built():
    """setup.sh (pip install of the project) builds them; serving falls back to the reference
    only where no compiler was available, and says so in its report."""
    from kvguard.kernels import guard_cpu  # noqa: F401
    from kvguard.kernels.backend import select

    assert select("cpu").name == "cpu"


def _trace(kernels: str, scenario: str, mode: str, ps: int, index_layers: int = 0):
    pool = SyntheticPool(page_size=ps, num_pages=4096 // ps + 16, mode=mode, max_len=512,
                         kernels=kernels, sweep_tokens_per_step=64,
                         index_layers=index_layers)  # fmt: skip
    pool.trace = []
    SCENARIOS[scenario](pool)
    return pool


# The fast tier runs every scenario once (its mode and page size picked in turn); the full
# matrix (every mode x page size) is the slow tier.
_MATRIX = [
    pytest.param(
        scenario, mode, ps,
        marks=() if (i % 9) == (3 * ["tags", "sampled", "paranoid"].index(mode) + [1, 16, 64].index(ps)) else pytest.mark.slow,
    )
    for i, scenario in enumerate(sorted(SCENARIOS))
    for mode in ("tags", "sampled", "paranoid")
    for ps in (1, 16, 64)
]  # fmt: skip


# DSA pools: the latents slot-major, then page-major index keys and scales per indexer layer
_INDEX_PAGES = [
    (scenario, mode, ps)
    for scenario, mode in (("clean", "sampled"), ("bit_flip_shared", "paranoid"),
                           ("read_before_ready", "sampled"), ("table_swap", "tags"))
    for ps in (16, 64)
]  # fmt: skip


@pytest.mark.parametrize(
    ("scenario", "mode", "ps", "index_layers"),
    [pytest.param(*case.values, 0, marks=case.marks) for case in _MATRIX]
    + [pytest.param(*case, 2, id="index-{}-{}-ps{}".format(*case)) for case in _INDEX_PAGES],
)  # fmt: skip
def test_compiled_kernels_match_the_reference(scenario, mode, ps, index_layers):
    ref = _trace("torch", scenario, mode, ps, index_layers)
    cpu = _trace("cpu", scenario, mode, ps, index_layers)
    assert len(ref.trace) == len(cpu.trace) and ref.trace
    for step, (r, c) in enumerate(zip(ref.trace, cpu.trace)):
        for key in r:
            assert torch.equal(r[key], c[key]), (
                f"{scenario} {mode} ps{ps}: step {step} {key} differs"
            )
    assert [v.kinds for v in ref.violations] == [v.kinds for v in cpu.violations]
    assert ref.free_pages == cpu.free_pages


def test_checksum_matches_the_reference():
    from kvguard.kernels.guard_cpu import CpuKernels
    from kvguard.kernels.kv_checksum_ref import token_digests_ref

    g = torch.Generator().manual_seed(1)
    bufs = [torch.randn(512, 1, 576, generator=g).to(torch.bfloat16)]  # an MLA latent row
    bufs += [torch.randint(0, 255, (512, 2, 64), dtype=torch.uint8, generator=g) for _ in range(3)]
    slots = torch.randperm(512, generator=g)[:300]
    pos = torch.randint(0, 1 << 20, (300,), generator=g)
    assert torch.equal(
        CpuKernels().token_digests(bufs, slots, pos), token_digests_ref(bufs, slots, pos)
    )


def test_page_major_checksum_matches_the_reference():
    """DSA's index pages (per page: 64 keys of 128 bytes, then their 64 fp32 scales): a
    page-major buffer hashes as its rows stored slot-major would, and the compiled checksum
    agrees with the reference, alone (one gather per buffer) and beside latent rows (chunked)."""
    from kvguard.kernels.guard_cpu import CpuKernels
    from kvguard.kernels.kv_checksum_ref import page_major, token_digests_ref

    g = torch.Generator().manual_seed(2)
    pages, ps = 9, 64
    raw = [torch.randint(0, 255, (pages, ps * 132), dtype=torch.uint8, generator=g)
           for _ in range(2)]  # fmt: skip
    keys = [page_major(r, offset=0, slot_bytes=128, row_bytes=128, per_page=ps) for r in raw]
    scales = [page_major(r, offset=ps * 128, slot_bytes=4, row_bytes=4, per_page=ps) for r in raw]
    latent = torch.randn(pages * ps, 1, 192, generator=g).to(torch.bfloat16)
    slots = torch.randint(0, pages * ps, (700,), generator=g)
    slots[0] = 4 * ps + 9
    pos = torch.randint(0, 1 << 20, (700,), generator=g)
    # the same rows slot-major: slot s = page s // 64, row s % 64
    flat = [r[:, : ps * 128].reshape(pages * ps, 128) for r in raw]
    flat_scales = [r[:, ps * 128 :].reshape(pages * ps, 4) for r in raw]
    for bufs, same in (
        (keys, flat),
        ([latent, keys[0], scales[0], keys[1], scales[1]],
         [latent, flat[0], flat_scales[0], flat[1], flat_scales[1]]),
    ):  # fmt: skip
        want = token_digests_ref(same, slots, pos)
        assert torch.equal(token_digests_ref(bufs, slots, pos), want)
        assert torch.equal(CpuKernels().token_digests(bufs, slots, pos), want)
    raw[1][4, ps * 128 + 4 * 9] ^= 1  # one scale bit of slot 4 * 64 + 9
    hit = slots == 4 * ps + 9
    moved = token_digests_ref([latent, keys[0], scales[0], keys[1], scales[1]], slots, pos) != want
    assert torch.equal(moved, hit)


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_out_of_range_inputs_are_refused_not_read(kernels):
    """A page table or write target pointing outside the pool (an engine bug, a corrupted
    tensor) makes the check refuse the step (the adapter then aborts its batch); nothing outside
    the pool is read or written, and the process goes on."""
    from guard_scenarios import _two

    for corrupt in ("table", "write", "negative"):
        pool = SyntheticPool(page_size=16, num_pages=64, mode="paranoid", kernels=kernels)
        a, b = _two(pool)
        if corrupt == "table":
            pool.table[a.row, 3] = 10**6
            with pytest.raises(ValueError, match="outside the pool"):
                pool.forward([a, b], 1)
        elif corrupt == "write":
            with pytest.raises(ValueError, match="out of range"):
                pool.forward([a, b], 1, redirect={(a.rid, a.length): 10**7})
        else:
            pool.table[b.row, 0] = -5
            with pytest.raises(ValueError, match="outside the pool"):
                pool.forward([a, b], 1)
    keep, double = pool.guard.ledger.release(torch.tensor([3, 10**6, -1, 3]), pool.step)
    assert double[1:].tolist() == [True, True, True] and not keep[1:].any()


def test_match_time_adoption_matches_the_reference():
    """``Guard.adoptable`` (the hand-off rule asked when the prefix cache matches): the compiled
    answer equals the reference's for own tokens, other tokens, another tenant, partial pages."""
    from guard_scenarios import _sharer, _two

    answers = {}
    for kernels in ("torch", "cpu"):
        pool = SyntheticPool(
            page_size=16, num_pages=4096 // 16 + 16, mode="sampled", kernels=kernels
        )
        a, _ = _two(pool)
        _sharer(pool, a)  # a's full pages are now in the prefix cache
        n = (a.length // 16) * 16
        slots = pool.table[a.row, :n].to(torch.int64)
        g = pool.guard
        answers[kernels] = [
            g.adoptable(slots, a.tokens[:n]),
            g.adoptable(slots, [t + 1 for t in a.tokens[:n]]),
            g.adoptable(slots, a.tokens[:n], seed=22),
            g.adoptable(slots[:-3], a.tokens[:n]),
            g.adoptable(slots[:16], a.tokens[:16]),
            g.adoptable(slots, a.tokens[: n - 1]),
        ]
    assert answers["torch"] == answers["cpu"] == [True, False, False, False, True, False]

"""The read is the checked read: attention's requests must read the page-table rows and lengths
the step check judged. A swap of two requests' indices (or a length changed) after the check would
otherwise verify, each read against the row it actually read: a neighbour's KV verifies as the
neighbour's."""

from __future__ import annotations

import pytest
from synthetic_pool import SyntheticPool

from kvguard.verdict import Kind


def _two(pool: SyntheticPool, same_length: bool):
    a = pool.admit(list(range(100, 180)))
    b = pool.admit(list(range(300, 380)))
    pool.forward([a, b], [40, 40 if same_length else 37])
    pool.forward([a, b], 1)
    return a, b


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
@pytest.mark.parametrize("same_length", [True, False])
def test_requests_reading_each_others_rows_are_flagged(kernels, same_length):
    pool = SyntheticPool(page_size=16, num_pages=64, mode="verified", kernels=kernels)
    pool.guard.enable_read_path()
    a, b = _two(pool, same_length)
    assert not pool.flagged()
    real = pool._attention_read
    pool._attention_read = lambda reqs, counts: real(reqs[::-1], counts[::-1])  # type: ignore
    pool.forward([a, b], 1)
    assert pool.flagged() == {a.rid, b.rid}
    assert all(v.kinds & Kind.READ_MISMATCH for v in pool.violations)


def test_a_length_changed_after_the_check_is_flagged():
    pool = SyntheticPool(page_size=16, num_pages=64, mode="verified")
    pool.guard.enable_read_path()
    a, b = _two(pool, same_length=False)
    real = pool._attention_read

    def shorter(reqs, counts):
        read = real(reqs, counts)
        read.seq_lens[0] -= 1  # a reads one position less than it holds (its rows sliced short)
        n = read.seq_lens[0]
        keep = [i for i in range(read.rows.numel()) if i != n]
        read.rows, read.acc = read.rows[keep], read.acc[keep]
        return read

    pool._attention_read = shorter  # type: ignore[method-assign]
    pool.forward([a, b], 1)
    assert pool.flagged() == {a.rid}


def test_a_read_mismatch_record_names_the_page_that_failed():
    """Forensics that point: the record of a read whose bytes failed names that one page (its
    logical position and slot, why), not every page of the request."""
    pool = SyntheticPool(page_size=16, num_pages=64, mode="verified")
    pool.guard.enable_read_path()
    a, b = _two(pool, same_length=True)
    bad_page = a.pages[1]
    pool.bufs[0][bad_page * 16 + 3, 0, 0] ^= 4  # one byte of a's second page changes at rest
    pool.forward([a, b], 1)
    assert pool.flagged() == {a.rid}
    (v,) = [v for v in pool.violations if v.request == a.rid]
    named = {int(p["page"]): [q["why"] for q in p["positions"]] for p in v.pages}
    assert named == {bad_page: ["read_digest_mismatch"]}, v.pages
    assert v.pages[0]["positions"][0]["position"] == 16


def test_a_stray_read_record_says_so():
    pool = SyntheticPool(page_size=16, num_pages=64, mode="verified")
    pool.guard.enable_read_path()
    a, b = _two(pool, same_length=True)
    real = pool._attention_read
    pool._attention_read = lambda reqs, counts: real(reqs[::-1], counts[::-1])  # type: ignore
    pool.forward([a, b], 1)
    whys = {q["why"] for v in pool.violations for p in v.pages for q in p["positions"]}
    assert "read_other_row_or_length" in whys

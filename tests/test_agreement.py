"""Tensor-parallel agreement (``kvguard.agreement``) with stand-in peers: the page lists' union
and intersection, and the acting check that keeps ranks from splitting (one rank that could not
plan its acting makes every rank fail the batch closed)."""

from __future__ import annotations

import torch

from kvguard.agreement import FAILED, Agreement, intersection, union
from kvguard.config import ReadPath


class Peer:
    """One other rank, whose words are ``theirs``: the OR over both ranks, as SGLang's group
    would compute it."""

    def __init__(self, theirs: int = 0):
        self.theirs = theirs
        self.calls = 0

    def or_words(self, words: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return words | self.theirs


def _agreement(peers) -> Agreement:
    errors: list[str] = []
    return Agreement(peers, None, None, lambda: ReadPath.VERIFIED_IN_ATTENTION, errors.append)  # type: ignore[arg-type]


def test_all_ranks_ok_is_the_or_of_every_rank_s_failure():
    assert _agreement(None).all_ranks_ok(True) and not _agreement(None).all_ranks_ok(False)
    healthy = Peer()
    assert _agreement(healthy).all_ranks_ok(True) and healthy.calls == 1
    assert not _agreement(healthy).all_ranks_ok(False)  # this rank failed: the peer hears it
    failed = Peer(FAILED)  # the peer could not plan: this rank fails the batch closed too
    assert not _agreement(failed).all_ranks_ok(True)


def _pe(pages, epochs):
    return torch.tensor(pages, dtype=torch.int64), torch.tensor(epochs, dtype=torch.int64)


def test_union_keeps_each_page_once_with_its_first_epoch():
    pages, epochs = union([_pe([5, 3], [50, 30]), _pe([3, 9], [31, 90])])
    assert pages.tolist() == [3, 5, 9] and epochs.tolist() == [30, 50, 90]
    empty = union([_pe([], []), _pe([], [])])
    assert empty[0].numel() == 0


def test_intersection_keeps_the_pages_every_rank_holds():
    pages, epochs = intersection([_pe([5, 3, 7], [50, 30, 70]), _pe([3, 7], [0, 0]), _pe([7], [0])])
    assert pages.tolist() == [7] and epochs.tolist() == [70]

"""The paired-rounds runner the serving benchmarks share (``bench.guard``: one server;
``bench.pd_cost``: a prefill/decode pair).

Guard modes are compared on one target (a server or a pair) whose mode follows a mode file
(``KVGUARD_MODE_FILE``: read by each scheduler at the cache flush that starts every round). Each
round runs every mode once, in an order rotated from round to round, so a slow moment of a
shared machine falls on every mode alike; ratios are then paired round by round. Before that,
a target started with ``--kvguard-mode off`` (no hooks at all) runs the same rounds alone: what
the idle hooks cost."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

NO_HOOKS = "no hooks"  # the baseline's name in the results


class Target(Protocol):
    def stop(self) -> None: ...


T = TypeVar("T", bound=Target)


def server_args(extra: list[str], tokens_needed: int) -> list[str]:
    """``extra`` kvguard-serve arguments, plus a pool twice what the workload needs (8,192
    tokens at least) and page size 16 unless given."""
    out = list(extra)
    if "--max-total-tokens" not in out:
        out += ["--max-total-tokens", str(max(8192, 2 * tokens_needed))]
    if "--page-size" not in out:
        out += ["--page-size", "16"]
    return out


def interleaved_rounds(
    start: Callable[[str, Path | None], T],
    modes: list[str],
    rounds: int,
    measure: Callable[[T, str, int], None],
    warm_up: Callable[[T], None],
    work: Path,
    guarded_mode: str,
    baseline: bool = True,
) -> None:
    """``start(mode, mode_file)`` starts a target; ``measure(target, mode, round)`` runs and
    records one round (it flushes the target's caches first: the mode switches there). With
    ``baseline``, a target started in mode ``off`` runs :data:`NO_HOOKS` rounds first; then a
    target started in ``guarded_mode`` runs every round of every mode in ``modes``."""
    if baseline:
        target = start("off", None)
        try:
            warm_up(target)
            for r in range(rounds):
                measure(target, NO_HOOKS, r)
        finally:
            target.stop()
    mode_file = work / "mode"
    mode_file.write_text("off")
    target = start(guarded_mode, mode_file)
    try:
        warm_up(target)
        for r in range(rounds):
            for i in range(len(modes)):
                mode = modes[(i + r) % len(modes)]
                mode_file.write_text(mode)  # read by each scheduler at the flush in measure
                measure(target, mode, r)
    finally:
        target.stop()

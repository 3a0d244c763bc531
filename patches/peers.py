"""The tensor-parallel ranks of one SGLang server, as the guard's ``PeerRanks``: its CPU (gloo)
group, so that agreeing on a verdict never touches the device or its streams."""

from __future__ import annotations

from collections.abc import Callable

import torch


class SchedulerPeers:
    def __init__(self, group) -> None:
        self.group = group

    def or_words(self, words: torch.Tensor) -> torch.Tensor:
        out = words.cpu().clone()
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.BOR, group=self.group)
        return out

    def start_or(self, words: torch.Tensor) -> Callable[[], torch.Tensor]:
        out = words.cpu().clone()
        work = torch.distributed.all_reduce(
            out, op=torch.distributed.ReduceOp.BOR, group=self.group, async_op=True
        )

        def wait() -> torch.Tensor:
            work.wait()
            return out

        return wait

    def gather(self, item: object) -> list[object]:
        out: list[object] = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(out, item, group=self.group)
        return out


def scheduler_peers(scheduler) -> SchedulerPeers | None:
    """The scheduler's peers, or None without tensor parallelism."""
    group = getattr(scheduler, "tp_cpu_group", None)
    if getattr(scheduler, "tp_size", 1) <= 1 or group is None:
        return None
    return SchedulerPeers(group)

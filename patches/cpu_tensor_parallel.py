"""Tensor parallelism on CPU: SGLang 0.5.23 builds a PyNccl communicator for every TP group unless
the platform is NPU/XPU/mooncake, so ``--tp 2`` on CPU fails at start ("Expected a cuda device").
Off CUDA, NCCL cannot exist: groups fall back to torch.distributed (gloo) for their all-reduce,
which SGLang's CPU path already does when its shared-memory all-reduce is unavailable."""

from __future__ import annotations


def around_init_group(original, *args, **kwargs):
    import torch

    if not torch.cuda.is_available() and kwargs.get("use_pynccl") is None:
        kwargs["use_pynccl"] = False
    return original(*args, **kwargs)

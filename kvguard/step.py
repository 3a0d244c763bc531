"""One forward step as the guard sees it: engine-agnostic tensors, filled in by an engine adapter."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepView:
    step: int
    rows: torch.Tensor  # [B] int64: each request's page-table row
    # [B] positions already in the KV before this forward (read), on the host: they size the read
    # check without a device read
    prefix_lens_host: list[int]
    # [N] int64: the KV slots this forward writes. The engine's own tensor: the write firewall
    # redirects a failing target to the padding slot in place, before the forward reads it.
    write_slots: torch.Tensor
    # [N] int64: request index (0..B-1) of each written token, ascending; None: one token per
    # request in batch order (decode)
    write_batch: torch.Tensor | None
    write_pos: torch.Tensor  # [N] int64: logical position of each written token
    write_tokens: torch.Tensor  # [N] int64: token id whose KV each slot receives
    page_table: torch.Tensor  # [R, S] the engine's req_to_token (slot per row and position)
    # Hand-off from the prefix cache (extend steps only): each request's own prefix tokens,
    # packed [sum(prefix_lens)], so a shared page is adopted only if its token chain is ours.
    prefix_tokens: torch.Tensor | None = None
    tenant_seeds: torch.Tensor | None = None  # [B] int64 chain seeds when tenants are isolated
    request_ids: list[str] | None = None  # host ids, for forensic records only
    pad_slot: int = 0  # a slot nobody reads: where the firewall sends a write that fails its check


@dataclass(slots=True)
class ReadSums:
    """What one forward's attention read, hashed as it read it (filled in by an engine adapter
    whose attention folds the token checksum into its KV gather)."""

    rows: torch.Tensor  # [N] int64: every slot read, request by request, position by position
    seq_lens: list[int]  # [B] positions read per request (the segments of rows)
    req_rows: torch.Tensor  # [B] int64: each request's page-table row
    acc: torch.Tensor  # [N] int64: the checksum's inner sums of the bytes read
    buffers: list[int]  # the guarded KV buffers (indices) folded into acc, one entry per read


@dataclass(slots=True)
class WriteSums:
    """What one forward's stores were handed, hashed as they were handed it (filled in by an
    engine adapter that digests each layer's store): the writer's digests, sealed in place of a
    hash of whatever the pool holds after the forward."""

    acc: torch.Tensor  # [N] int64: the checksum's inner sums per written token (write order)
    buffers: list[int]  # the guarded KV buffers (indices) folded into acc, one entry per store

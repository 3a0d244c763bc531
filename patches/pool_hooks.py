"""Hooks on SGLang's allocators and page table: pages handed out, pages returned to the free list,
rows handed to new requests."""

from __future__ import annotations

import torch

from kvguard.patches import state


# -- allocator frees (AROUND) -----------------------------------------------------------------------------
def around_release_pages(original, allocator, *page_ids):
    if not state.on() or not page_ids:
        return original(allocator, *page_ids)
    return original(allocator, *[state.guard.on_release(p) for p in page_ids])


def around_token_free(original, allocator, free_index):
    if not state.on() or free_index.numel() == 0 or allocator.free_group is not None:
        return original(allocator, free_index)  # grouped frees come back here ungrouped
    return original(allocator, state.guard.on_release(free_index))


# -- allocator allocations and clears (AFTER) --------------------------------------------------------------------
def on_slots_allocated(result, allocator, *args, **kwargs):
    if state.on() and isinstance(result, torch.Tensor) and result.numel():
        state.guard.on_alloc(result)
    return result


# -- ReqToTokenPool.alloc_rows (AFTER) ---------------------------------------------------------------------
def on_rows_allocated(result, pool, *args, **kwargs):
    if state.guard is not None and result:
        state.guard.on_rows_allocated(
            torch.tensor(result, dtype=torch.int64, device=state.guard.ledger.device)
        )
    return result

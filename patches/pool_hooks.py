"""Hooks on SGLang's allocators and page table: pages handed out, pages returned to the free list
(attributed to the request being released, so a stale holder cannot free pages someone else now
holds), rows handed to new requests."""

from __future__ import annotations

import torch

from kvguard.patches import state


# -- common.release_kv_cache (AROUND) ---------------------------------------------------------------------
def around_release_kv_cache(original, req, tree_cache, *args, **kwargs):
    """Every free made while a request is released is attributed to its row."""
    if not state.on() or not req.kv.holds_kv:
        return original(req, tree_cache, *args, **kwargs)
    with state.guard.releasing(int(req.kv.req_pool_idx)):
        return original(req, tree_cache, *args, **kwargs)


def _attributed(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The slots whose pages the request being released may free (all, outside a release)."""
    keep = state.guard.attribute_free(
        torch.div(slots.to(torch.int64), page_size, rounding_mode="floor")
    )
    return slots if bool(keep.all()) else slots[keep]


# -- allocator frees (AROUND) -----------------------------------------------------------------------------
def around_paged_free(original, allocator, free_index):
    """PagedTokenToKVPoolAllocator.free (slots): attribution at the call (a free group releases
    the pages later, when the request is no longer known)."""
    if not state.on() or free_index.numel() == 0 or state.guard.release_row is None:
        return original(allocator, free_index)
    return original(allocator, _attributed(free_index, allocator.page_size))


def around_paged_free_page_ids(original, allocator, page_ids):
    """PagedTokenToKVPoolAllocator.free_page_ids (pages): the same."""
    if not state.on() or page_ids.numel() == 0 or state.guard.release_row is None:
        return original(allocator, page_ids)
    return original(allocator, _attributed(page_ids, 1))


def around_release_pages(original, allocator, *page_ids):
    """PagedTokenToKVPoolAllocator._release_page_ids: pages really re-enter the free list."""
    if not state.on() or not page_ids:
        return original(allocator, *page_ids)
    return original(allocator, *[state.guard.on_release(p) for p in page_ids])


def around_token_free(original, allocator, free_index):
    """TokenToKVPoolAllocator.free (page size 1): attribution, then the release itself (a free
    group comes back here ungrouped, with no request attributed)."""
    if not state.on() or free_index.numel() == 0:
        return original(allocator, free_index)
    if state.guard.release_row is not None:
        free_index = _attributed(free_index, 1)
    if allocator.free_group is not None:
        return original(allocator, free_index)
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

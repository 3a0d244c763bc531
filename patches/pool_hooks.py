"""Hooks on SGLang's allocators and page table: pages handed out, pages returned to the free list
(attributed to the request being released, so a stale holder cannot free pages someone else now
holds), rows handed to new requests.

Each hook contains the guard's failures and fails closed: the engine's own call always runs; what
the guard could not record makes the next step check refuse the request that relies on it (a
hand-out not recorded cannot be claimed, a row not reset does not add up), and a release the
guard could not judge frees nothing (a leak SGLang's idle check finds and the guard repairs),
never a page twice or a quarantined page unscrubbed."""

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
    """The slots whose pages the request being released may free (all, outside a release;
    none if the guard cannot tell)."""
    try:
        keep = state.guard.attribute_free(
            torch.div(slots.to(torch.int64), page_size, rounding_mode="floor")
        )
    except Exception as exc:
        state.guard.internal_error("free", exc)
        return slots[:0]
    return slots if bool(keep.all()) else slots[keep]


def _released(pages: torch.Tensor) -> torch.Tensor:
    """The pages that may really re-enter the free list (none if the guard cannot tell)."""
    try:
        return state.guard.on_release(pages)
    except Exception as exc:
        state.guard.internal_error("free", exc)
        return pages[:0]


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
    return original(allocator, *[_released(p) for p in page_ids])


def around_token_free(original, allocator, free_index):
    """TokenToKVPoolAllocator.free (page size 1): attribution, then the release itself (a free
    group comes back here ungrouped, with no request attributed)."""
    if not state.on() or free_index.numel() == 0:
        return original(allocator, free_index)
    if state.guard.release_row is not None:
        free_index = _attributed(free_index, 1)
    if allocator.free_group is not None:
        return original(allocator, free_index)
    return original(allocator, _released(free_index))


# -- allocator allocations and clears (AFTER) --------------------------------------------------------------------
def on_slots_allocated(result, allocator, *args, **kwargs):
    if state.on() and isinstance(result, torch.Tensor) and result.numel():
        try:
            state.guard.on_alloc(result)
        except Exception as exc:  # not recorded: the write that claims these pages is refused
            state.guard.internal_error("alloc", exc)
    return result


# -- ReqToTokenPool.alloc_rows (AFTER) ---------------------------------------------------------------------
def on_rows_allocated(result, pool, *args, **kwargs):
    if state.guard is not None and result:
        try:
            state.guard.on_rows_allocated(
                torch.tensor(result, dtype=torch.int64, device=state.guard.ledger.device)
            )
        except Exception as exc:  # the row's records disagree: its first check refuses it
            state.guard.internal_error("row", exc)
    return result

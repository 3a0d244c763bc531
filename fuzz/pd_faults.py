"""Faults in a prefill/decode pair's KV hand-off, injected on the decode server through SGLang's
real transfer path: the destination pages the decode server sends the prefill server
(``DecodePreallocQueue._transfer_page_indices``), which the prefill's transfer engine then writes.
What the guard's hand-off checks (docs/pd.md) must catch.

- ``transfer_misdirected``: one destination page index wrong (the middle one names the page
  after it), as an index-translation bug delivers part of a transfer to the wrong slots: two
  pages' KV land in one page's slots and the page that should have been named is left
  unwritten. (A mere permutation of the request's own pages would not do: attention over a set of
  keys is blind to the slots they sit in.) The bytes land in pages the request owns, so ownership
  sees nothing wrong; the prefill's seal does. Needs two pages or more.
- ``transfer_truncated``: the last destination page dropped. SGLang's prefill then sends fewer
  pages than it holds (``mooncake/conn.py`` cuts its source pages to the destination's count
  with a warning, "this should never happen"): the request's last page is left unwritten.
  Needs two pages or more.
- ``transfer_into_reused``: one destination page index (the middle one) names a page another
  request holds and reads: the first page of the running request with the most tokens still to
  decode. The end state of sglang #24226 and #38961 (a transfer issued into slots that were freed
  and handed out again before it landed): the other request's KV is overwritten with this one's,
  and this request's own page is left unwritten. Two victims: this request (at its landing) and
  the page's holder (at its next read, in the modes that verify reads). Needs two pages or more
  and a running request holding a page of its own with 8 tokens or more still to decode.
- ``transfer_wrong_room``: the destination pages are those of another request whose own
  transfer is still in flight (the latest in the transfer queue; as many of them as both have,
  this request's own beyond), as a prefill that matched a transfer to the wrong bootstrap room:
  this request's KV lands in the other's slots (whether before or after the other's own bytes
  is the transfer engine's race), and this request's pages are left unwritten. Victims: this
  request, and the other where this transfer lands last. Needs a transfer in flight.

A page left unwritten is zeroed when the fault is injected: a freed page keeps its bytes, and
what it held could be, by chance, the very KV the request should find there (the same prompt
served before on the same pages: a campaign's clean pass), which is no fault. For the two
classes that reach another request's pages, that request is logged as the ``holder``
(``holder_rid``, ``holder_room``).

Plan entries of these classes (control file, as for every class) are armed when read; each
transfer takes the first armed entry it fits (an entry waiting for a running request does not
hold back the others) and logs ``injected`` with the request, its bootstrap room and its page
count. ``fuzz/pd_campaign.py`` runs a campaign on a pair and scores it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvguard.fuzz import kvbytes

PD_CLASSES = (
    "transfer_misdirected",
    "transfer_truncated",
    "transfer_into_reused",
    "transfer_wrong_room",
)


@dataclass(frozen=True, slots=True)
class Fault:
    pages: np.ndarray  # the destination pages sent in place of the request's own
    left: list[int]  # the request's own pages no byte of this transfer will reach
    holder: object = None  # the request whose pages it reaches instead, if another holds them


def misdirected(pages: np.ndarray, queue) -> Fault | None:
    """The destination pages with the middle one naming the next; None for one page."""
    if len(pages) < 2:
        return None
    k = (len(pages) - 1) // 2
    out = pages.copy()
    out[k] = pages[k + 1]
    return Fault(out, [int(pages[k])])


def truncated(pages: np.ndarray, queue) -> Fault | None:
    """The destination pages without the last; None where there is one page only."""
    if len(pages) < 2:
        return None
    return Fault(pages[:-1], [int(pages[-1])])


HOLDER_TOKENS_LEFT = 8  # a holder this far from done still reads its page when the bytes land


def into_reused(pages: np.ndarray, queue) -> Fault | None:
    """The destination pages with the middle one naming the first page of the running request
    with the most tokens still to decode (``HOLDER_TOKENS_LEFT`` at least, no prefix-cache page
    shared); None for one page or no such request."""
    if len(pages) < 2:
        return None
    page_size = queue.token_to_kv_pool_allocator.page_size
    rows = queue.req_to_token_pool.req_to_token

    def left(r) -> int:
        return int(r.sampling_params.max_new_tokens) - len(r.output_ids)

    holders = [
        r
        for r in queue.scheduler.running_batch.reqs
        if r.finished_reason is None
        and r.kv.kv_committed_len >= page_size
        and r.kv.cache_protected_len == 0  # its first page is its own, not a cached prefix
        and left(r) >= HOLDER_TOKENS_LEFT
    ]
    if not holders:
        return None
    holder = max(holders, key=left)
    k = (len(pages) - 1) // 2
    out = pages.copy()
    out[k] = int(rows[holder.kv.req_pool_idx, 0]) // page_size
    return Fault(out, [int(pages[k])], holder)


def wrong_room(pages: np.ndarray, queue) -> Fault | None:
    """The pages of the latest request in the transfer queue in place of as many of this
    request's first pages (the rest its own); None where no transfer is in flight."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    page_size = queue.token_to_kv_pool_allocator.page_size
    rows = queue.req_to_token_pool.req_to_token
    for pending in reversed(queue.transfer_queue.queue):
        other = pending.req
        if _is_fake_transfer(other) or other.finished_reason is not None:
            continue
        if other.kv.cache_protected_len:  # pages of a cached prefix: other requests' too
            continue
        n = len(other.origin_input_ids)
        theirs = (rows[other.kv.req_pool_idx, 0:n:page_size] // page_size).cpu().numpy()
        k = min(len(theirs), len(pages))
        if k:
            out = np.concatenate([theirs[:k], pages[k:]])
            return Fault(out, [int(p) for p in pages[:k]], other)
    return None


FAULTS = {
    "transfer_misdirected": misdirected,
    "transfer_truncated": truncated,
    "transfer_into_reused": into_reused,
    "transfer_wrong_room": wrong_room,
}


def zero_pages(queue, pages: list[int]) -> None:
    """Zero the KV of ``pages``: what they held before (freed pages keep their bytes) could be,
    by chance, the very KV the request should find there (the same prompt served before, on the
    same pages); zeros never are."""
    page_size = queue.token_to_kv_pool_allocator.page_size
    slots = (torch.tensor(pages)[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    kvbytes.zero(queue.token_to_kv_pool_allocator.get_kvcache(), slots)


def fault_transfer(st, original, queue, decode_req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._transfer_page_indices`` (registered by the plugin, which
    passes its state ``st``): the armed fault, if one is, applied to the page indices SGLang is
    about to send the prefill server."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    pages = original(queue, decode_req, *args, **kwargs)
    if st is None or _is_fake_transfer(decode_req.req):  # a health check moves no KV
        return pages
    try:
        st.poll()  # an entry written since the last step is armed now
        if not st.pd_armed:
            return pages
        for entry in list(st.pd_armed):  # the first armed entry this transfer fits
            try:
                fault = FAULTS[entry["cls"]](np.asarray(pages), queue)
            except Exception as exc:  # one broken entry holds back no other: dropped, logged
                st.pd_armed.remove(entry)
                st.log({"event": "injector_error", "id": entry["id"], "step": st.step,
                        "error": repr(exc)})  # fmt: skip
                continue
            if fault is not None:
                break
        else:
            return pages  # fits none: the next transfer
        st.pd_armed.remove(entry)
        zero_pages(queue, fault.left)
        req = decode_req.req
        detail = {"rid": req.rid, "room": req.bootstrap_room, "pages": len(pages)}
        if fault.holder is not None:
            detail.update(holder_rid=fault.holder.rid, holder_room=fault.holder.bootstrap_room)
        st.log({"event": "injected", "id": entry["id"], "cls": entry["cls"], "step": st.step,
                "detail": detail})  # fmt: skip
        return fault.pages.astype(np.asarray(pages).dtype)
    except Exception as exc:  # the fuzz tool never breaks the server it tests
        st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
        return pages

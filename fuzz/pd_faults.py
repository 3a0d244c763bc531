"""Faults in a prefill/decode pair's KV hand-off, injected on the decode server through SGLang's
real transfer path: the destination pages the decode server sends the prefill server
(``DecodePreallocQueue._transfer_page_indices``), which the prefill's transfer engine then writes.
What the guard's hand-off checks (docs/pd.md) must catch.

- ``transfer_misdirected``: one destination page index wrong (the middle one names the page
  after it), as an index-translation bug delivers part of a transfer to the wrong slots: two
  pages' KV land in one page's slots and the page that should have been named keeps what it held
  before. (A mere permutation of the request's own pages would not do: attention over a set of
  keys is blind to the slots they sit in.) The bytes land in pages the request owns, so ownership
  sees nothing wrong; the prefill's seal does. Needs two pages or more.
- ``transfer_truncated``: the last destination page dropped. SGLang's prefill then sends fewer
  pages than it holds (``mooncake/conn.py`` cuts its source pages to the destination's count
  with a warning, "this should never happen"): the request's last page keeps what it held before.
  Needs two pages or more.

Plan entries of these classes (control file, as for every class) are armed when read and taken, in
order, by the next transfers that fit; each logs ``injected`` with the request, its bootstrap room
and its page count. A PD campaign's accounting (victims, escapes) is not built: the engine tests
check the outcome."""

from __future__ import annotations

import numpy as np

PD_CLASSES = ("transfer_misdirected", "transfer_truncated")


def misdirected(pages: np.ndarray) -> np.ndarray | None:
    """The destination pages with the middle one naming the next; None for one page."""
    if len(pages) < 2:
        return None
    k = (len(pages) - 1) // 2
    out = pages.copy()
    out[k] = pages[k + 1]
    return out


def truncated(pages: np.ndarray) -> np.ndarray | None:
    """The destination pages without the last; None where there is one page only."""
    if len(pages) < 2:
        return None
    return pages[:-1]


FAULTS = {"transfer_misdirected": misdirected, "transfer_truncated": truncated}


def around_transfer_page_indices(original, queue, decode_req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._transfer_page_indices``: the armed fault, if one is, applied
    to the page indices SGLang is about to send the prefill server."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer

    from kvguard.fuzz import plugin

    pages = original(queue, decode_req, *args, **kwargs)
    st = plugin.state()
    if st is None or _is_fake_transfer(decode_req.req):  # a health check moves no KV
        return pages
    try:
        st.poll()  # an entry written since the last step is armed now
        if not st.pd_armed:
            return pages
        entry = st.pd_armed[0]
        faulty = FAULTS[entry["cls"]](np.asarray(pages))
        if faulty is None:
            return pages  # does not fit this request: the next one
        st.pd_armed.pop(0)
        req = decode_req.req
        st.log({"event": "injected", "id": entry["id"], "cls": entry["cls"], "step": st.step,
                "detail": {"rid": req.rid, "room": req.bootstrap_room,
                           "pages": len(pages)}})  # fmt: skip
        return faulty.astype(np.asarray(pages).dtype)
    except Exception as exc:  # the fuzz tool never breaks the server it tests
        st.log({"event": "injector_error", "step": st.step, "error": repr(exc)})
        return pages

"""A transfer (KV another server writes: the decode side of prefill/decode disaggregation) is a
writer the guard checks: its pages are claimed for the receiving request when it is issued, sealed
when it lands if that claim is unchanged, and flagged otherwise; KV that neither a forward nor a
landed transfer wrote is still flagged at its first read. On the synthetic pool, in every mode."""

from __future__ import annotations

import pytest
import torch
from synthetic_pool import Request, SyntheticPool

from kvguard.kernels.guard_state import EPOCH_STEP_SHIFT, PageState
from kvguard.verdict import Kind

MODES = ("tags", "sampled", "verified", "paranoid")
CHECKSUM_MODES = ("sampled", "verified", "paranoid")


def _pool(mode: str, ps: int) -> SyntheticPool:
    return SyntheticPool(page_size=ps, num_pages=1024 // ps + 16, mode=mode, max_len=256,
                         sweep_tokens_per_step=4096)  # fmt: skip


def _tokens(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 500 for i in range(n)]


def _receive(pool: SyntheticPool, n: int, salt: int = 0) -> tuple[Request, torch.Tensor]:
    """A request whose first n tokens' KV will arrive by transfer: row and pages handed out as a
    decode server's pre-allocation does, the transfer issued. Returns it and its slots."""
    ps = pool.ps
    req = pool.admit(_tokens(n + 16, salt))
    n_pages = -(-n // ps)
    req.pages = [pool._take_page() for _ in range(n_pages)]
    slots = torch.tensor([req.pages[p // ps] * ps + p % ps for p in range(n)], dtype=torch.int64)
    pool.table[req.row, :n] = slots.to(torch.int32)
    pool.guard.on_alloc(slots[::ps].clone())
    kinds = pool.guard.on_transfer_issued(
        req.row, slots, torch.tensor(req.tokens[:n], dtype=torch.int64)
    )
    assert kinds == 0
    return req, slots


def _land(pool: SyntheticPool, req: Request, slots: torch.Tensor, n: int) -> Kind | None:
    """The transfer's bytes arrive (what the prefill's forward wrote), then it is reported done."""
    pos = torch.arange(n, dtype=torch.int64)
    pool.write_kv(slots, torch.tensor(req.tokens[:n], dtype=torch.int64), pos)
    v = pool.guard.on_transfer_landed(req.row, req, req.rid)
    req.length = n
    if v is None:
        return None
    pool.violations.append(v)
    return v.kinds


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("mode", MODES)
def test_landed_transfer_decodes_on_like_a_prefilled_request(mode, ps):
    pool = _pool(mode, ps)
    a, sa = _receive(pool, 37)
    b, sb = _receive(pool, 5, salt=1)
    assert _land(pool, a, sa, 37) is None and _land(pool, b, sb, 5) is None
    for _ in range(8):
        pool.forward([a, b], 1)
    c = pool.admit(_tokens(40, salt=2))  # a request prefilled here, beside them
    pool.forward([c], 20)
    for _ in range(4):
        pool.forward([a, b, c], 1)
    assert pool.flagged() == set()
    for r in (a, b, c):
        pool.release(r)
    assert len(pool.guard.transfers) == 0


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("mode", MODES)
def test_read_before_the_transfer_lands_is_flagged(mode, ps):
    pool = _pool(mode, ps)
    a, _ = _receive(pool, 33)
    other, so = _receive(pool, 9, salt=1)
    assert _land(pool, other, so, 9) is None
    a.length = 33  # the engine believes the KV arrived; nothing wrote it
    pool.forward([a, other], 1)
    assert pool.flagged() == {a.rid}
    v = next(v for v in pool.violations if v.request == a.rid)
    assert v.kinds & Kind.READ_UNWRITTEN


@pytest.mark.parametrize("mode", MODES)
def test_kv_no_transfer_claimed_is_flagged_at_first_read(mode):
    """Pages handed out for a transfer that was never issued to the guard: bytes are there
    (written behind its back), nothing vouches for them."""
    pool = _pool(mode, 16)
    req = pool.admit(_tokens(40))
    req.pages = [pool._take_page() for _ in range(2)]
    slots = torch.tensor([req.pages[p // 16] * 16 + p % 16 for p in range(20)])
    pool.table[req.row, :20] = slots.to(torch.int32)
    pool.guard.on_alloc(slots[::16].clone())
    pool.write_kv(slots, torch.tensor(req.tokens[:20]), torch.arange(20))
    req.length = 20
    pool.forward([req], 1)
    assert pool.flagged() == {req.rid}


@pytest.mark.parametrize("late_bytes", [False, True])
@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("mode", MODES)
def test_landing_into_pages_freed_and_reused_is_flagged(mode, ps, late_bytes):
    """The #24226 / #38961 mechanism: the receiving request's pages are released (its transfer
    still in flight) and handed to another request, which writes them; the old transfer then
    reports done. The stale receiver is flagged by ownership (nothing sealed). Its bytes landed
    either before the new owner wrote (the new owner decodes on) or after (``late_bytes``: the
    new owner's KV really changed, and every checksum mode flags it at its next read)."""
    pool = _pool(mode, ps)
    a, sa = _receive(pool, 32)
    pool.release(a)  # aborted while its transfer is in flight: pages back to the free list
    pool.free_pages = a.pages + [p for p in pool.free_pages if p not in a.pages]
    b = pool.admit(_tokens(40, salt=5))
    if not late_bytes:
        pool.write_kv(sa, torch.tensor(a.tokens[:32]), torch.arange(32))
    pool.forward([b], 32)  # b takes a's pages, claims and writes them
    assert set(b.pages) == set(a.pages)
    if late_bytes:
        pool.write_kv(sa, torch.tensor(a.tokens[:32]), torch.arange(32))
    v = pool.guard.on_transfer_landed(a.row, a, a.rid)
    assert v is not None and v.kinds == Kind.STALE_TRANSFER and a.aborted
    assert {p["page"] for p in v.pages} <= set(a.pages) and v.pages
    pool.violations.append(v)
    for _ in range(3):
        pool.forward([b], 1)
    victims = {a.rid, b.rid} if late_bytes and mode in CHECKSUM_MODES else {a.rid}
    assert pool.flagged() == victims


@pytest.mark.parametrize("mode", MODES)
def test_landing_for_a_row_handed_to_another_request_is_flagged(mode):
    pool = _pool(mode, 16)
    a, sa = _receive(pool, 20)
    pool.release(a)
    pool.free_rows.insert(0, pool.free_rows.pop())  # a's row is handed out next
    b = pool.admit(_tokens(30, salt=3))  # a's row, a new generation: a's claim dropped
    assert b.row == a.row
    assert _land(pool, a, sa, 20) == Kind.STALE_TRANSFER


@pytest.mark.parametrize("mode", MODES)
def test_claim_of_a_page_someone_holds_fails_and_its_holder_goes_on(mode):
    """The allocator hands a page a running request holds to a transfer (a double allocation):
    the claim takes nothing, the holder keeps its page, the receiver is flagged when its
    transfer lands."""
    ps = 16
    pool = _pool(mode, ps)
    holder = pool.admit(_tokens(40, salt=4))
    pool.forward([holder], 20)
    req = pool.admit(_tokens(40))
    req.pages = [holder.pages[0]]
    slots = holder.pages[0] * ps + torch.arange(16)
    pool.table[req.row, :16] = slots.to(torch.int32)
    kinds = pool.guard.on_transfer_issued(req.row, slots, torch.tensor(req.tokens[:16]))
    assert kinds & Kind.DOUBLE_ALLOCATION
    assert pool.guard.ledger.state[holder.pages[0]] == PageState.OWNED
    v = pool.guard.on_transfer_landed(req.row, req, req.rid)
    assert v is not None and v.kinds & Kind.DOUBLE_ALLOCATION and req.aborted
    for _ in range(3):
        pool.forward([holder], 1)
    assert pool.flagged() == set()


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("mode", CHECKSUM_MODES)
def test_bytes_changed_after_landing_are_flagged_at_first_read(mode, ps):
    """The landed bytes are sealed: a byte changed between the landing and the first decode's
    read fails its digest (within the rolling window in sampled mode)."""
    pool = _pool(mode, ps)
    a, sa = _receive(pool, 30)
    b, sb = _receive(pool, 12, salt=1)
    assert _land(pool, a, sa, 30) is None and _land(pool, b, sb, 12) is None
    buf = pool.bufs[0]
    buf[int(sa[17])].view(-1)[0] ^= 0x10
    for _ in range(3):
        pool.forward([a, b], 1)
    assert pool.flagged() == {a.rid}


def test_transfer_epochs_never_meet_a_forward_s_epochs():
    """Claimed between forward s and forward s + 1, a transfer's epochs carry step s + 1 (the
    verdict of step s, read after it, never takes them for its own) above any write index of
    forward s + 1."""
    pool = _pool("tags", 1)
    c = pool.admit(_tokens(10))
    pool.forward([c], 10)
    step = pool.guard.step
    a, _ = _receive(pool, 4)
    d = pool.admit(_tokens(10, salt=1))
    pool.forward([d], 10)
    L = pool.guard.ledger
    xfer = L.epoch[torch.tensor(a.pages)]
    fwd = L.epoch[torch.tensor(c.pages + d.pages)]
    assert bool(((xfer >> EPOCH_STEP_SHIFT) == step + 1).all())
    assert not bool(torch.isin(xfer, fwd).any())
    assert torch.unique(xfer).numel() == xfer.numel()


# -- the sender's seal: it travels with the transfer and is compared with the bytes that landed --
def _sent(sender: SyntheticPool, n: int, salt: int = 0) -> tuple[Request, int | None]:
    """A request prefilled on the sender (its forward writes and seals its KV): the seal of its
    positions [0, n), as the sender hands it to the transfer."""
    req = sender.admit(_tokens(n + 16, salt))
    sender.forward([req], n)
    assert sender.flagged() == set()
    slots = sender.table[req.row, :n].to(torch.int64)
    return req, sender.guard.on_transfer_sent(slots)


def _land_sealed(
    pool: SyntheticPool, req: Request, slots: torch.Tensor, n: int, seal, sent_n: int, flip=False
) -> Kind | None:
    pool.write_kv(slots, torch.tensor(req.tokens[:n], dtype=torch.int64), torch.arange(n))
    if flip:  # a byte changed in flight: it lands changed
        row_words_of = pool.guard.checker.kv_buffers[0]
        row_words_of[int(slots[n // 2])].view(torch.uint8).reshape(-1)[0] ^= 0x10
    v = pool.guard.on_transfer_landed(req.row, req, req.rid, seal, sent_n)
    req.length = n
    return None if v is None else v.kinds


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("receiver_mode", MODES)
@pytest.mark.parametrize("sender_mode", MODES)
def test_landed_bytes_match_the_sender_s_seal(sender_mode, receiver_mode, ps):
    """The seal is a sum of position-keyed token digests: the sender's (from its ledger in the
    checksum modes, from the bytes in tags) equals the receiver's of the same bytes in other
    slots, in any pair of modes; a request served from it decodes on unflagged."""
    sender, pool = _pool(sender_mode, ps), _pool(receiver_mode, ps)
    for _ in range(3):  # the receiver's pages differ from the sender's
        pool._take_page()
    _, seal = _sent(sender, 37)
    assert seal is not None
    a, sa = _receive(pool, 37)
    assert _land_sealed(pool, a, sa, 37, seal, 37) is None
    for _ in range(4):
        pool.forward([a], 1)
    assert pool.flagged() == set()


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("mode", MODES)
def test_bytes_changed_in_flight_are_caught_on_landing_in_every_mode(mode, ps):
    sender, pool = _pool("verified", ps), _pool(mode, ps)
    _, seal = _sent(sender, 37)
    a, sa = _receive(pool, 37)
    b, sb = _receive(pool, 21, salt=1)
    _, seal_b = _sent(sender, 21, salt=1)
    assert _land_sealed(pool, a, sa, 37, seal, 37, flip=True) == Kind.TRANSFER_MISMATCH
    assert a.aborted
    assert _land_sealed(pool, b, sb, 21, seal_b, 21) is None  # the request beside it lands
    pool.forward([b], 1)
    assert pool.flagged() == set()


@pytest.mark.parametrize("mode", MODES)
def test_a_seal_of_another_request_or_range_is_a_mismatch(mode):
    sender, pool = _pool("verified", 16), _pool(mode, 16)
    _, seal_other = _sent(sender, 37, salt=9)  # another request's KV, same length
    _, seal = _sent(sender, 37)
    a, sa = _receive(pool, 37)
    assert _land_sealed(pool, a, sa, 37, seal_other, 37) == Kind.TRANSFER_MISMATCH
    b, sb = _receive(pool, 37)
    assert _land_sealed(pool, b, sb, 37, seal, 36) == Kind.TRANSFER_MISMATCH  # truncated
    c, sc = _receive(pool, 37)
    assert _land_sealed(pool, c, sc, 37, None, 37) == Kind.TRANSFER_MISMATCH  # not vouched for


def test_the_sender_cannot_vouch_for_positions_its_ledger_does_not_hold():
    """Checksum modes seal from the ledger (the bytes as written): slots that are not the
    request's sealed positions [0, n) have no seal; tags mode hashes whatever bytes are there."""
    sender = _pool("verified", 16)
    req = sender.admit(_tokens(40))
    sender.forward([req], 20)
    slots = sender.table[req.row, :40].to(torch.int64)  # 20 of them never written
    assert sender.guard.on_transfer_sent(slots) is None
    assert sender.guard.on_transfer_sent(slots[:20]) is not None
    assert sender.guard.on_transfer_sent(slots[1:20]) is None  # out of place

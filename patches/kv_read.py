"""The batch's KV read in SGLang's ``torch_native`` attention, where the guard verifies what
attention consumes (hook functions named in ``targets.py``, READ_TARGETS).

SGLang's SDPA loop gathers each request's K/V rows from the pool, per layer. ``around_sdpa``
gathers the rows the whole batch reads once per layer and buffer instead, in one compiled call
(``kernels/read_verify.py``), and hands SGLang's own SDPA loop that compact copy through a
remapped page table:

* FP8 pools (``cpu_fp8_kv``): the copy is dequantized on the way (a 256-entry table per layer,
  scale included), in every guard mode: it is how FP8 KV is served on CPU.
* When the guard verifies reads (``Guard.verifies_reads``): each row gathered also adds its
  buffer's part of the token checksum into a per-row accumulator, so after the last layer the
  guard holds the checksum of exactly the bytes attention read, and judges them against the
  sealed page digests before the step's tokens leave (``Guard.after_forward``).
* Otherwise (a BF16 pool, guard off or not verifying reads) SGLang's own loop runs untouched.

The rows are taken from the page table once per forward, at its first attention layer, and
reused by every layer: what is verified is what every layer read.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from kvguard.kernels.kv_checksum_ref import KvBuffer, PageMajor
from kvguard.patches import cpu_fp8_kv, kv_write, state
from kvguard.step import ReadSums

_local = threading.local()  # the attention layer running now, and this forward's read record


@dataclass(slots=True)
class ReadRecord:
    """One forward's read, as the guard needs it after the last layer."""

    forward_batch: object
    rows: torch.Tensor  # [N] int64: every slot read, request by request, position by position
    seq_lens: list[int]  # [B] positions read per request (the rows' segments)
    req_rows: torch.Tensor  # [B] int64: each request's page-table row
    table: torch.Tensor  # [B, max_len] int64: a request's position -> index into rows
    acc: torch.Tensor | None  # [N] int64: checksum inner sums of what was read (verifying)
    buffers: list[int] = field(default_factory=list)  # the pool buffers hashed into acc, per read
    failed: bool = False  # this forward's read could not be taken here: never vouched for


def read_path_unavailable(model_runner) -> str | None:
    """Why this runner's attention reads cannot be hashed as they are read (None: they can).
    A CPU DSA pool's reads are hashed by ``dsa_cpu`` (its indexer and sparse MLA read through
    :func:`hashed_rows`), as torch_native's are here."""
    backend = type(getattr(model_runner, "attn_backend", None)).__name__
    if backend != "TorchNativeAttnBackend":
        return f"attention backend {backend} (reads are hashed in torch_native only)"
    pool = model_runner.token_to_kv_pool
    if str(getattr(pool, "device", "cpu")) != "cpu":
        return "a GPU pool (no verified-read attention kernel for it yet)"
    try:
        from kvguard.kernels import read_verify  # noqa: F401
    except ImportError as exc:
        return f"compiled read kernels missing ({exc})"
    return None


def clear_record() -> None:
    """A forward starts: nothing read yet (a forward that failed midway leaves no record)."""
    _local.record = None


def take_record() -> ReadRecord | None:
    """What this thread's forward read (and hashed) since ``clear_record`` (cleared)."""
    rec = getattr(_local, "record", None)
    _local.record = None
    return rec


def take_sums() -> ReadSums | None:
    """The guard's view of this forward's hashed read (None: nothing was hashed)."""
    rec = take_record()
    if rec is None or rec.acc is None or rec.failed:
        return None
    return ReadSums(rec.rows, rec.seq_lens, rec.req_rows, rec.acc, rec.buffers)


# -- TorchNativeAttnBackend.forward_extend / forward_decode (AROUND) ----------------------------------
def around_attention(original, backend, q, k, v, layer, forward_batch, *args, **kwargs):
    """Tell ``around_sdpa`` which layer reads, and with which FP8 tables (None: not FP8)."""
    pool = backend.token_to_kv_pool
    tables = cpu_fp8_kv.read_tables(pool, layer, q.dtype)
    guard = state.guard
    verifying = guard is not None and guard.active and guard.verifies_reads
    if tables is None and not verifying:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    first_layer = layer.layer_id == getattr(pool, "start_layer", 0)
    scale_error = None
    if verifying and tables is not None:
        try:  # dequantized with the scales its KV was written with, or never vouched for
            kv_write.check_scales(pool, layer.layer_id, cpu_fp8_kv.kv_scales(pool, layer))
        except ValueError as exc:
            scale_error = str(exc)
    _local.read = (tables, forward_batch, first_layer, guard if verifying else None, scale_error)
    try:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    finally:
        _local.read = None


# -- TorchNativeAttnBackend._run_sdpa_forward_extend / _decode (AROUND) ----------------------------
def around_sdpa(
    original,
    backend,
    query,
    output,
    k_cache,
    v_cache,
    req_to_token,
    req_pool_indices,
    seq_lens,
    *args,
    **kwargs,
):
    """SGLang's SDPA loop over a compact copy of exactly the K/V rows this batch reads (gathered,
    dequantized if FP8, hashed if the guard verifies reads) and a page table into that copy."""
    read = getattr(_local, "read", None)
    if read is None:
        return original(
            backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            *args, **kwargs,
        )  # fmt: skip
    tables, forward_batch, first_layer, guard, scale_error = read
    try:
        rec = _record(forward_batch, first_layer, req_to_token, req_pool_indices, seq_lens, guard)
        if scale_error is not None:
            raise UnverifiableRead(scale_error)
        if forward_batch.encoder_lens is not None:  # cross-attention: not modelled here
            raise UnverifiableRead("encoder-decoder attention")
        k_table, v_table = tables if tables is not None else (None, None)
        k = _gather(guard, rec, k_cache, k_table)
        if v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[:-1] == k_cache.shape[:-1]:
            v = k[..., : v_cache.shape[-1]]  # MLA: V is the latent part of the same rows
        else:
            v = _gather(guard, rec, v_cache, v_table)
    except Exception as exc:
        # The read cannot be taken (and hashed) here: SGLang's own loop serves it, the record
        # says failed, and the guard fails the step closed after the forward (nothing
        # unverified leaves; the scheduler goes on).
        _fail(forward_batch, exc)
        _local.read = None  # a nested wrapper passes SGLang's own read through
        try:
            return original(
                backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                seq_lens, *args, **kwargs,
            )  # fmt: skip
        finally:
            _local.read = read
    batch = torch.arange(rec.table.shape[0], device=rec.table.device)
    _local.read = None  # the copy is what SGLang's loop reads: a nested wrapper passes it through
    try:
        return original(backend, query, output, k, v, rec.table, batch, seq_lens, *args, **kwargs)
    finally:
        _local.read = read


class UnverifiableRead(RuntimeError):
    """Attention read KV the guard cannot verify: the step fails closed."""


def _fail(forward_batch, exc: Exception) -> None:
    rec = getattr(_local, "record", None)
    if rec is None or rec.forward_batch is not forward_batch:
        empty = torch.empty(0, dtype=torch.int64)
        rec = ReadRecord(forward_batch, empty, [], empty, empty.view(0, 0), None)
        _local.record = rec
    if not rec.failed:
        rec.failed = True
        guard = state.guard
        if guard is not None:
            guard.internal_error("read", exc)


def _gather(guard, rec: ReadRecord, cache: torch.Tensor, table, index_of=None) -> torch.Tensor:
    """``index_of``: the guarded buffer ``cache`` views (default: ``cache`` itself)."""
    from kvguard.kernels import read_verify

    index = None
    if guard is not None and rec.acc is not None:
        index = guard.buffer_index(cache if index_of is None else index_of)
        if index is None:
            raise UnverifiableRead(
                f"attention read a buffer the guard does not hold ({cache.shape})"
            )
        rec.buffers.append(index)
    base = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    t0 = time.thread_time()
    out = read_verify.gather_rows(
        base, rec.rows, table, index, rec.acc if index is not None else None
    )
    if index is not None:  # hashed: the guard's time (the gather whole, an upper bound)
        guard.account_in_forward(time.thread_time() - t0)
    return out if table is not None else out.view(cache.dtype)


# -- reads outside torch_native's SDPA loop (dsa_cpu: the indexer's keys, sparse MLA's latents) -----
def verifying_guard():
    """The guard when it verifies reads (attention must hash what it reads), else None."""
    guard = state.guard
    return guard if guard is not None and guard.active and guard.verifies_reads else None


def hashed_rows(guard, forward_batch, req_to_token, buffer: KvBuffer) -> torch.Tensor:
    """Every row the batch reads from ``buffer`` (the record's rows: request by request,
    position by position) as stored, each row's checksum part folded into this forward's record.
    Slot-major buffers give ``[N, *row shape]``, page-major ones ``[N, row_bytes]`` uint8. A read
    that cannot be taken raises: the caller reads unhashed and the step fails closed
    (:func:`fail_read`)."""
    rec = _record(
        forward_batch, False, req_to_token, forward_batch.req_pool_indices,
        forward_batch.seq_lens, guard,
    )  # fmt: skip
    if not isinstance(buffer, PageMajor):
        return _gather(guard, rec, buffer, None)
    virtual, rows = _slot_major(buffer, rec.rows)
    saved, rec.rows = rec.rows, rows
    try:
        return _gather(guard, rec, virtual, None, index_of=buffer).view(torch.uint8)
    finally:
        rec.rows = saved


def check_segments(forward_batch) -> None:
    """A reader that slices the hashed rows by its own per-request lengths (``dsa_cpu``, by
    ``seq_lens_cpu``) must slice what was hashed: raise unless this forward's read record has
    the same rows and lengths."""
    rec = getattr(_local, "record", None)
    rows = forward_batch.req_pool_indices.tolist()
    lens = forward_batch.seq_lens_cpu.tolist()
    if rec is None or rec.req_rows.tolist() != rows or rec.seq_lens != lens:
        raise UnverifiableRead(
            f"attention slices requests {rows} by lengths {lens}; the hashed read has "
            f"{None if rec is None else (rec.req_rows.tolist(), rec.seq_lens)}"
        )


def fail_read(forward_batch, exc: Exception) -> None:
    """A read outside the SDPA loop could not be hashed: the step fails closed."""
    _fail(forward_batch, exc)


def _slot_major(buffer: PageMajor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A page-major buffer as a slot-major view with a row stride (the page-major row stride
    divides the page stride, as in DSA's index pages: 8448 = 66 x 128 = 2112 x 4), and the slots
    ``rows`` mapped into it; a slot outside the buffer maps to -1 (read as out of pool)."""
    w = buffer.words  # int32 [pages, per_page, words]
    pages, per_page, words = w.shape
    page_stride, row_stride = w.stride(0), w.stride(1)
    if pages == 0 or row_stride < words or page_stride % row_stride or w.stride(2) != 1:
        raise UnverifiableRead(f"a page-major buffer with strides {w.stride()}")
    ratio = page_stride // row_stride
    virtual = w.as_strided(((pages - 1) * ratio + per_page, words), (row_stride, 1))
    inside = (rows >= 0) & (rows < pages * per_page)
    mapped = (rows // per_page) * ratio + rows % per_page
    return virtual, torch.where(inside, mapped, -1).contiguous()


def _record(
    forward_batch, first_layer, req_to_token, req_pool_indices, seq_lens, guard
) -> ReadRecord:
    """The slots the batch reads, concatenated per request, and a [batch, max_len] table mapping
    each request's positions into that concatenation: taken at the forward's first attention
    layer, reused by the others."""
    rec = getattr(_local, "record", None)
    if not first_layer and rec is not None and rec.forward_batch is forward_batch:
        if rec.failed:
            raise UnverifiableRead("this forward's read already failed")
        return rec
    lens = seq_lens.tolist()
    if not lens or min(lens) < 0:
        raise UnverifiableRead(f"a batch reading {lens} positions")
    req_rows = req_pool_indices.to(torch.int64)
    rows = torch.cat([req_to_token[r, :n] for r, n in zip(req_rows.tolist(), lens)])
    rows = rows.to(torch.int64).contiguous()
    starts = torch.tensor([0, *lens[:-1]], dtype=torch.int64).cumsum(0)
    table = starts[:, None] + torch.arange(max(lens), dtype=torch.int64)[None, :]
    acc = torch.zeros(rows.numel(), dtype=torch.int64) if guard is not None else None
    rec = ReadRecord(forward_batch, rows, lens, req_rows.cpu(), table, acc)
    _local.record = rec
    return rec

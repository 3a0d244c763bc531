"""Writers' digests: each store is hashed from the bytes its layer hands SGLang's pool (after the
cast to the storage dtype), not from what the pool holds afterwards.

The compiled row hash agrees with its torch reference; through SGLang's real MHA and MLA stores
(FP8 with and without write scales, BF16) the writer's digests equal the digests of the bytes
that landed; a store that never lands, or that no hook digested, is not certified. The guard-level
scenarios (a store lost, or landing in another request's or the same request's slot) run in
``tests/test_guard_semantics.py`` and ``tests/test_guard_kernels.py``."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from test_fp8_kv import DIM, KV_HEADS, LORA, ROPE, _mla_setup, _qkv, _setup, sgl  # noqa: F401

from kvguard.config import GuardConfig
from kvguard.guard import Guard
from kvguard.kernels import read_verify as compiled
from kvguard.kernels import read_verify_ref as ref
from kvguard.kernels.kv_checksum_ref import fmix64, poskey, token_digests_ref
from kvguard.patches import cpu_fp8_kv, kv_read, kv_write, state
from kvguard.patches.adapter import guarded_kv_buffers
from kvguard.patches.targets import MLA_TARGETS, QUANT_TARGETS, READ_TARGETS, WRITE_TARGETS

MODULES = {"cpu_fp8_kv": cpu_fp8_kv, "kv_read": kv_read, "kv_write": kv_write}


@pytest.mark.parametrize("shape", [(5, 2, 16), (1, 80), (0, 8), (7, 4)])
def test_hash_rows_compiled_matches_reference(shape):
    g = torch.Generator().manual_seed(len(shape))
    rows = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    row_bytes = rows[0].numel() if shape[0] else 8
    acc_c = torch.randint(-(1 << 62), 1 << 62, (shape[0],), generator=g)
    acc_r = acc_c.clone()
    compiled.hash_rows(rows, 3, acc_c)
    ref.hash_rows(rows, ref.buffer_constants(3, row_bytes), acc_r)
    assert torch.equal(acc_c, acc_r)
    if shape[0] > 1:  # rows of a wider tensor (a strided slot dimension)
        wide = torch.cat([rows.reshape(shape[0], -1), rows.reshape(shape[0], -1)], dim=1)
        acc_s = torch.zeros(shape[0], dtype=torch.int64)
        compiled.hash_rows(wide[:, :row_bytes], 3, acc_s)
        want = torch.zeros(shape[0], dtype=torch.int64)
        ref.hash_rows(rows.reshape(shape[0], -1), ref.buffer_constants(3, row_bytes), want)
        assert torch.equal(acc_s, want)


# The Triton kernel (GPU pools) against the reference, under Triton's interpreter: it must be set
# before triton is imported, so the check runs in a subprocess on CPU tensors.
_TRITON_CHECK = """
import torch
from kvguard.kernels import read_verify, read_verify_ref as ref
from kvguard.kernels.triton_write_digest import hash_rows
g = torch.Generator().manual_seed(7)
for n, shape in ((5, (2, 16)), (1, (80,)), (33, (4, 132)), (3, (4,)), (0, (8,))):
    rows = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
    row_bytes = rows[0].numel() if n else 8
    acc = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)
    want = acc.clone()
    lo, hi = read_verify.constant_halves(2, row_bytes)
    hash_rows(rows, lo, hi, acc)
    ref.hash_rows(rows, ref.buffer_constants(2, row_bytes), want)
    assert torch.equal(acc, want), (n, shape)
    if n > 1:  # rows of a wider tensor: a strided slot dimension
        wide = torch.cat([rows.reshape(n, -1)] * 2, dim=1)[:, :row_bytes]
        acc = torch.zeros(n, dtype=torch.int64)
        hash_rows(wide, lo, hi, acc)
        want = torch.zeros(n, dtype=torch.int64)
        ref.hash_rows(rows.reshape(n, -1), ref.buffer_constants(2, row_bytes), want)
        assert torch.equal(acc, want), ("strided", n, shape)
print("ok")
"""


def test_hash_rows_triton_matches_reference_interpreted():
    """The writer's digest on a GPU pool (``kernels/triton_write_digest.py``) equals the
    reference, bit for bit, under Triton's interpreter: 32-bit word multiplies and the wrapping
    sums as the CPU kernel and the reference have them."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.gpu
def test_hash_rows_on_a_gpu_pool_matches_reference():
    """On a CUDA device, through the dispatch the store hook uses (``read_verify.hash_rows``)."""
    g = torch.Generator().manual_seed(3)
    for n, shape in ((9, (2, 64)), (200, (576,)), (1, (4,))):
        rows = torch.randint(0, 256, (n, *shape), dtype=torch.uint8, generator=g)
        acc = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)
        want = acc.clone()
        got = acc.cuda()
        compiled.hash_rows(rows.cuda(), 5, got)
        ref.hash_rows(rows, ref.buffer_constants(5, rows[0].numel()), want)
        assert torch.equal(got.cpu(), want), (n, shape)


def test_hash_rows_is_the_pool_digest_of_the_same_bytes():
    """What the writer hashes is what the pool's digest of those bytes would be."""
    g = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, 256, (32, 2, 12), dtype=torch.uint8, generator=g) for _ in range(3)]
    slots, pos = torch.tensor([3, 9, 17]), torch.tensor([0, 1, 2])
    acc = torch.zeros(3, dtype=torch.int64)
    for i, b in enumerate(pool):
        compiled.hash_rows(b[slots], i, acc)
    assert torch.equal(fmix64(acc ^ poskey(pos)), token_digests_ref(pool, slots, pos))


@pytest.fixture
def stores(sgl, monkeypatch):  # noqa: F811
    """SGLang's own stores wrapped as the plugin wraps them: the WRITE_TARGETS row innermost, then
    the FP8 write-scale rows, and the torch_native read rows. ``stores.lost`` set True makes the
    store beneath the digest a no-op (a store that never lands)."""
    from sglang.srt.runtime_context import get_parallel

    lost = SimpleNamespace(on=False)
    rows = WRITE_TARGETS + QUANT_TARGETS + MLA_TARGETS + READ_TARGETS
    applied: dict[str, object] = {}
    for target, hook_type, hook_path, _why in rows:
        module, fn = hook_path.split(".", 1)
        if module not in MODULES or "configure" in target or "load_kv_cache_scales" in target:
            continue
        owner_path, attr = target.rsplit(".", 1)
        owner = sgl.pkgutil.resolve_name(owner_path)
        if target not in applied:
            sglangs = inspect.unwrap(getattr(owner, attr))
            if attr.startswith("set_"):
                sglangs = _losable(sglangs, lost)
            applied[target] = sglangs
        wrapped = sgl._wrap_fn(applied[target], getattr(MODULES[module], fn),
                               sgl.HookType[hook_type])  # fmt: skip
        applied[target] = wrapped
        monkeypatch.setattr(owner, attr, wrapped)
    with get_parallel().override(dcp_enabled=False):
        yield lost


def _losable(store, lost):
    def maybe_store(*args, **kwargs):
        if not lost.on:
            return store(*args, **kwargs)

    return maybe_store


def _guard(pool, monkeypatch) -> Guard:
    _, buffers = guarded_kv_buffers(pool)
    guard = Guard(
        GuardConfig(mode="verified"), num_slots=buffers[0].shape[0], page_size=16, num_rows=4,
        kv_buffers=buffers, device="cpu",
    )  # fmt: skip
    guard.enable_write_path()
    monkeypatch.setattr(state, "guard", guard)
    return guard


def _batch(slots: torch.Tensor, n_prefix: int, n_new: int) -> SimpleNamespace:
    fb = SimpleNamespace(
        out_cache_loc=slots[n_prefix : n_prefix + n_new],
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([n_prefix + n_new]),
        encoder_lens=None,
    )
    if n_prefix == 0:
        fb.extend_prefix_lens, fb.extend_seq_lens = torch.tensor([0]), torch.tensor([n_new])
    return fb


def _stored(guard, forward, fb) -> torch.Tensor:
    """The writer's digests of one forward's stores (positions from 0)."""
    kv_write.begin(guard, fb)
    forward(fb)
    sums = kv_write.take_sums()
    assert sorted(sums.buffers) == list(range(len(guard.checker.kv_buffers)))
    n0 = int(fb.seq_lens[0]) - fb.out_cache_loc.numel()
    return fmix64(sums.acc ^ poskey(torch.arange(n0, n0 + sums.acc.numel())))


def _landed(guard, slots: torch.Tensor, n0: int) -> torch.Tensor:
    pos = torch.arange(n0, n0 + slots.numel())
    return token_digests_ref(guard.checker.kv_buffers, slots.to(torch.int64), pos)


@pytest.mark.parametrize(
    "fp8, ks, vs", [(True, None, None), (True, 0.25, 0.125), (False, None, None)]
)
def test_mha_writer_digests_are_the_landed_bytes_and_a_lost_store_is_not(
    sgl,  # noqa: F811
    stores,
    monkeypatch,
    fp8,
    ks,
    vs,
):
    n = 21
    pool, backend, layer, slots = _setup(sgl, n, k_scale=ks, v_scale=vs)
    if not fp8:
        pool = sgl.MHATokenToKVPool(
            size=64, page_size=16, dtype=torch.bfloat16, head_num=KV_HEADS, head_dim=DIM,
            layer_num=1, device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        backend.token_to_kv_pool = pool
    guard = _guard(pool, monkeypatch)
    q, k, v = _qkv(n + 2, magnitude=3.0, seed=2)

    def run(lo: int, hi: int):
        def forward(fb):
            call = backend.forward_extend if lo == 0 else backend.forward_decode
            call(q[lo:hi], k[lo:hi].clone(), v[lo:hi].clone(), layer, fb)

        return forward

    m = n - 1  # prefill m, decode one (landed), then one whose store never lands
    hashing = guard.metrics.forward_hash_seconds._value.get()
    fb = _batch(slots, 0, m)
    assert torch.equal(_stored(guard, run(0, m), fb), _landed(guard, slots[:m], 0))
    fb = _batch(slots, m, 1)
    assert torch.equal(_stored(guard, run(m, n), fb), _landed(guard, slots[m:n], m))
    guard.flush_metrics()  # the digests' time is the guard's, and reported apart
    assert guard.metrics.forward_hash_seconds._value.get() > hashing
    stores.on = True  # the next store never lands: its slot keeps what it held
    fb = _batch(slots, n, 1)
    meant = _stored(guard, run(n, n + 1), fb)
    assert not torch.equal(meant, _landed(guard, slots[n : n + 1], n))


@pytest.mark.parametrize("fp8", [True, False])
def test_mla_writer_digests_are_the_landed_bytes_and_a_lost_store_is_not(
    sgl,  # noqa: F811
    stores,
    monkeypatch,
    fp8,
):
    n = 19
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    pool, backend, layer, slots = _mla_setup(sgl, n, dtype=dtype, register=fp8)
    guard = _guard(pool, monkeypatch)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(n + 2, 4 * (LORA + ROPE), generator=g).to(torch.bfloat16)
    latent = torch.randn(n + 2, 1, LORA + ROPE, generator=g).to(torch.bfloat16)

    def run(lo: int, hi: int):
        def forward(fb):
            call = backend.forward_extend if lo == 0 else backend.forward_decode
            call(q[lo:hi], latent[lo:hi], latent[lo:hi, :, :LORA], layer, fb)

        return forward

    fb = _batch(slots, 0, n)
    assert torch.equal(_stored(guard, run(0, n), fb), _landed(guard, slots[:n], 0))
    stores.on = True
    fb = _batch(slots, n, 1)
    meant = _stored(guard, run(n, n + 1), fb)
    assert not torch.equal(meant, _landed(guard, slots[n : n + 1], n))


def test_a_store_no_hook_digested_fails_the_seal(sgl, stores, monkeypatch):  # noqa: F811
    """A forward whose store bypassed the digest (or stored other tokens than it writes) leaves
    the guard nothing to seal: ``take_sums`` or the seal refuses, never a pool hash instead."""
    n = 9
    pool, _backend, layer, slots = _setup(sgl, n)
    guard = _guard(pool, monkeypatch)
    fb = _batch(slots, 0, n)
    kv_write.begin(guard, fb)
    sums = kv_write.take_sums()  # nothing stored
    verdict = SimpleNamespace(inputs=SimpleNamespace(write_slots=slots[:n]))
    with pytest.raises(RuntimeError, match="each exactly once"):
        guard.checker.writer_sums(verdict, sums)
    kv_write.begin(guard, fb)
    _q, k, v = _qkv(n)
    pool.set_kv_buffer(layer, slots[:3], k[:3], v[:3])  # three tokens in a forward writing nine
    with pytest.raises(kv_write.UndigestedStore, match="3 rows at 3 slots"):
        kv_write.take_sums()


def test_fp8_scales_changed_after_the_write_are_refused(sgl, stores, monkeypatch):  # noqa: F811
    """Attention dequantizes a layer's FP8 KV with the layer's scales: a scale that changes after
    the KV was written would read every byte of the layer wrong while their digests hold. The
    scales are pinned at first use; a later store or read with others is refused (the step fails
    closed)."""
    n = 9
    pool, backend, layer, slots = _setup(sgl, n, k_scale=0.25, v_scale=0.125)
    guard = _guard(pool, monkeypatch)
    guard.enable_read_path()
    q, k, v = _qkv(n + 1, magnitude=3.0, seed=4)
    fb = _batch(slots, 0, n - 1)
    kv_write.begin(guard, fb)
    kv_read.clear_record()
    backend.forward_extend(q[: n - 1], k[: n - 1].clone(), v[: n - 1].clone(), layer, fb)
    kv_write.take_sums()
    assert not kv_read.take_record().failed
    layer.k_scale_float = 0.5  # the layer's scale changes after its KV was written
    fb = _batch(slots, n - 1, 1)
    kv_write.begin(guard, fb)
    kv_read.clear_record()
    backend.forward_decode(q[n - 1 : n], k[n - 1 : n].clone(), v[n - 1 : n].clone(), layer, fb)
    with pytest.raises(kv_write.UndigestedStore, match="FP8 KV scales"):
        kv_write.take_sums()
    assert kv_read.take_record().failed


def test_hash_rows_triton_compiles_for_sm90():
    """Without a GPU: the writer's-digest kernel compiles for sm_90 as a GPU would compile it
    (the interpreter test checks what it computes)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvguard.kernels import triton_write_digest as kernel

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton has no NVIDIA backend")
    sig = {"src": "*i32", "row_stride": "i32", "words": "i32", "lo": "*i32", "hi": "*i32",
           "acc": "*i64", "n": "i32", "BR": "constexpr", "BWORD": "constexpr"}  # fmt: skip
    consts = {"BR": kernel._ROWS, "BWORD": kernel._WORDS}
    compiled = triton.compile(
        ASTSource(kernel._hash_rows, sig, consts), target=GPUTarget("cuda", 90, 32)
    )
    assert compiled.asm.get("cubin")

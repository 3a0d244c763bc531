"""DeepSeek Sparse Attention models (GLM-5 ``GlmMoeDsaForCausalLM``, DeepSeek V3.2) on CPU with
SGLang's ``torch_native`` attention backend. Hook functions named in ``targets.py`` (DSA_TARGETS).

SGLang 0.5.23 has no CPU path for any DSA part; this file adds one, following the math of the
fused GLM CUDA path (SGLang's ``indexer_k.cuh``), and changes nothing for other models or devices:

* Arguments. ``handle_model_specific_adjustments`` asks ``torch.cuda.get_device_capability()``
  for DSA models and runs two passes that ask it again; each raises without a driver.
  ``around_model_specific_adjustments`` answers the one direct call and swaps the two passes for
  CPU resolutions: the KV cache dtype stays the model's (``auto``), or BF16, or FP8 e4m3; the
  DSA kernel backends stay unset (so an FP8 pool gets SGLang's scaled row layout).
* Indexer. ``Indexer.forward_native`` raises; ``around_indexer_forward_native`` computes the
  top-k in torch: index keys ``k = bf16(rope(LayerNorm(wk x)))`` stored FP8 with a per-key scale
  ``max(amax, 1e-4) / 448`` in SGLang's page-major index-key buffer (``[pages, 64 * 132]``
  bytes: 64 x 128 FP8 keys, then 64 fp32 scales from byte 8192) at ``out_cache_loc``; queries
  FP8 with a per-(token, head) scale; ``logit[t, j] = sum_h w[t, h] relu(q8 . k8[j]) s_k[j]``
  over causal positions, keys read back through the request's page table. A token with at most
  ``index_topk`` causal positions selects all of them; others take the top-k. Result: logical
  positions ``[T, index_topk]``, -1 padded.
* Attention. ``forward_mla`` hands ``topk_indices`` to ``torch_native``, whose forward methods
  take no such argument. ``around_attention`` (outermost of the torch_native hooks) writes the
  latent row and attends over the selected positions only; other pools pass through.
* FP8 latent rows. An FP8 DSA pool packs ``[R fp8 | R/128 fp32 scales | rope bf16]`` per row
  (SGLang's Triton ``quantize_k_cache_separate``): ``pack_fp8_rows`` / ``unpack_fp8_rows``.
* Retraction offload (``get_cpu_copy`` / ``load_cpu_copy``) calls ``torch.cuda.synchronize()``:
  a no-op for a CPU pool.
"""

from __future__ import annotations

import contextlib

import torch

from kvguard.patches import kv_read, kv_write
from kvguard.patches.adapter import index_key_views

INDEX_PAGE = 64  # tokens per index-key page (SGLang's DSA pool asserts page size 64)
INDEX_DIM = 128  # index_head_dim (asserted by the pool)
KEY_BYTES = INDEX_PAGE * INDEX_DIM  # scales start here in each page row
FP8_MAX = 448.0
INDEX_EPS = 1e-4  # the fused path's floor on an index key's or query's amax
QUANT_BLOCK = 128  # FP8 latent rows: one fp32 scale per 128 values
_CPU_CAPABILITY = (0, 0)  # "no CUDA": SGLang's SM >= 10 branches stay off


class DSAConfigError(ValueError):
    """A DSA setting kvguard cannot serve on CPU."""


# -- arg_groups.model_hook.handle_model_specific_adjustments (AROUND) ----------------------------
def around_model_specific_adjustments(original, server_args, *args, **kwargs):
    # the device argument: this process's platform may not be resolved to the CPU yet
    if server_args.device != "cpu" or not _is_dsa_model(server_args):
        return original(server_args, *args, **kwargs)
    from sglang.srt.arg_groups import model_hook

    asked: list[object] = []

    def capability(device=None):
        asked.append(device)
        return _CPU_CAPABILITY

    real = (
        model_hook._dsa_kv_cache_dtype_default,
        model_hook._dsa_split_backend_resolution,
        torch.cuda.get_device_capability,
    )
    model_hook._dsa_kv_cache_dtype_default = cpu_dsa_kv_cache_dtype
    model_hook._dsa_split_backend_resolution = cpu_dsa_backends
    torch.cuda.get_device_capability = capability
    try:
        result = original(server_args, *args, **kwargs)
    finally:
        (
            model_hook._dsa_kv_cache_dtype_default,
            model_hook._dsa_split_backend_resolution,
            torch.cuda.get_device_capability,
        ) = real
    if len(asked) != 1:
        raise DSAConfigError(
            "SGLang's DSA argument handling changed shape (device capability asked "
            f"{len(asked)} times, expected once); update patches/dsa_cpu.py"
        )
    if server_args.kv_cache_dtype == "fp8_e4m3":  # SGLang would assert deep in the pool sizing
        from sglang.srt.arg_groups.overrides import model_config_of

        why = fp8_rows_unsupported(model_config_of(server_args).hf_config)
        if why:
            raise DSAConfigError(f"--kv-cache-dtype fp8_e4m3 cannot serve this model: {why}")
    return result


def fp8_rows_unsupported(hf_config) -> str | None:
    """Why SGLang's FP8 DSA latent row cannot hold this model's latent (None: it can): one
    fp32 scale per 128 latent values, so ``kv_lora_rank`` must be a multiple of 128. ``hf_config``:
    the HF config object or its ``config.json`` dict."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda k: getattr(hf_config, k, None)
    rank = int(get("kv_lora_rank") or 0)
    if rank % QUANT_BLOCK:
        return (
            f"kv_lora_rank {rank} is not a multiple of {QUANT_BLOCK} (SGLang's FP8 DSA latent row "
            f"holds one fp32 scale per {QUANT_BLOCK} values)"
        )
    return None


def _is_dsa_model(server_args) -> bool:
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.configs.model_config import is_deepseek_dsa

    try:
        hf_config = model_config_of(server_args).hf_config
    except Exception:  # no config to read: SGLang's own handling says why, not this hook
        return False
    return bool(is_deepseek_dsa(hf_config))


_CPU_KV_DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": None, "fp8_e4m3": None}


def cpu_dsa_kv_cache_dtype(view) -> dict:
    """CPU stand-in for ``_dsa_kv_cache_dtype_default``: ``auto`` stays the model dtype (SGLang's
    GPU default is FP8 on SM >= 10, else BF16); BF16 and FP8 e4m3 as asked."""
    dtype = view.kv_cache_dtype
    if dtype not in _CPU_KV_DTYPES:
        raise DSAConfigError(
            f"DSA on CPU serves --kv-cache-dtype auto, bfloat16 or fp8_e4m3, not {dtype}"
        )
    rename = _CPU_KV_DTYPES[dtype]
    return {"kv_cache_dtype": rename} if rename else {}


def cpu_dsa_backends(view) -> dict:
    """CPU stand-in for ``_dsa_split_backend_resolution``: the DSA kernels are GPU kernels;
    attention runs in torch_native (this file), so none is chosen."""
    for field in ("dsa_prefill_backend", "dsa_decode_backend"):
        if getattr(view, field) is not None:
            option = "--" + field.replace("_", "-")
            raise DSAConfigError(
                f"{option} names a GPU kernel; DSA on CPU runs in torch_native attention"
            )
    return {}


# -- layers.attention.dsa.dsa_indexer.Indexer.forward_native (AROUND) ----------------------------
def around_indexer_forward_native(
    original, indexer, x, q_lora, positions, forward_batch, layer_id, *args, **kwargs
):
    if x.device.type != "cpu":
        return original(indexer, x, q_lora, positions, forward_batch, layer_id, *args, **kwargs)
    from sglang.srt.model_executor.forward_context import (
        get_req_to_token_pool,
        get_token_to_kv_pool,
    )
    from sglang.srt.state_capturer.indexer_topk import maybe_capture_indexer_topk

    pool = get_token_to_kv_pool()
    if pool.index_kpool != 1 or pool.index_page_size != INDEX_PAGE:
        raise DSAConfigError(  # pooled/compressed index pages: another layout
            f"DSA on CPU stores one index key per token in 64-token pages; this pool groups "
            f"{pool.index_kpool} tokens per key in {pool.index_page_size}-key pages"
        )
    key, query, weights = indexer_qkw(indexer, x, q_lora, positions)
    buf = pool.get_index_k_with_scale_buffer(layer_id=layer_id)
    store_index_keys(buf, forward_batch.out_cache_loc, key)
    topk = torch.full((x.shape[0], indexer.index_topk), -1, dtype=torch.int32, device=x.device)
    req_to_token = get_req_to_token_pool().req_to_token
    hashed = _hashed_index_keys(forward_batch, req_to_token, buf, pool.page_size)
    read = 0
    for row, start, n, seq_len in _requests(forward_batch):
        if hashed is None:
            slots = req_to_token[row, :seq_len].to(torch.int64)
            k8, s_k = load_index_keys(buf, slots)
        else:
            k8, s_k = _index_key_values(
                hashed[0][read : read + seq_len], hashed[1][read : read + seq_len]
            )
        read += seq_len
        topk[start : start + n] = select_topk(
            query[start : start + n],
            weights[start : start + n],
            k8,
            s_k,
            positions[start : start + n],
            indexer.index_topk,
        )
    return maybe_capture_indexer_topk(layer_id, topk)


def indexer_qkw(indexer, x, q_lora, positions):
    """(index keys [T, 128] bf16, queries [T, H, 128], head weights [T, H] fp32) of the fused
    path: rope on the first ``rope_head_dim`` values, no Hadamard rotation."""
    rope = indexer.rope_head_dim
    query, _ = indexer.wq_b(q_lora)
    query = query.view(-1, indexer.n_heads, indexer.head_dim)
    key, _ = indexer.wk(x)
    key = indexer.k_norm(key)
    # keys go in as one head ([T, 1, rope]): SGLang's YaRN rope (DeepseekScalingRotaryEmbedding)
    # broadcasts its [T, 1, rope] cos/sin against a [T, rope] key into [T, T, rope] off CUDA
    q_rope, k_rope = indexer.rotary_emb(
        positions, query[..., :rope].clone(), key[..., :rope].clone().unsqueeze(1)
    )
    query = torch.cat([q_rope.view(query.shape[0], query.shape[1], rope), query[..., rope:]], -1)
    key = torch.cat([k_rope.view(key.shape[0], rope), key[..., rope:]], -1).to(torch.bfloat16)
    wp = (
        indexer.weights_proj.weight
    )  # bf16 parameters: x is cast to them (F.linear needs one dtype)
    weights = torch.nn.functional.linear(x.to(wp.dtype), wp).float()
    weights = weights * (indexer.n_heads**-0.5 * indexer.softmax_scale)
    return key, query, weights


def _hashed_index_keys(forward_batch, req_to_token, buf, page_size: int):
    """(keys [N, 128] uint8, scales [N, 4] uint8) of every slot the batch reads, hashed into the
    forward's read record, when the guard verifies reads (None: it does not, or the read could
    not be hashed: the step then fails closed and the keys are read plain)."""
    guard = kv_read.verifying_guard()
    if guard is None or not len(forward_batch.req_pool_indices):
        return None
    try:
        keys, scales = index_key_views(buf, page_size, INDEX_DIM, 4)
        hashed = (
            kv_read.hashed_rows(guard, forward_batch, req_to_token, keys),
            kv_read.hashed_rows(guard, forward_batch, req_to_token, scales),
        )
        kv_read.check_segments(forward_batch)  # sliced below by seq_lens_cpu: the same rows
        return hashed
    except Exception as exc:
        kv_read.fail_read(forward_batch, exc)
        return None


def _index_key_values(
    keys: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 keys as fp32 [N, 128], fp32 scales [N]) from their stored bytes."""
    k8 = keys.contiguous().view(torch.float8_e4m3fn).float()
    return k8, scales.contiguous().view(torch.float32).view(-1)


def quantize_index_keys(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 e4m3 keys [N, 128], fp32 scales [N]): scale = max(amax, 1e-4) / 448 per key."""
    k = key.to(torch.bfloat16).float()
    scale = k.abs().amax(-1).clamp_min(INDEX_EPS) / FP8_MAX
    k8 = (k * (1.0 / scale)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return k8, scale


def _index_views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The page-major index-key buffer as (keys [P, 64, 128] uint8, scales [P, 64, 4] uint8)."""
    pages = buf.shape[0]
    keys = buf[:, :KEY_BYTES].view(pages, INDEX_PAGE, INDEX_DIM)
    scales = buf[:, KEY_BYTES:].view(pages, INDEX_PAGE, 4)
    return keys, scales


def store_index_keys(buf: torch.Tensor, loc: torch.Tensor, key: torch.Tensor) -> None:
    """Write FP8 index keys and their scales for the tokens at slots ``loc`` (in place)."""
    k8, scale = quantize_index_keys(key)
    loc = loc.to(torch.int64)
    page, off = loc // INDEX_PAGE, loc % INDEX_PAGE
    keys, scales = _index_views(buf)
    k_bytes, s_bytes = k8.view(torch.uint8), scale.contiguous().view(torch.uint8).view(-1, 4)
    if kv_write.recording():  # the writer's digests of both (the guard's page-major buffers)
        key_buf, scale_buf = index_key_views(buf, INDEX_PAGE, INDEX_DIM, 4)
        kv_write.digest_store(key_buf, loc, k_bytes)
        kv_write.digest_store(scale_buf, loc, s_bytes)
    keys[page, off] = k_bytes
    scales[page, off] = s_bytes


def load_index_keys(buf: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 keys as fp32 [N, 128], fp32 scales [N]) stored at ``slots``."""
    keys, scales = _index_views(buf)
    page, off = slots // INDEX_PAGE, slots % INDEX_PAGE
    return _index_key_values(keys[page, off], scales[page, off])


# Temporaries per query tile: a long prefill chunk over a long context would otherwise allocate
# [n, heads, L] indexer scores (or [n, index_topk, D] gathered latents) at once.
TILE_ELEMENTS = 1 << 24


def _tiles(n: int, per_query: int):
    step = max(1, TILE_ELEMENTS // max(1, per_query))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def select_topk(query, weights, k8, s_k, positions, index_topk: int) -> torch.Tensor:
    """Top-k logical positions [n, index_topk] (-1 padded) for one request's ``n`` query tokens
    over its keys ``k8``/``s_k`` (positions 0..L-1), causal; in query tiles."""
    n, heads = query.shape[0], query.shape[1]
    tiles = list(_tiles(n, heads * max(1, k8.shape[0])))
    if len(tiles) == 1:
        return _select_topk(query, weights, k8, s_k, positions, index_topk)
    return torch.cat(
        [_select_topk(query[t], weights[t], k8, s_k, positions[t], index_topk) for t in tiles]
    )


def _select_topk(query, weights, k8, s_k, positions, index_topk: int) -> torch.Tensor:
    q = query.float()
    s_q = q.abs().amax(-1).clamp_min(INDEX_EPS) / FP8_MAX  # [n, H]
    q8 = (q * (1.0 / s_q)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    scores = torch.relu(torch.einsum("nhd,ld->nhl", q8, k8))
    logits = torch.einsum("nh,nhl->nl", weights * s_q, scores) * s_k[None, :]
    span = torch.arange(k8.shape[0], device=q.device)
    pos = positions.to(torch.int64)[:, None]
    logits = logits.masked_fill(span[None, :] > pos, float("-inf"))
    out = torch.full((q.shape[0], index_topk), -1, dtype=torch.int32, device=q.device)
    k = min(index_topk, k8.shape[0])
    picked = logits.topk(k, dim=-1).indices.to(torch.int32)
    few = (pos[:, 0] + 1) <= index_topk  # every causal position, in order
    if few.any():
        causal = span[:k].to(torch.int32)[None, :].expand(int(few.sum()), k)
        picked[few] = torch.where(causal <= pos[few], causal, -1)
    out[:, :k] = picked
    return out


def _requests(forward_batch):
    """(page-table row, first token in the batch, tokens, sequence length) per request."""
    rows = forward_batch.req_pool_indices.tolist()
    if not rows:  # an idle batch
        return
    seq_lens = forward_batch.seq_lens_cpu.tolist()
    if forward_batch.forward_mode.is_decode():
        counts = [1] * len(rows)
    else:
        counts = list(forward_batch.extend_seq_lens_cpu)
    start = 0
    for row, n, seq_len in zip(rows, counts, seq_lens):
        yield row, start, int(n), int(seq_len)
        start += int(n)


# -- TorchNativeAttnBackend.forward_extend / forward_decode (AROUND) ------------------------------
def around_attention(
    original, backend, q, k, v, layer, forward_batch, *args, topk_indices=None, **kwargs
):
    """Sparse MLA over the indexer's positions for a CPU DSA pool; everything else unchanged."""
    pool = backend.token_to_kv_pool
    if not _is_cpu_dsa_pool(pool):
        if topk_indices is not None:
            kwargs["topk_indices"] = topk_indices  # SGLang's own error, unchanged
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    save_kv_cache = args[0] if args else kwargs.get("save_kv_cache", True)
    if save_kv_cache and k is not None:
        write_latent(pool, layer, forward_batch.out_cache_loc, k)
    heads, dim = layer.tp_q_head_num, layer.qk_head_dim
    q = q.reshape(-1, heads, dim)
    out = q.new_empty((q.shape[0], heads, layer.v_head_dim))
    req_to_token = backend.req_to_token_pool.req_to_token
    positions = forward_batch.positions
    hashed = _hashed_latents(pool, layer, forward_batch, req_to_token)
    read = 0
    for row, start, n, seq_len in _requests(forward_batch):
        if hashed is None:
            slots = req_to_token[row, :seq_len].to(torch.int64)
            rows = read_latent(pool, layer, slots)  # [L, R + rope] fp32
        else:
            rows = hashed[read : read + seq_len]
        read += seq_len
        if topk_indices is None:  # no indexer ran for this layer: dense causal
            span = torch.arange(seq_len, device=q.device)
            sel = span[None, :].expand(n, seq_len)
            sel = torch.where(sel <= positions[start : start + n, None], sel, -1)
        else:
            sel = topk_indices[start : start + n].to(torch.int64)
        out[start : start + n] = sparse_mla(
            q[start : start + n], rows, sel, layer.scaling, layer.v_head_dim
        ).to(out.dtype)
    return out.view(q.shape[0], heads * layer.v_head_dim)


def sparse_mla(q, rows, sel, scaling: float, v_dim: int) -> torch.Tensor:
    """softmax(scaling * q . rows[sel]) . rows[sel, :v_dim] per token over its selected rows;
    ``sel`` [n, K] holds row indices, -1 for none; in query tiles."""
    tiles = list(_tiles(q.shape[0], sel.shape[1] * (rows.shape[1] + q.shape[1])))
    if len(tiles) == 1:
        return _sparse_mla(q, rows, sel, scaling, v_dim)
    return torch.cat([_sparse_mla(q[t], rows, sel[t], scaling, v_dim) for t in tiles])


def _sparse_mla(q, rows, sel, scaling: float, v_dim: int) -> torch.Tensor:
    valid = sel >= 0
    picked = rows[sel.clamp_min(0)]  # [n, K, D]
    logits = torch.einsum("nhd,nkd->nhk", q.float(), picked) * scaling
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.einsum("nhk,nkr->nhr", probs, picked[..., :v_dim])


def _is_cpu_dsa_pool(pool) -> bool:
    return hasattr(pool, "index_key_cache") and str(getattr(pool, "device", "")) == "cpu"


def write_latent(pool, layer, loc: torch.Tensor, k: torch.Tensor) -> None:
    """Store the latent rows ``k`` [T, 1, R + rope]: SGLang's MLA write, or the packed FP8 row."""
    if not pool.dsa_kv_cache_store_fp8:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, None)
        return
    r = pool.kv_lora_rank
    k = k.reshape(k.shape[0], -1)
    buf = pool.kv_buffer[layer.layer_id - pool.start_layer]
    packed = pack_fp8_rows(k[:, :r], k[:, r:])
    kv_write.digest_store(buf, loc, packed)  # the writer's digest (when the guard takes them)
    buf[loc.to(torch.int64), 0] = packed


def read_latent(pool, layer, slots: torch.Tensor) -> torch.Tensor:
    """Latent rows at ``slots`` as fp32 [N, R + rope]."""
    buf = pool.kv_buffer[layer.layer_id - pool.start_layer]
    return _latent_values(pool, buf[slots, 0])


def _hashed_latents(pool, layer, forward_batch, req_to_token) -> torch.Tensor | None:
    """The latent rows of every slot the batch reads, fp32 [N, R + rope], hashed into the
    forward's read record when the guard verifies reads (None: as ``_hashed_index_keys``)."""
    guard = kv_read.verifying_guard()
    if guard is None or not len(forward_batch.req_pool_indices):
        return None
    try:
        buf = pool.kv_buffer[layer.layer_id - pool.start_layer]
        raw = kv_read.hashed_rows(guard, forward_batch, req_to_token, buf)
        kv_read.check_segments(forward_batch)  # sliced below by seq_lens_cpu: the same rows
        return _latent_values(pool, raw[:, 0])
    except Exception as exc:
        kv_read.fail_read(forward_batch, exc)
        return None


def _latent_values(pool, stored: torch.Tensor) -> torch.Tensor:
    """Stored latent rows [N, row] (packed FP8 bytes, or the pool's dtype) as fp32."""
    if pool.dsa_kv_cache_store_fp8:
        return unpack_fp8_rows(stored, pool.kv_lora_rank)
    return stored.view(pool.dtype).float()


def pack_fp8_rows(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """``[R fp8 | R/128 fp32 scales | rope bf16]`` bytes per row; scale = amax / 448 per block
    of 128 (no floor, as SGLang's kernel: an all-zero block stores NaN there too)."""
    n, r = nope.shape
    blocks = nope.float().view(n, r // QUANT_BLOCK, QUANT_BLOCK)
    scale = blocks.abs().amax(-1) / FP8_MAX
    q8 = (blocks * (1.0 / scale)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat(
        [
            q8.view(n, r).view(torch.uint8),
            scale.contiguous().view(torch.uint8),
            rope.to(torch.bfloat16).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


def unpack_fp8_rows(packed: torch.Tensor, r: int) -> torch.Tensor:
    """Inverse of :func:`pack_fp8_rows` (dequantized): fp32 [N, R + rope]."""
    n, blocks = packed.shape[0], r // QUANT_BLOCK
    values = packed[:, :r].contiguous().view(torch.float8_e4m3fn).float()
    scale = packed[:, r : r + 4 * blocks].contiguous().view(torch.float32)
    nope = (values.view(n, blocks, QUANT_BLOCK) * scale[..., None]).view(n, r)
    rope = packed[:, r + 4 * blocks :].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=-1)


# -- DSATokenToKVPool.get_cpu_copy / load_cpu_copy (AROUND) ---------------------------------------
def around_offload(original, pool, *args, **kwargs):
    """Retraction offload of a CPU pool: its ``torch.cuda.synchronize()`` calls are no-ops."""
    if str(getattr(pool, "device", "")) != "cpu":
        return original(pool, *args, **kwargs)
    with _cuda_synchronize_is_a_noop():
        return original(pool, *args, **kwargs)


@contextlib.contextmanager
def _cuda_synchronize_is_a_noop():
    real = torch.cuda.synchronize
    torch.cuda.synchronize = lambda device=None: None
    try:
        yield
    finally:
        torch.cuda.synchronize = real

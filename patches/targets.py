"""Every SGLang 0.5.23 target kvguard touches, in one table. A version bump is a change here
(and in the hook functions the table names), nowhere else.

Each row: (dotted target, hook type, hook function in ``kvguard.patches``, why).
"""

from __future__ import annotations

GUARD_TARGETS = [
    (
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        "BEFORE",
        "engine_options.refuse_unguarded_options",
        "refuse an option kvguard cannot check (engine_options.OPTIONS) before the scheduler "
        "builds anything: python -m sglang.launch_server (kvguard-serve refuses it earlier)",
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        "AFTER",
        "lifecycle.attach",
        "build one Guard per scheduler once the KV pool, page table and allocator exist",
    ),
    (
        "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation",
        "AROUND",
        "forward_hooks.around_worker_forward",
        "see the ScheduleBatch (host request ids and prompt tokens) and hand the verdict on in the result",
    ),
    (
        "sglang.srt.model_executor.model_runner.ModelRunner.forward",
        "AROUND",
        "forward_hooks.around_model_forward",
        "check reads and writes just before the forward, seal written tokens just after it",
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
        "AROUND",
        "forward_hooks.around_process_batch_result",
        "read the verdict after the forward's own sync; abort bad requests before their token is emitted",
    ),
    (
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids",
        "AROUND",
        "pool_hooks.around_release_pages",
        "every page re-entering the free list (page_size > 1)",
    ),
    (
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free",
        "AROUND",
        "pool_hooks.around_token_free",
        "every slot re-entering the free list (page_size 1), attributed to the request being released",
    ),
    (
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes",
        "AROUND",
        "pool_budget.around_calculate_pool_sizes",
        "count the guard's per-page state in the KV budget SGLang sizes the pool from",
    ),
    (
        "sglang.srt.mem_cache.common.release_kv_cache",
        "AROUND",
        "pool_hooks.around_release_kv_cache",
        "frees while a request is released are its own: a stale holder cannot free a page someone else holds",
    ),
    (
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free",
        "AROUND",
        "pool_hooks.around_paged_free",
        "attribution of a released request's frees at the call (free groups release them later)",
    ),
    (
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free_page_ids",
        "AROUND",
        "pool_hooks.around_paged_free_page_ids",
        "the same, for frees by page id",
    ),
    (
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc",
        "AFTER",
        "pool_hooks.on_slots_allocated",
        "pages handed out (page-aligned allocation)",
    ),
    (
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend",
        "AFTER",
        "pool_hooks.on_slots_allocated",
        "pages handed out for prefill",
    ),
    (
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode",
        "AFTER",
        "pool_hooks.on_slots_allocated",
        "pages handed out for decode",
    ),
    (
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc",
        "AFTER",
        "pool_hooks.on_slots_allocated",
        "slots handed out (page_size 1)",
    ),
    (
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear",
        "AFTER",
        "lifecycle.on_pool_cleared",
        "pool flushed: every page free again",
    ),
    (
        "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.clear",
        "AFTER",
        "lifecycle.on_pool_cleared",
        "pool flushed: every slot free again",
    ),
    (
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.checkpoint_into_tree",
        "AROUND",
        "cache_hooks.around_checkpoint_into_tree",
        "a request's KV enters the prefix cache: pages become shared",
    ),
    (
        "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.match_prefix",
        "AROUND",
        "cache_hooks.around_match_prefix",
        "refuse prefix-cache hits through quarantined pages",
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        "AROUND",
        "recompute.around_get_next_batch_to_run",
        "requests sent back to be recomputed leave the running batch, and are re-queued once no launched batch holds them",
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.on_idle",
        "AFTER",
        "lifecycle.flush_when_idle",
        "after a quarantine, flush the prefix cache at the next idle moment",
    ),
    (
        "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc_rows",
        "AFTER",
        "pool_hooks.on_rows_allocated",
        "a page-table row handed to a new request: reset its records",
    ),
    (
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._report_leak",
        "AROUND",
        "invariant_hooks.around_memory_check",
        "after contained violations, the engine bug's footprint is reported and, when idle, the free list rebuilt",
    ),
    (
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_kv_page_invariants",
        "AROUND",
        "invariant_hooks.around_memory_check",
        "same, for SGLang's use-after-free / double-free scan",
    ),
    (
        "sglang.srt.managers.scheduler_components.pool_stats_observer.SchedulerPoolStatsObserver._get_token_info",
        "AROUND",
        "invariant_hooks.around_token_info",
        "after contained violations, a page both free and cached must not make usage < 0 (an assert)",
    ),
    (
        "sglang.srt.managers.scheduler.Scheduler.get_init_info",
        "AFTER",
        "guard_status.add_to_init_info",
        "report the guard's mode and pid in the start-up handshake (kvguard.install, /server_info)",
    ),
]

# The HTTP process (kvguard-serve, python -m sglang.launch_server): the guard's health at the
# server's front door. Registered only in a process that no other SGLang process started.
HTTP_TARGETS = [
    (
        "sglang.srt.entrypoints.http_server.launch_server",
        "BEFORE",
        "engine_options.refuse_before_launch",
        "python -m sglang.launch_server: an option the guard cannot check is refused in one line, "
        "exit status 2, before any scheduler starts (kvguard-serve refuses it before SGLang)",
    ),
    (
        "sglang.srt.entrypoints.http_server.launch_server",
        "BEFORE",
        "health_endpoint.before_launch_server",
        "before the schedulers start: the state directory they publish their guard's health "
        "into, and the middleware that answers /health 503 and refuses new requests once a "
        "guard failed closed",
    ),
]

# The forward's KV stores (kv_write.py): each written token's digest taken from the bytes its layer
# hands the pool (after the cast to the storage dtype), sealed in place of a hash of the pool.
# Registered first (innermost): they see the arguments SGLang's store itself gets (the FP8 write
# scales the QUANT and MLA rows supply). The CPU DSA path's own stores (dsa_cpu.py) call
# kv_write.digest_store directly.
WRITE_TARGETS = [
    (
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer",
        "AROUND",
        "kv_write.around_mha_store",
        "K and V rows digested as SGLang casts and stores them",
    ),
    (
        "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.set_kv_buffer",
        "AROUND",
        "kv_write.around_mla_store",
        "the latent row digested as SGLang casts and stores it (DSA pools inherit it)",
    ),
    (
        "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.set_mla_kv_buffer",
        "AROUND",
        "kv_write.around_mla_split_store",
        "the latent row written as its NoPE and RoPE parts",
    ),
]

# The batch's KV read in torch_native attention (kv_read.py): one compiled gather per layer and
# buffer, dequantized for FP8 pools (any guard mode: how FP8 KV is served on CPU) and hashed when
# the guard verifies reads. With neither, SGLang's own loop runs untouched.
READ_TARGETS = [
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        "AROUND",
        "kv_read.around_attention",
        "name the layer that reads: its FP8 tables, whether its read is hashed",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
        "AROUND",
        "kv_read.around_attention",
        "same, decode",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
        "AROUND",
        "kv_read.around_sdpa",
        "SDPA over one compact gathered (dequantized, hashed) copy of the rows the batch reads",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode",
        "AROUND",
        "kv_read.around_sdpa",
        "same, decode",
    ),
]

# Quantization features (FP8 KV cache, INT4 weights on CPU). Registered whatever the guard mode:
# they are serving features, not integrity checks. Every hook is a no-op where it is not needed.
QUANT_TARGETS = [
    (
        "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator.configure",
        "AROUND",
        "cpu_fp8_kv.around_configure",
        "lift the 'CPU FP8 KV cache requires Intel AMX' gate for the torch_native backend",
    ),
    (
        "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool.set_kv_buffer",
        "BEFORE",
        "cpu_fp8_kv.supply_scales",
        "quantize K/V with the layer's k_scale/v_scale (torch_native passes none)",
    ),
    (
        "sglang.srt.layers.quantization.gptq.schemes.gptq_cpu.GPTQIntelAMXLinearScheme._init_kernel",
        "AROUND",
        "int4_cpu_linear.around_cpu_init_kernel",
        "GPTQ INT4 on a CPU without AMX: torch INT4 GEMM instead of the AMX-only sgl_kernel op",
    ),
    (
        "sglang.srt.layers.quantization.gptq.gptq.CPUGPTQConfig.get_quant_method",
        "AROUND",
        "int4_cpu_linear.around_cpu_get_quant_method",
        "GPTQ 'dynamic' per-module overrides (e.g. a fallback group size) on CPU, as on CUDA",
    ),
    (
        "sglang.srt.layers.quantization.gptq.schemes.gptq_linear.GPTQLinearScheme._init_kernel",
        "AROUND",
        "int4_cpu_linear.around_init_kernel",
        "plain GPTQ on CUDA (no Marlin): Triton W4A16 where SGLang removed its kernel",
    ),
    # compressed-tensors W4A16 (Kimi K2 Thinking's format) on CPU: SGLang's schemes create and load
    # the parameters; the CPU repack and INT4 GEMMs replace Marlin (CUDA). No-ops with CUDA.
    (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.create_weights",
        "AFTER",
        "int4_cpu_moe.fill_zero_codes",
        "rows the checkpoint does not fill (CPU padding) decode to 0, not uninitialized memory",
    ),
    (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.process_weights_after_loading",
        "AROUND",
        "int4_cpu_moe.moe_process_weights",
        "experts repacked for torch's INT4 CPU GEMM instead of Marlin",
    ),
    (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.create_moe_runner",
        "AROUND",
        "int4_cpu_moe.moe_create_runner",
        "no Marlin runner on CPU",
    ),
    (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.apply_weights",
        "AROUND",
        "int4_cpu_moe.moe_apply",
        "SGLang's native CPU MoE loop with INT4 GEMMs",
    ),
    (
        "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors.CompressedTensorsConfig.get_linear_scheme",
        "AROUND",
        "int4_cpu_moe.around_get_linear_scheme",
        "W4A16 linears on CPU: SGLang's scheme without its CUDA capability check",
    ),
    (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16.CompressedTensorsWNA16.create_weights",
        "AFTER",
        "int4_cpu_moe.fill_zero_codes",
        "same, linears",
    ),
    (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16.CompressedTensorsWNA16.process_weights_after_loading",
        "AROUND",
        "int4_cpu_moe.linear_process_weights",
        "linears repacked for torch's INT4 CPU GEMM instead of Marlin",
    ),
    (
        "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16.CompressedTensorsWNA16.apply_weights",
        "AROUND",
        "int4_cpu_moe.linear_apply",
        "torch's INT4 CPU GEMM",
    ),
]

# SGLang's own KV canary (--kv-canary) on CPU: the peer kvguard is compared with. Registered
# whatever the guard mode; each hook calls SGLang's code unchanged off CPU.
CANARY_TARGETS = [
    (
        "sglang.srt.kv_canary.runner.canary_manager.create_device_stream",
        "AROUND",
        "kv_canary_cpu.create_stream",
        "the canary's d2h stream: torch.cpu.Stream takes no device",
    ),
    (
        "sglang.srt.kv_canary.runner.future_tensor.FutureTensors.device_to_host",
        "AROUND",
        "kv_canary_cpu.device_to_host",
        "no pinned host memory without CUDA: a plain clone on CPU",
    ),
    (
        "sglang.srt.utils.phase_checker.SimplePhaseChecker.update",
        "AROUND",
        "kv_canary_cpu.phase_update",
        "the forward-bracket phase check is a Triton kernel: torch on CPU",
    ),
]

# Tensor parallelism on CPU (how kvguard's TP agreement is exercised without GPUs). Registered
# whatever the guard mode; a no-op where CUDA exists.
TP_TARGETS = [
    (
        "sglang.srt.distributed.parallel_state.init_model_parallel_group",
        "AROUND",
        "cpu_tensor_parallel.around_init_group",
        "no PyNccl communicator without CUDA (gloo all-reduce instead)",
    ),
]

# Prefill/decode disaggregation (--disaggregation-mode prefill|decode, mooncake transfer backend)
# on CPU (pd_cpu.py). Registered whatever the guard mode: a serving feature (the guard itself
# refuses PD: engine_options.py). Each hook acts on SGLang's CPU route only; the targets run only
# on a prefill or decode server.
PD_CPU_TARGETS = [
    (
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.__init__",
        "BEFORE",
        "pd_cpu.before_transfer_engine",
        "the wheel links libcudart/libcuda/libibverbs/libmlx5: kvguard's no-device builds of the "
        "missing ones (patches/csrc/nodevice_*.c), and mooncake's TCP transport",
    ),
    (
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk",
        "AROUND",
        "pd_cpu.around_send_kv_chunk",
        "mooncake's sender stages page indices in pinned memory behind a CUDA event: plain host "
        "indices on CPU (SGLang's other branch)",
    ),
    (
        "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk",
        "AROUND",
        "pd_cpu.around_early_send",
        "the early send of a cached prefix records a CUDA event on the forward stream (overlap): "
        "on CPU the prior forward has completed, nothing to wait for",
    ),
    (
        "sglang.srt.disaggregation.checksum.KvChecksumComputer.compute",
        "AROUND",
        "pd_cpu.around_kv_checksum",
        "--disaggregation-enable-kv-checksum's Adler-32 is a JIT CUDA kernel: the same Adler-32 "
        "over the same bytes on the host when the page indices are host tensors",
    ),
]

# MLA models (DeepSeek-V2/V3 architecture: Kimi K2, ...) on CPU with torch_native attention.
# Registered whatever the guard mode: serving features. Each hook changes only the torch_native
# backend / the CPU rope factory, and calls SGLang's code unchanged otherwise.
# The guard on a prefill/decode pair (pd_guard.py): on the decode server a KV transfer is a
# writer the guard checks, claimed when issued and sealed when it lands. Registered with the guard.
_DECODE = "sglang.srt.disaggregation.decode"
PD_GUARD_TARGETS = [
    (
        "sglang.srt.disaggregation.utils.MetadataBuffers.set_buf",
        "AFTER",
        "pd_guard.after_set_buf",
        "prefill: the request's first-token metadata row, sent after its KV, carries the sender's "
        "seal of the transferred positions in cached_tokens' spare words 7-11",
    ),
    (
        f"{_DECODE}.DecodeReqToTokenPool.alloc",
        "AROUND",
        "pd_guard.around_decode_rows_alloc",
        "the decode server's page-table rows handed to new requests (its pool has no alloc_rows)",
    ),
    (
        f"{_DECODE}.DecodePreallocQueue._pre_alloc",
        "AFTER",
        "pd_guard.after_pre_alloc",
        "a transfer's destination slots are allocated: claimed for the request, unsealed",
    ),
    (
        f"{_DECODE}.DecodeTransferQueue._commit_transfer_to_req",
        "AROUND",
        "pd_guard.around_commit_transfer",
        "the transfer landed on every rank: sealed if its claim is unchanged, else the request is aborted",
    ),
    (
        "sglang.srt.managers.schedule_batch.Req.offload_kv_cache",
        "AFTER",
        "pd_guard.after_offload_kv_cache",
        "decode: a retracted request's KV copied to the host (cpu_tensor backup): the guard's "
        "seal of it stays with the request",
    ),
    (
        f"{_DECODE}.restore_kv_cache",
        "AROUND",
        "pd_guard.around_restore_kv_cache",
        "decode: the backup written back into the resumed request's claimed slots: a landing, "
        "compared with the backup's seal (decode.py's own name for mem_cache.common's function)",
    ),
]

MLA_TARGETS = [
    (
        "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler",
        "AROUND",
        "mla_cpu.around_get_handler",
        "no torch_native handler: Triton's sends prefill to the MHA path (ragged K/V), while "
        "torch_native reads latent rows from the pool; answer with the absorbed-MLA method",
    ),
    (
        "sglang.srt.layers.rotary_embedding.factory.get_rope_cpu",
        "AROUND",
        "mla_cpu.around_get_rope_cpu",
        "the CPU rope factory asserts deepseek_yarn; other ropes (none, default, ...) go to "
        "SGLang's generic get_rope (forward_native on CPU)",
    ),
    # FP8 MLA KV on CPU: the pool is lifted and registered by cpu_fp8_kv.around_configure (a
    # QUANT_TARGETS row); the read is dequantized by the same torch_native hooks as for MHA.
    (
        "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool.set_kv_buffer",
        "BEFORE",
        "cpu_fp8_kv.scale_mla_write",
        "FP8 latent row = fp8(row / k_scale): SGLang's MLA pool casts without the layer's scale",
    ),
    (
        "sglang.srt.model_executor.model_runner_components.load_model_utils.load_kv_cache_scales",
        "AROUND",
        "cpu_fp8_kv.around_load_kv_cache_scales",
        "--quantization-param-path for MLA models (SGLang's DeepSeek model cannot load it): "
        "per-layer latent scales onto attn_mqa",
    ),
]

# DSA models (GLM-5 GlmMoeDsaForCausalLM, DeepSeek V3.2: MLA + sparse-attention indexer) on CPU
# with torch_native attention (dsa_cpu.py). Registered whatever the guard mode: serving features.
# Each hook acts on a CPU device and a DSA model or pool only, and calls SGLang's code unchanged
# otherwise. Registered after READ_TARGETS: the attention hook is the outermost.
DSA_TARGETS = [
    (
        "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments",
        "AROUND",
        "dsa_cpu.around_model_specific_adjustments",
        "DSA argument handling asks torch.cuda.get_device_capability() (no driver on CPU): "
        "answered once, and the KV-dtype and DSA-backend passes swapped for CPU resolutions",
    ),
    (
        "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.forward_native",
        "AROUND",
        "dsa_cpu.around_indexer_forward_native",
        "the indexer has no torch path (raises): FP8 index keys into SGLang's page-major "
        "buffer, top-k of the fused GLM path's logits",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        "AROUND",
        "dsa_cpu.around_attention",
        "forward_mla passes topk_indices, which torch_native does not take: sparse MLA over "
        "the selected positions (DSA pools only)",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
        "AROUND",
        "dsa_cpu.around_attention",
        "same, decode",
    ),
    (
        "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool.get_cpu_copy",
        "AROUND",
        "dsa_cpu.around_offload",
        "retraction offload calls torch.cuda.synchronize(): a no-op for a CPU pool",
    ),
    (
        "sglang.srt.mem_cache.memory_pool.DSATokenToKVPool.load_cpu_copy",
        "AROUND",
        "dsa_cpu.around_offload",
        "same, on resume",
    ),
]

# Every other SGLang name the patches use without hooking it: classes and functions they import
# or call, private methods they call, attributes they read or write. A version bump that renames
# one of these breaks a patch silently, or only at the first violation long after start, so
# tests/test_targets.py resolves each row against the installed SGLang.
# Each row: (dotted name, kind, patch module(s) that use it, why); each name once (fuzz/plugin.py
# FUZZ_NAMES extends this table with the fault injector's own). Kinds:
#   "callable"      resolves and is callable (class, function, method, property getter excluded)
#   "value"         resolves (module constant, class attribute, property)
#   "attribute"     an instance attribute: a class-level name, an annotated field, or assigned as
#                   ``self.<name> =`` in the source of the class or one of its SGLang bases
#   "frozen_field"  a field of a frozen dataclass (written with object.__setattr__)
#   "parameter"     a parameter of the named function (passed by keyword)
#   "module_attr"   a module global the patch rebinds for the duration of one call
_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_REQ = "sglang.srt.managers.schedule_batch.Req"
_REQ_KV = "sglang.srt.managers.schedule_batch.ReqKvInfo"
_ALLOC = "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator"
_PAGED = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
_TOKEN = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
_RADIX = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
_PREFIX = "sglang.srt.mem_cache.base_prefix_cache"
_FB = "sglang.srt.model_executor.forward_batch_info.ForwardBatch"
_RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"
_KVC = "sglang.srt.mem_cache.kv_cache_configurator"
_POOLS = "sglang.srt.mem_cache.memory_pool"
_CT = "sglang.srt.layers.quantization.compressed_tensors"

# fmt: off
SGLANG_NAMES = [
    # -- engine control: abort, withhold pages, rebuild the free list (control.py) --------------
    (
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._cell_size",
        "attribute",
        "pool_budget",
        "SGLang's KV bytes per token, to take the guard's share from the budget",
    ),
    (f"{_SCHED}._pending_chunked_abort_req", "attribute", "control", "deferred abort of a chunked prefill"),
    (f"{_SCHED}.chunked_req", "attribute", "control, recompute", "the request mid chunked prefill; recompute: a chunked prefill sent back is released before its next chunk"),
    (f"{_SCHED}.token_to_kv_pool_allocator", "attribute", "control", "the KV allocator"),
    (f"{_SCHED}.req_to_token_pool", "attribute", "adapter", "the page table"),
    (f"{_SCHED}.tree_cache", "attribute", "control", "the prefix cache, for the free-list rebuild"),
    (f"{_SCHED}.batch_result_processor", "attribute", "forward_hooks", "result loop, release path"),
    (f"{_SCHED}.tp_worker", "attribute", "lifecycle", "reaches the model runner's KV pool"),
    (f"{_SCHED}.tp_size", "attribute", "state", "tensor-parallel degree"),
    (f"{_SCHED}.is_generation", "attribute", "lifecycle", "embedding models are refused at attach"),
    ("sglang.srt.entrypoints.http_server.app", "value", "health_endpoint", "the middleware at the front door"),
    ("sglang.srt.entrypoints.engine.Engine._scheduler_init_result", "attribute", "guard_status", "every scheduler's start-up handshake, read back by kvguard.install"),
    ("sglang.srt.entrypoints.engine.SchedulerInitResult.scheduler_infos", "attribute", "guard_status", "one handshake per scheduler"),
    (f"{_SCHED}.tp_cpu_group", "attribute", "peers", "the verdict agreement (OR of words, sparse page lists)"),
    (f"{_SCHED}.flush_cache", "callable", "lifecycle", "flush the prefix cache once idle"),
    (f"{_SCHED}.is_fully_idle", "callable", "invariant_hooks", "rebuild the free list only when idle"),
    (f"{_RESULTS}.SchedulerBatchResultProcessor._handle_sampling_mask_abort", "callable", "control", "release an aborted request without committing its KV"),
    (f"{_RESULTS}.SchedulerBatchResultProcessor.enable_overlap", "frozen_field", "forward_hooks", "overlap semantics for one call: an aborted request's token is not emitted"),
    ("sglang.srt.managers.schedule_batch.FINISH_ABORT", "callable", "control", "finish reason of an aborted request"),
    (f"{_REQ}.finished", "callable", "control", "already finished: nothing to abort"),
    (f"{_REQ}.is_retracted", "attribute", "control", "a request sent back: the result loop commits and streams nothing of it"),
    (f"{_REQ}.reset_for_retract", "callable", "recompute", "reset a request sent back, as SGLang's retraction does"),
    (f"{_REQ}.output_ids", "attribute", "recompute, pd_guard", "the tokens it produced: kept, re-prefilled (control: how many left); pd_guard: tokens produced before a transfer (a resumed request)"),
    (f"{_REQ}.origin_input_ids", "attribute", "recompute, pd_guard", "its prompt; pd_guard: the prompt whose KV is transferred"),
    (f"{_REQ}.beam_group", "attribute", "control", "beam groups cannot be retracted: aborted"),
    (f"{_REQ}.input_embeds", "attribute", "control", "restarted from scratch when retracted: aborted"),
    (f"{_REQ}.multimodal_inputs", "attribute", "control", "not recomputed: aborted"),
    (f"{_SCHED}._add_request_to_queue", "callable", "recompute", "re-queue a request sent back (is_retracted=True)"),
    (f"{_SCHED}.send_abort_output", "callable", "recompute", "abort a request whose healing failed, outside the result loop"),
    ("sglang.srt.managers.scheduler._make_abort_req", "callable", "recompute", "its abort message"),
    (f"{_SCHED}.waiting_queue", "attribute", "recompute", "a request SGLang re-queued itself is not re-queued twice"),
    (f"{_SCHED}.result_queue", "attribute", "recompute", "batches launched, results not processed (overlap)"),
    (f"{_SCHED}.running_batch", "attribute", "recompute", "a request sent back leaves it"),
    (f"{_SCHED}.last_batch", "attribute", "recompute", "and the prefill batch about to merge into it"),
    ("sglang.srt.managers.schedule_batch.ScheduleBatch.filter_batch", "callable", "recompute", "drop requests sent back from a batch"),
    ("sglang.srt.mem_cache.common.release_kv_cache", "callable", "recompute", "release a request sent back without checkpointing it"),
    (f"{_REQ}.finished_reason", "attribute", "control, pd_guard", "set to FINISH_ABORT; pd_guard: a request SGLang aborted at commit"),
    (f"{_REQ}.discard_output_reason", "attribute", "control", "abort reason of a chunked prefill"),
    (f"{_REQ}.skip_radix_cache_insert", "attribute", "control", "suspect KV never enters the prefix cache"),
    (f"{_REQ}.rid", "attribute", "adapter", "request id in verdicts and logs"),
    (f"{_REQ}.full_untruncated_fill_ids", "attribute", "adapter", "the prompt's own prefix tokens"),
    (f"{_REQ}.extra_key", "attribute", "cache_hooks", "prefix-cache namespace of a refused hit"),
    (f"{_REQ}.kv", "attribute", "control", "the request's KV bookkeeping"),
    (f"{_REQ_KV}.holds_kv", "value", "control", "whether the request holds a page-table row"),
    (f"{_REQ_KV}.req_pool_idx", "attribute", "control", "its page-table row"),
    (f"{_REQ_KV}.cache_protected_len", "attribute", "cache_hooks", "prefix the tree owns"),
    (f"{_ALLOC}.free_pages", "attribute", "control", "free list: quarantined pages withheld"),
    (f"{_ALLOC}.release_pages", "attribute", "control", "pages waiting to re-enter the free list"),
    (f"{_ALLOC}.free_group", "attribute", "pool_hooks", "grouped frees come back ungrouped"),
    (f"{_ALLOC}.page_size", "attribute", "lifecycle", "the ledger's page size"),
    (f"{_ALLOC}.size", "attribute", "control", "slot count at page size 1"),
    (f"{_ALLOC}.device", "attribute", "control", "device of the rebuilt free list"),
    (f"{_ALLOC}.available_size", "callable", "control", "free slots before and after a rebuild"),
    (f"{_PAGED}.staged_pages", "attribute", "control", "freed pages staged before the free list"),
    (f"{_PAGED}.num_staged_pages", "attribute", "control", "their count, kept consistent"),
    (f"{_PAGED}.num_pages", "attribute", "control", "page count at page size > 1"),
    (f"{_PAGED}.free_page_ids", "callable", "control", "free pages displaced from an aborted row"),
    (f"{_TOKEN}.free_page_ids", "callable", "control", "same, page size 1"),
    (f"{_RADIX}.evictable_size", "callable", "control", "pages the tree holds"),
    (f"{_RADIX}.protected_size", "callable", "control", "pages the tree holds, locked"),
    (f"{_RADIX}.all_values_flatten", "callable", "control", "every slot the tree holds"),
    # -- prefix cache (cache_hooks.py) --------------------------------------------------------
    (f"{_RADIX}._match_tree", "callable", "cache_hooks", "would an insert swap in quarantined pages"),
    (f"{_RADIX}.path_device_indices", "callable", "cache_hooks", "slots of a matched path"),
    (f"{_PREFIX}.MatchPrefixParams", "callable", "cache_hooks", "a match query"),
    (f"{_PREFIX}.MatchPrefixParams.key", "attribute", "cache_hooks", "its radix key"),
    (f"{_PREFIX}.MatchPrefixParams.req", "attribute", "cache_hooks", "the request behind a match"),
    (f"{_PREFIX}.MatchResult.device_prefix_len", "attribute", "cache_hooks", "matched length"),
    (f"{_PREFIX}.MatchResult.last_device_node", "attribute", "cache_hooks", "end of the matched path"),
    (f"{_PREFIX}.MatchResult.cache_protected_len", "attribute", "cache_hooks", "reset in a refused hit"),
    (f"{_PREFIX}.MatchResult._replace", "callable", "cache_hooks", "a refused hit protects nothing"),
    (f"{_PREFIX}.zero_match_result", "callable", "cache_hooks", "a miss in place of a refused hit"),
    ("sglang.srt.mem_cache.common._req_radix_key", "callable", "cache_hooks", "radix key of a request's tokens"),
    # -- the forward and its batch (adapter.py, forward_hooks.py) -------------------------------
    ("sglang.srt.managers.schedule_batch.ScheduleBatch.reqs", "attribute", "forward_hooks", "the batch's requests"),
    ("sglang.srt.managers.utils.GenerationBatchResult.copy_done", "attribute", "forward_hooks", "the post-forward sync"),
    ("sglang.srt.managers.tp_worker.TpModelWorker.model_runner", "attribute", "lifecycle", "the model runner"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.token_to_kv_pool", "attribute", "lifecycle", "the KV pool"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.forward_pass_id", "attribute", "forward_hooks", "the step number"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardMode.is_decode", "callable", "adapter", "decode step"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardMode.is_extend", "callable", "adapter", "prefill step"),
    (f"{_FB}.forward_mode", "attribute", "adapter", "decode or extend"),
    (f"{_FB}.req_pool_indices", "attribute", "adapter, dsa_cpu", "each request's page-table row"),
    (f"{_FB}.seq_lens", "attribute", "adapter", "decode: prefix length + 1"),
    (f"{_FB}.seq_lens_cpu", "attribute", "adapter, dsa_cpu", "longest prefix without a device read; dsa_cpu: keys per request"),
    (f"{_FB}.extend_prefix_lens", "attribute", "adapter", "prefill: cached prefix lengths"),
    (f"{_FB}.extend_prefix_lens_cpu", "attribute", "adapter", "the same on the host"),
    (f"{_FB}.extend_seq_lens", "attribute", "adapter", "prefill: new tokens per request"),
    (f"{_FB}.out_cache_loc", "attribute", "adapter", "the slots the forward writes"),
    (f"{_FB}.positions", "attribute", "adapter", "positions of the written tokens"),
    (f"{_FB}.input_ids", "attribute", "adapter", "token ids of the written tokens"),
    (f"{_FB}.encoder_lens", "attribute", "cpu_fp8_kv", "encoder-decoder batches keep SGLang's read"),
    (f"{_POOLS}.ReqToTokenPool.req_to_token", "attribute", "adapter", "the page table tensor"),
    (f"{_POOLS}.MHATokenToKVPool.k_buffer", "attribute", "adapter", "K per layer, guarded bytes"),
    (f"{_POOLS}.MHATokenToKVPool.v_buffer", "attribute", "adapter", "V per layer, guarded bytes"),
    (f"{_POOLS}.MHATokenToKVPool.start_layer", "attribute", "cpu_fp8_kv", "first layer of this rank"),
    (f"{_POOLS}.MHATokenToKVPool.dtype", "attribute", "kv_write", "the dtype SGLang casts a store to"),
    (f"{_POOLS}.MHATokenToKVPool.store_dtype", "attribute", "kv_write", "the dtype it views stored rows as"),
    (f"{_POOLS}.MHATokenToKVPool.is_quantized_kv_cache", "attribute", "kv_write", "a store through the quant method"),
    (f"{_POOLS}.MHATokenToKVPool.quant_method", "attribute", "kv_write", "which one (CPU FP8 modelled)"),
    (f"{_POOLS}.MHATokenToKVPool._quantized_scales", "callable", "kv_write", "the write scales SGLang's quantized store uses"),
    (f"{_POOLS}.MLATokenToKVPool.dtype", "attribute", "kv_write, cpu_fp8_kv", "the dtype SGLang casts a latent store to; cpu_fp8_kv: FP8 requested for the latent rows"),
    (f"{_POOLS}.MLATokenToKVPool.store_dtype", "attribute", "kv_write", "the dtype it views stored rows as"),
    (f"{_POOLS}.KVWriteLoc.loc", "attribute", "kv_write", "the slots of a wrapped write location"),
    (f"{_POOLS}.MLATokenToKVPool.kv_buffer", "attribute", "adapter", "latent row per layer, guarded bytes"),
    (f"{_POOLS}.DSATokenToKVPool.kv_buffer", "attribute", "adapter", "latent row per layer, guarded bytes"),
    (f"{_POOLS}.DSATokenToKVPool.index_k_with_scale_buffer", "attribute", "adapter", "index keys, then their scales, per page and indexer layer: guarded bytes"),
    (f"{_POOLS}.DSATokenToKVPool.page_size", "attribute", "adapter", "slots per index page"),
    (f"{_POOLS}.DSATokenToKVPool.index_head_dim", "attribute", "adapter", "bytes of an FP8 index key"),
    (f"{_POOLS}.DSATokenToKVPool.quant_block_size", "attribute", "adapter", "key values per fp32 scale"),
    (f"{_POOLS}.DSATokenToKVPool.index_kpool", "attribute", "adapter, dsa_cpu", "one allocator page per index page, else refused; dsa_cpu: tokens per index key: 1 only"),
    (f"{_POOLS}.DSATokenToKVPool.index_page_size", "attribute", "adapter, dsa_cpu", "keys per index page: 64 only"),
    (f"{_POOLS}.DSATokenToKVPool.kpool_use_compress", "attribute", "adapter", "compressed index tails refused"),
    # -- SGLang's self-checks (invariant_hooks.py) ----------------------------------------------
    ("sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats.full_num_used", "attribute", "invariant_hooks", "clamped at 0 after contained violations"),
    ("sglang.srt.managers.scheduler_components.pool_stats_observer.PoolStats.full_token_usage", "attribute", "invariant_hooks", "same"),
    # -- FP8 KV on CPU (cpu_fp8_kv.py) ----------------------------------------------------------
    (f"{_KVC}.cpu_has_amx_support", "module_attr", "cpu_fp8_kv", "the AMX gate, answered once"),
    (f"{_KVC}.attention_backends", "module_attr", "cpu_fp8_kv", "the backend check after it"),
    (f"{_KVC}.KVCacheConfigurator.kv_cache_dtype", "attribute", "cpu_fp8_kv", "FP8 requested"),
    (f"{_KVC}.KVCacheConfigurator.use_mla_backend", "attribute", "cpu_fp8_kv", "MLA: the other gate"),
    (f"{_KVC}.KVCacheConfigurator.spec_algorithm", "attribute", "cpu_fp8_kv", "speculative decoding refused"),
    (f"{_KVC}.KVCacheConfigResult.token_to_kv_pool", "attribute", "cpu_fp8_kv", "the pool built"),
    ("sglang.srt.layers.quantization.fp4_kv_cache_quant_method.CPUFP8KVCacheMethod.name", "value", "cpu_fp8_kv", "the pool's quant method is SGLang's CPU FP8"),
    ("sglang.srt.platforms.current_platform", "value", "cpu_fp8_kv", "CPU platform check"),
    ("sglang.srt.runtime_context.attention_backends", "callable", "cpu_fp8_kv", "configured backends"),
    ("sglang.srt.utils.common.cpu_has_amx_support", "callable", "cpu_fp8_kv", "SGLang's own AMX route"),
    ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.token_to_kv_pool", "attribute", "cpu_fp8_kv", "the pool an attention call reads"),
    ("sglang.srt.layers.radix_attention.RadixAttention.layer_id", "attribute", "cpu_fp8_kv", "the layer's tables"),
    ("sglang.srt.layers.radix_attention.RadixAttention.k_scale", "attribute", "cpu_fp8_kv", "per-layer K scale"),
    ("sglang.srt.layers.radix_attention.RadixAttention.k_scale_float", "attribute", "cpu_fp8_kv", "the same as a float"),
    ("sglang.srt.layers.radix_attention.RadixAttention.v_scale", "attribute", "cpu_fp8_kv", "per-layer V scale"),
    ("sglang.srt.layers.radix_attention.RadixAttention.v_scale_float", "attribute", "cpu_fp8_kv", "the same as a float"),
    # -- INT4 weights (int4_cpu_linear.py) ------------------------------------------------------
    ("sglang.srt.layers.linear.LinearBase", "callable", "int4_cpu_linear", "dynamic overrides apply to linears"),
    ("sglang.srt.layers.quantization.gptq.gptq.GPTQLinearMethod", "callable", "int4_cpu_linear", "per-module method"),
    ("sglang.srt.layers.quantization.utils.get_linear_quant_method", "callable", "int4_cpu_linear", "SGLang's per-module override helper"),
    ("sglang.srt.layers.quantization.gptq.gptq.GPTQConfig.weight_bits", "attribute", "int4_cpu_linear", "4-bit only"),
    ("sglang.srt.layers.quantization.gptq.gptq.GPTQConfig.group_size", "attribute", "int4_cpu_linear", "kernel choice"),
    ("sglang.srt.layers.quantization.gptq.gptq.GPTQConfig.checkpoint_format", "attribute", "int4_cpu_linear", "gptq vs gptq_v2 zero points"),
    ("sglang.srt.layers.quantization.gptq.gptq.CPUGPTQConfig.dynamic", "attribute", "int4_cpu_linear", "per-module overrides"),
    # -- kv-canary on CPU (kv_canary_cpu.py) ----------------------------------------------------
    ("sglang.srt.kv_canary.runner.future_tensor._DUMMY_DICT_KEY", "value", "kv_canary_cpu", "a bare tensor's payload key"),
    ("sglang.srt.kv_canary.runner.future_tensor.FutureTensors._data", "attribute", "kv_canary_cpu", "built directly on CPU"),
    ("sglang.srt.kv_canary.runner.future_tensor.FutureTensors._event", "attribute", "kv_canary_cpu", "same"),
    ("sglang.srt.kv_canary.runner.future_tensor.FutureTensors._retained_device_clones", "attribute", "kv_canary_cpu", "same"),
    ("sglang.srt.utils.phase_checker.SimplePhaseChecker._device", "attribute", "kv_canary_cpu", "CPU or not"),
    ("sglang.srt.utils.phase_checker.SimplePhaseChecker._phase", "attribute", "kv_canary_cpu", "the phase, checked and advanced"),
    ("sglang.srt.utils.phase_checker.SimplePhaseChecker._enable_assert_device", "attribute", "kv_canary_cpu", "whether to check it"),
    # -- tensor parallelism on CPU (cpu_tensor_parallel.py) -------------------------------------
    ("sglang.srt.distributed.parallel_state.init_model_parallel_group.use_pynccl", "parameter", "cpu_tensor_parallel", "no PyNccl without CUDA"),
    # -- added with guard v2 in SGLang (lifecycle, adapter, cache_hooks, tenancy) ---------------
    ("sglang.srt.speculative.spec_info.SpeculativeAlgorithm.is_none", "callable", "cpu_fp8_kv", "no speculative algorithm"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardMode.is_idle", "callable", "adapter", "idle batches carry no KV"),
    (f"{_FB}.extend_seq_lens_cpu", "attribute", "adapter, dsa_cpu", "new tokens per request, on the host; dsa_cpu: query tokens per request"),
    ("sglang.srt.mem_cache.radix_cache.RadixKey.token_ids", "attribute", "cache_hooks", "the tokens a hit must hold"),
    ("sglang.srt.mem_cache.radix_cache.RadixKey.extra_key", "attribute", "cache_hooks", "the hit's prefix-cache namespace"),
    ("sglang.srt.mem_cache.radix_cache.RadixKey.cache_salt", "attribute", "cache_hooks", "the same, per-request salt"),
    (f"{_REQ}.cache_salt", "attribute", "tenancy", "a request's tenant: its prefix-cache salt"),
    # -- MLA models on CPU (mla_cpu.py, cpu_fp8_kv.py's MLA part) --------------------------------
    ("sglang.srt.models.deepseek_common.attention_backend_handler._dispatch_mla_subtype", "callable", "mla_cpu", "the absorbed-MLA method SGLang picks"),
    ("sglang.srt.layers.rotary_embedding.factory.get_rope", "callable", "mla_cpu", "the generic rope factory"),
    (f"{_KVC}.current_platform", "value", "cpu_fp8_kv", "rebound for one call: the pre-AMX MLA refusal"),
    (f"{_POOLS}.MLATokenToKVPool.start_layer", "attribute", "cpu_fp8_kv", "first layer of this rank"),
    ("sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA.attn_mqa", "attribute", "cpu_fp8_kv", "the attention reading the latent cache"),
    ("sglang.srt.models.deepseek_v2.DeepseekV2AttentionMLA.kv_lora_rank", "attribute", "cpu_fp8_kv", "marks an MLA attention module"),
    ("sglang.srt.runtime_context.get_model", "callable", "cpu_fp8_kv", "the model argument group"),
    ("sglang.srt.server_args.ServerArgs.quantization_param_path", "attribute", "cpu_fp8_kv", "the KV scales file"),
    ("sglang.srt.model_loader.weight_utils.kv_cache_scales_loader", "callable", "cpu_fp8_kv", "SGLang's reader of that file"),
    ("sglang.srt.distributed.parallel_state.get_tensor_model_parallel_rank", "callable", "cpu_fp8_kv", "the file's rank entry"),
    ("sglang.srt.distributed.parallel_state.get_tensor_model_parallel_world_size", "callable", "cpu_fp8_kv", "and its rank count"),
    # -- DSA models on CPU (dsa_cpu.py) --------------------------------------------------------
    ("sglang.srt.arg_groups.model_hook._dsa_kv_cache_dtype_default", "module_attr", "dsa_cpu", "the KV-dtype pass, swapped for one call"),
    ("sglang.srt.arg_groups.model_hook._dsa_split_backend_resolution", "module_attr", "dsa_cpu", "the DSA-backend pass, swapped for one call"),
    ("sglang.srt.arg_groups.overrides.model_config_of", "callable", "dsa_cpu", "the model's HF config"),
    ("sglang.srt.configs.model_config.is_deepseek_dsa", "callable", "dsa_cpu", "a DSA model"),
    ("sglang.srt.server_args.ServerArgs.device", "attribute", "dsa_cpu", "a CPU engine"),
    ("sglang.srt.server_args.ServerArgs.kv_cache_dtype", "attribute", "dsa_cpu", "read by the CPU KV-dtype pass"),
    ("sglang.srt.server_args.ServerArgs.dsa_prefill_backend", "attribute", "dsa_cpu", "GPU kernel named: refused on CPU"),
    ("sglang.srt.server_args.ServerArgs.dsa_decode_backend", "attribute", "dsa_cpu", "same"),
    ("sglang.srt.model_executor.forward_context.get_token_to_kv_pool", "callable", "dsa_cpu", "the pool the indexer writes"),
    ("sglang.srt.model_executor.forward_context.get_req_to_token_pool", "callable", "dsa_cpu", "the page table it reads through"),
    ("sglang.srt.state_capturer.indexer_topk.maybe_capture_indexer_topk", "callable", "dsa_cpu", "SGLang's top-k capture, as the CUDA indexer"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.index_topk", "attribute", "dsa_cpu", "k"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.n_heads", "attribute", "dsa_cpu", "index heads"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.head_dim", "attribute", "dsa_cpu", "128"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.rope_head_dim", "attribute", "dsa_cpu", "rope part of q and k"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.softmax_scale", "attribute", "dsa_cpu", "head_dim^-1/2"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.wq_b", "attribute", "dsa_cpu", "index queries"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.wk", "attribute", "dsa_cpu", "index keys (unfused: no CUDA)"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.k_norm", "attribute", "dsa_cpu", "their LayerNorm"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.weights_proj", "attribute", "dsa_cpu", "head weights (bf16)"),
    ("sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.rotary_emb", "attribute", "dsa_cpu", "the indexer's rope"),
    (f"{_POOLS}.DSATokenToKVPool.get_index_k_with_scale_buffer", "callable", "dsa_cpu", "a layer's index-key bytes"),
    (f"{_POOLS}.DSATokenToKVPool.index_key_cache", "attribute", "dsa_cpu", "marks a DSA pool"),
    (f"{_POOLS}.MLATokenToKVPool.dsa_kv_cache_store_fp8", "attribute", "dsa_cpu", "packed FP8 latent rows"),
    (f"{_POOLS}.MLATokenToKVPool.kv_lora_rank", "attribute", "dsa_cpu", "R: the packed row's layout"),
    (f"{_POOLS}.KVWriteLoc", "callable", "dsa_cpu", "the latent row's write location"),
    ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.req_to_token_pool", "attribute", "dsa_cpu", "the page table attention reads through"),
    ("sglang.srt.layers.radix_attention.RadixAttention.tp_q_head_num", "attribute", "dsa_cpu", "heads of the query"),
    ("sglang.srt.layers.radix_attention.RadixAttention.qk_head_dim", "attribute", "dsa_cpu", "R + rope"),
    ("sglang.srt.layers.radix_attention.RadixAttention.v_head_dim", "attribute", "dsa_cpu", "R"),
    ("sglang.srt.layers.radix_attention.RadixAttention.scaling", "attribute", "dsa_cpu", "softmax scale"),
    # -- options the guard cannot check (engine_options.py; its table's fields and flags are
    # -- resolved against ServerArgs and SGLang's parser by tests/test_engine_options.py) -------
    ("sglang.srt.managers.scheduler.Scheduler.__init__.server_args", "parameter", "engine_options", "the options a scheduler starts with"),
    # -- the guard on a prefill/decode pair (pd_guard.py, control.py) -----------------------------
    ("sglang.srt.disaggregation.decode.DecodeRequest.req", "attribute", "pd_guard", "the request a transfer is for"),
    ("sglang.srt.disaggregation.utils._is_fake_transfer", "callable", "pd_guard", "a fake transfer moves no KV"),
    (f"{_REQ}.bootstrap_room", "attribute", "pd_guard", "the transfer's room (the test switch)"),
    (f"{_REQ_KV}.kv_committed_len", "attribute", "pd_guard", "positions the transfer fills"),
    (f"{_SCHED}.disaggregation_mode", "attribute", "control", "a PD server cannot re-prefill a request"),
    ("sglang.srt.disaggregation.checksum.KvChecksumComputer._kv_data_ptrs", "attribute", "pd_cpu", "the KV buffers SGLang's checksum digests"),
    ("sglang.srt.disaggregation.checksum.KvChecksumComputer._kv_item_lens", "attribute", "pd_cpu", "bytes per page of each"),
    ("sglang.srt.disaggregation.checksum.KvChecksumComputer._state_data_ptrs", "attribute", "pd_cpu", "state buffers (hybrid models)"),
    ("sglang.srt.disaggregation.checksum.KvChecksumComputer._state_item_lens", "attribute", "pd_cpu", "bytes per state item"),
    ("sglang.srt.server_args.ServerArgs", "callable", "engine_options", "their raw input: the fields OPTIONS names"),
    # -- compressed-tensors W4A16 on CPU (int4_cpu_moe.py) --------------------------------------
    (f"{_CT}.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE", "callable", "int4_cpu_moe", "the experts' scheme"),
    (f"{_CT}.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.num_bits", "attribute", "int4_cpu_moe", "4-bit only"),
    (f"{_CT}.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.sym", "attribute", "int4_cpu_moe", "symmetric only"),
    (f"{_CT}.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.strategy", "attribute", "int4_cpu_moe", "group quantization only"),
    (f"{_CT}.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.group_size", "attribute", "int4_cpu_moe", "the GEMM's group size"),
    (f"{_CT}.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.actorder", "attribute", "int4_cpu_moe", "no activation reordering"),
    (f"{_CT}.schemes.compressed_tensors_wNa16_moe.CompressedTensorsWNA16MoE.moe_runner_config", "attribute", "int4_cpu_moe", "activation and routing settings"),
    (f"{_CT}.schemes.compressed_tensors_wNa16.CompressedTensorsWNA16", "callable", "int4_cpu_moe", "the linears' scheme"),
    (f"{_CT}.schemes.compressed_tensors_wNa16.CompressedTensorsWNA16.group_size", "attribute", "int4_cpu_moe", "the GEMM's group size"),
    (f"{_CT}.compressed_tensors.CompressedTensorsConfig.get_scheme_dict", "callable", "int4_cpu_moe", "a linear's weight settings"),
    (f"{_CT}.compressed_tensors.CompressedTensorsConfig.quant_format", "attribute", "int4_cpu_moe", "pack-quantized"),
    ("sglang.srt.layers.moe.token_dispatcher.StandardCombineInput", "callable", "int4_cpu_moe", "the experts' output"),
    ("sglang.srt.layers.moe.token_dispatcher.StandardDispatchOutput.topk_output", "attribute", "int4_cpu_moe", "routing of the experts' input"),
    ("sglang.srt.layers.moe.moe_runner.MoeRunnerConfig.apply_router_weight_on_input", "attribute", "int4_cpu_moe", "unsupported on CPU"),
    ("sglang.srt.layers.moe.moe_runner.MoeRunnerConfig.activation", "attribute", "int4_cpu_moe", "SiLU only"),
    ("sglang.srt.layers.moe.moe_runner.MoeRunnerConfig.gemm1_alpha", "attribute", "int4_cpu_moe", "plain SiLU-and-mul only"),
    # -- every hook applied, or no start (hook_check.py) -----------------------------------------
    ("sglang.srt.plugins.hook_registry.HookRegistry.apply_hooks", "callable", "hook_check", "wrapped: each row is checked as soon as SGLang applied every plugin's hooks"),
    ("sglang.srt.plugins.hook_registry._wrap_fn", "callable", "hook_check", "its wrappers' code tells HookRegistry's wrappers, and the hook in each, apart"),
]
# fmt: on

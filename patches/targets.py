"""Every SGLang 0.5.23 target kvguard touches, in one table. A version bump is a change here
(and in the hook functions the table names), nowhere else.

Each row: (dotted target, hook type, hook function in ``kvguard.patches``, why).
"""

from __future__ import annotations

GUARD_TARGETS = [
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
        "every slot re-entering the free list (page_size 1)",
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
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker._check_pool_invariant",
        "AROUND",
        "invariant_hooks.around_pool_invariant",
        "count quarantined pages in SGLang's idle memory self-check",
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
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        "AROUND",
        "cpu_fp8_kv.around_attention",
        "select the layer's FP8 dequantization tables (k_scale/v_scale)",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
        "AROUND",
        "cpu_fp8_kv.around_attention",
        "same, decode",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend",
        "AROUND",
        "cpu_fp8_kv.around_sdpa",
        "dequantize on read: SDPA over a compact table-dequantized copy of the rows the batch reads",
    ),
    (
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_decode",
        "AROUND",
        "cpu_fp8_kv.around_sdpa",
        "same, decode",
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

# MLA models (DeepSeek-V2/V3 architecture: Kimi K2, ...) on CPU with torch_native attention.
# Registered whatever the guard mode: serving features. Each hook changes only the torch_native
# backend / the CPU rope factory, and calls SGLang's code unchanged otherwise.
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
]

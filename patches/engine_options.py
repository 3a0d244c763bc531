"""Every SGLang 0.5.23 option that changes how KV is written, read, moved or shared, in one table:
guarded (a test serves it with the guard), refused (kvguard cannot check it: it says so in one line
and nothing starts) or neutral (it changes none of the KV paths the guard checks, and why).

``refusals`` applies the table to the options a server starts with: ``kvguard-serve`` before
SGLang parses anything, and the BEFORE hook on ``Scheduler.__init__`` for ``python -m
sglang.launch_server`` (before the scheduler builds a pool). ``docs/options.md`` is generated from
the table: ``python -m kvguard.patches.engine_options --write docs/options.md``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

GUARDED, REFUSED, NEUTRAL = "guarded", "refused", "neutral"


class When(NamedTuple):
    """When an option is in effect: in words (the docs) and as a test on its value."""

    text: str
    holds: Callable[[Any], bool]


ANY = When("any value", lambda v: True)
ON = When("on", bool)
SET = When("set", lambda v: v is not None)
ABOVE_1 = When("> 1", lambda v: v is not None and v > 1)


def one_of(*values: str) -> When:
    return When(" / ".join(values), lambda v: v in values)


def none_of(*values: str) -> When:
    return When("not " + " / ".join(values), lambda v: v not in values)


def changed(default: Any) -> When:
    """A setting of a feature the guard refuses: in effect once it differs from SGLang's default
    (``tests/test_engine_options.py`` checks each default against SGLang's)."""
    return When(f"not {default!r}", lambda v: v != default)


class Row(NamedTuple):
    field: str  # ServerArgs field
    flag: str  # its command-line flag
    when: When
    status: str
    why: str
    test: str = ""  # guarded / neutral: the test that shows it (pytest node id)


# -- tests the rows cite -------------------------------------------------------------------------
_ENGINE = "tests/test_guard_engine.py::test_each_injected_bug_aborts_only_its_victims"
_TP = "tests/test_heal_engine.py::test_tensor_parallel_ranks_heal_alike"
_FP8 = "tests/test_fp8_kv.py::test_engine_fp8_kv_paranoid_guard_close_to_bf16"
_OPTION = "tests/test_engine_options.py::test_guarded_option_serves_and_catches_a_flip"
_PRIORITY = "tests/test_engine_options.py::test_priority_preemption_is_guarded"
_BUDGET = "tests/test_pool_adapter.py::test_guard_share_of_the_budget"
_POOL = "tests/test_pool_adapter.py::test_unmodelled_pools_are_refused_in_one_line"
_PASSES = "tests/test_engine_options.py::test_neutral_options_reach_sglang"
_PD_PAIR = "tests/test_pd_guard.py::test_guarded_pair_serves_a_single_server_s_outputs"
_PD_RETRACT = "tests/test_pd_pair.py::test_retracted_requests_are_restored_checked_and_served"

# -- reasons shared by a feature's settings ------------------------------------------------------
_HICACHE = (
    "kvguard does not guard HiCache (host and storage tiers write KV back and load it "
    "outside the checked forward)"
)
_LINKER = (
    "kvguard does not guard the unified-cache external linker (KV loaded from an external "
    "store, outside the checked forward)"
)
_HISPARSE = (
    "kvguard does not guard hierarchical sparse attention (KV kept in a host pool and "
    "swapped into a device buffer every step)"
)
_PD = (
    "kvguard does not guard this PD disaggregation setting (only mooncake transfers into the "
    "decode server's own pool, allocated early, are modelled)"
)
_PP = (
    "kvguard does not guard pipeline parallelism (each stage holds its layers' KV, "
    "micro-batches run asynchronously)"
)
_SPEC = (
    "kvguard does not guard speculative decoding (draft and verify forwards write, and free "
    "rejected, KV outside the paths it models)"
)
_CANARY = (
    "kvguard does not run beside SGLang's KV canary (it splices its own words into the KV "
    "buffers and writes them in its own kernels; untested together)"
)
_MAMBA = (
    "only hybrid Mamba / linear-attention models read it; their pool (HybridLinearKVPool) "
    "is refused by class (patches/adapter.py)"
)
_SWA = (
    "only sliding-window models (SWA pools) and DeepSeek-V4 read it; those pools are "
    "refused by class (patches/adapter.py)"
)
_SIZE = "sizes the pool; the guard sizes its state from the pool it finds, inside the same budget"
_ORDER = "orders or paces admission; every batch still runs through the checked forward"
_BACKEND = (
    "every backend writes the slots of out_cache_loc and reads through req_to_token, the "
    "tables the guard checks before the forward (torch_native is the one served in tests)"
)
_GRAPH = "capture and replay run inside the checked ModelRunner.forward (graphs are off on CPU)"


def _family(status: str, why: str, *rows: tuple[str, str, When]) -> list[Row]:
    return [Row(field, flag, when, status, why) for field, flag, when in rows]


# fmt: off
OPTIONS: list[Row] = [
    # ---- guarded: a test serves each with the guard on --------------------------------------
    Row("page_size", "--page-size", ANY, GUARDED,
        "the ledger tracks the pool's pages at any page size (1, 16, 64 served)", _ENGINE),
    Row("chunked_prefill_size", "--chunked-prefill-size", ANY, GUARDED,
        "a chunked prompt is a run of extend steps, each checked", _ENGINE),
    Row("tp_size", "--tp-size", ANY, GUARDED,
        "each rank guards its KV heads; verdicts are OR-reduced over the TP group", _TP),
    Row("kv_cache_dtype", "--kv-cache-dtype", one_of("auto", "bf16", "bfloat16", "fp8_e4m3"),
        GUARDED, "the guard checksums the stored bytes (FP8 on CPU: kvguard's own path)", _FP8),
    Row("attention_backend", "--attention-backend", one_of("torch_native"), GUARDED,
        "the CPU backend every engine test serves", _ENGINE),
    Row("disable_overlap_schedule", "--disable-overlap-schedule", ANY, GUARDED,
        "the overlap scheduler (default) and the plain event loop run the same checked forward",
        _OPTION),
    Row("disable_radix_cache", "--disable-radix-cache", ANY, GUARDED,
        "without sharing, KV is freed through the same hooked release path", _OPTION),
    Row("enable_mixed_chunk", "--enable-mixed-chunk", ANY, GUARDED,
        "a mixed batch is an extend step whose decode requests extend by one token", _OPTION),
    Row("enable_priority_scheduling", "--enable-priority-scheduling", ANY, GUARDED,
        "a preempted request's KV is released through release_kv_cache (hooked)", _PRIORITY),
    Row("disaggregation_mode", "--disaggregation-mode", one_of("prefill", "decode"), GUARDED,
        "prefill: its forwards are checked as a single server's, its KV sent before its pages "
        "are released, with its seal of what it sent; decode: a transfer's slots are claimed "
        "for its request when allocated and sealed when it lands if the claim is unchanged and "
        "the bytes match the prefill's seal (else the request is aborted), so KV neither a "
        "forward nor a landed transfer wrote is flagged at its first read; a flagged request "
        "is aborted, not recomputed (docs/pd.md)", _PD_PAIR),
    Row("disaggregation_enable_kv_checksum", "--disaggregation-enable-kv-checksum", ON, GUARDED,
        "SGLang's own hand-off checksum (one Adler-32 per request, compared at admission to "
        "decode; on CPU kvguard's host build of its digest) runs beside the guard's seal, its "
        "buffer apart from the seal's words; a request it aborts is released through "
        "release_kv_cache (hooked)",
        _PD_RETRACT),
    Row("disaggregation_decode_retraction_backup", "--disaggregation-decode-retraction-backup",
        SET, GUARDED,
        "where a retracted decode request's KV waits (kvguard-serve: cpu_tensor on CPU); the "
        "guard seals a cpu_tensor backup as it is taken and checks its restore as a landing "
        "(claimed slots, the bytes against that seal); a restore with no seal (host_pool) is "
        "not vouched for: that request is aborted, never served unchecked",
        _PD_RETRACT),
    # ---- neutral: the option changes no KV path the guard checks -----------------------------
    Row("max_total_tokens", "--max-total-tokens", ANY, NEUTRAL, _SIZE, _BUDGET),
    Row("mem_fraction_static", "--mem-fraction-static", ANY, NEUTRAL, _SIZE, _BUDGET),
    Row("max_running_requests", "--max-running-requests", ANY, NEUTRAL,
        "sizes the page table (req_to_token rows); the guard's row records follow it", _PASSES),
    Row("max_prefill_tokens", "--max-prefill-tokens", ANY, NEUTRAL, _ORDER, _PASSES),
    Row("prefill_max_requests", "--prefill-max-requests", ANY, NEUTRAL, _ORDER, _PASSES),
    Row("prefill_decode_interval", "--prefill-decode-interval", ANY, NEUTRAL, _ORDER, _PASSES),
    Row("schedule_policy", "--schedule-policy", ANY, NEUTRAL,
        "orders the queue; lpm / dfs-weight match prefixes through match_prefix (hooked)",
        _PASSES),
    Row("schedule_conservativeness", "--schedule-conservativeness", ANY, NEUTRAL, _ORDER,
        _PASSES),
    Row("num_continuous_decode_steps", "--num-continuous-decode-steps", ANY, NEUTRAL,
        "read nowhere in SGLang 0.5.23's runtime", _PASSES),
    Row("disable_priority_preemption", "--disable-priority-preemption", ANY, NEUTRAL,
        "whether priority scheduling preempts; a preemption is the guarded release", _PRIORITY),
    Row("priority_scheduling_preemption_threshold", "--priority-scheduling-preemption-threshold",
        ANY, NEUTRAL, "which requests priority scheduling preempts", _PRIORITY),
    Row("schedule_low_priority_values_first", "--schedule-low-priority-values-first", ANY,
        NEUTRAL, "which requests priority scheduling admits or preempts first", _PRIORITY),
    Row("default_priority_value", "--default-priority-value", ANY, NEUTRAL,
        "a request's priority when it gives none", _PRIORITY),
    Row("retraction_policy", "--retraction-policy", ANY, NEUTRAL,
        "picks which request a full pool retracts; a retraction releases KV through "
        "release_req, the path a preemption takes", _PRIORITY),
    Row("radix_eviction_policy", "--radix-eviction-policy", ANY, NEUTRAL,
        "eviction order; evicted pages are freed through the hooked allocator", _PASSES),
    Row("radix_eviction_policy_config", "--radix-eviction-policy-config", ANY, NEUTRAL,
        "tunes the eviction order", _PASSES),
    Row("disable_chunked_prefix_cache", "--disable-chunked-prefix-cache", ANY, NEUTRAL,
        "MLA prefill reads the cached prefix in chunks or at once: the same rows, inside the "
        "checked forward", _PASSES),
    Row("dtype", "--dtype", ANY, NEUTRAL,
        "with --kv-cache-dtype auto the KV is stored in the model dtype; the guard checksums "
        "stored bytes of any width (a row of no whole 32-bit words is refused by class)", _POOL),
    Row("quantization_param_path", "--quantization-param-path", ANY, NEUTRAL,
        "KV scales change the values written, not where; the guard checks the stored bytes",
        "tests/test_fp8_kv.py::test_mla_kv_scales_from_quantization_param_path"),
    Row("attention_backend", "--attention-backend", none_of("torch_native"), NEUTRAL, _BACKEND,
        _PASSES),
    Row("prefill_attention_backend", "--prefill-attention-backend", ANY, NEUTRAL, _BACKEND,
        _PASSES),
    Row("decode_attention_backend", "--decode-attention-backend", ANY, NEUTRAL, _BACKEND,
        _PASSES),
    Row("disable_cuda_graph", "--disable-cuda-graph", ANY, NEUTRAL, _GRAPH, _ENGINE),
    Row("cuda_graph_backend_decode", "--cuda-graph-backend-decode", ANY, NEUTRAL, _GRAPH,
        _PASSES),
    Row("cuda_graph_backend_prefill", "--cuda-graph-backend-prefill", ANY, NEUTRAL, _GRAPH,
        _PASSES),
    Row("enable_torch_compile", "--enable-torch-compile", ANY, NEUTRAL,
        "compiles the same model forward, inside the checked ModelRunner.forward", _PASSES),
    Row("kv_events_config", "--kv-events-config", ANY, NEUTRAL,
        "publishes the radix tree's block events to routers: metadata, no KV moves", _PASSES),
    Row("enable_cache_report", "--enable-cache-report", ANY, NEUTRAL,
        "reports cached-token counts", "tests/test_tenancy.py::test_namespace_reaches_the_scheduler"),
    Row("cpu_offload_gb", "--cpu-offload-gb", ANY, NEUTRAL, "offloads weights, not KV", _PASSES),
    Row("enable_single_batch_overlap", "--enable-single-batch-overlap", ANY, NEUTRAL,
        "overlaps MoE communication inside one forward; the batch is not split", _PASSES),
    Row("ep_size", "--ep-size", ANY, NEUTRAL,
        "experts are weights; KV stays with each attention rank", _PASSES),
    Row("disable_hybrid_swa_memory", "--disable-hybrid-swa-memory", ANY, NEUTRAL,
        "a sliding-window model gets the plain MHA pool for every layer; the guard checks whole "
        "prefixes, a superset of what windowed attention reads", _PASSES),
    *[
        Row(field, flag, ANY, NEUTRAL, why, _POOL)
        for why, rows in (
            (_SWA, (
                ("swa_full_tokens_ratio", "--swa-full-tokens-ratio"),
                ("swa_prefix_tails", "--swa-prefix-tails"),
                ("enable_encoder_swa_bounded_replay", "--enable-encoder-swa-bounded-replay"),
                ("enable_decoder_swa_bounded_replay", "--enable-decoder-swa-bounded-replay"),
                ("c128_page_size", "--c128-page-size"),
            )),
            (_MAMBA, (
                ("max_mamba_cache_size", "--max-mamba-cache-size"),
                ("mamba_full_memory_ratio", "--mamba-full-memory-ratio"),
                ("mamba_ssm_dtype", "--mamba-ssm-dtype"),
                ("mamba_radix_cache_strategy", "--mamba-radix-cache-strategy"),
                ("mamba_max_states_per_path", "--mamba-max-states-per-path"),
                ("mamba_track_interval", "--mamba-track-interval"),
                ("enable_int8_mamba_checkpoint", "--enable-int8-mamba-checkpoint"),
                ("int8_mamba_ckpt_size", "--int8-mamba-ckpt-size"),
            )),
        )
        for field, flag in rows
    ],
    # ---- refused: kvguard cannot check these; nothing starts ---------------------------------
    *_family(REFUSED, _HICACHE,
        ("enable_hierarchical_cache", "--enable-hierarchical-cache", ON),
        ("hicache_storage_backend", "--hicache-storage-backend", SET),
        ("hicache_host_memory_mode", "--hicache-host-memory-mode", changed("cache")),
        ("hicache_ratio", "--hicache-ratio", SET),
        ("hicache_size", "--hicache-size", changed(0)),
        ("hicache_host_memory_fraction", "--hicache-host-memory-fraction", changed(0.8)),
        ("hicache_write_policy", "--hicache-write-policy", changed("write_through")),
        ("hicache_io_backend", "--hicache-io-backend", changed("kernel")),
        ("hicache_mem_layout", "--hicache-mem-layout", changed("page_first")),
        ("hicache_storage_prefetch_policy", "--hicache-storage-prefetch-policy",
         changed("timeout")),
        ("hicache_storage_backend_extra_config", "--hicache-storage-backend-extra-config", SET),
        ("hicache_storage_prefetch_retry_poll_interval",
         "--hicache-storage-prefetch-retry-poll-interval", changed(8)),
        ("hicache_storage_prefetch_retry_max_attempts",
         "--hicache-storage-prefetch-retry-max-attempts", changed(8)),
    ),
    *_family(REFUSED, _LINKER,
        ("enable_unified_cache_external_linker", "--enable-unified-cache-external-linker", ON),
        ("unified_cache_external_linker_backend", "--unified-cache-external-linker-backend",
         changed("mooncake")),
        ("unified_cache_external_linker_config", "--unified-cache-external-linker-config", SET),
        ("enable_linker_mla_dedup", "--enable-linker-mla-dedup", ON),
    ),
    *_family(REFUSED, _HISPARSE,
        ("enable_hisparse", "--enable-hisparse", ON),
        ("hisparse_config", "--hisparse-config", SET),
    ),
    *_family(REFUSED, "kvguard does not guard LMCache (it stores and loads KV outside SGLang's "
             "pool paths)",
        ("enable_lmcache", "--enable-lmcache", ON),
        ("lmcache_config_file", "--lmcache-config-file", SET),
    ),
    *_family(REFUSED, "kvguard does not guard FlexKV (its KVManager offloads and reloads KV "
             "through CPU, SSD and remote tiers)",
        ("enable_flexkv", "--enable-flexkv", ON),
        ("flexkv_config_file", "--flexkv-config-file", SET),
    ),
    Row("radix_cache_backend", "--radix-cache-backend", SET, REFUSED,
        "kvguard does not guard a registered radix-cache backend (it replaces UnifiedRadixCache, "
        "the prefix cache the guard hooks)"),
    Row("enable_streaming_session", "--enable-streaming-session", ON, REFUSED,
        "kvguard does not guard streaming sessions (a session's KV stays in the tree across "
        "turns and is continued through virtual nodes)"),
    Row("enable_session_radix_cache", "--enable-session-radix-cache", ON, REFUSED,
        "kvguard does not guard session references on the radix cache (they change when its "
        "KV is evicted and freed; untested)"),
    Row("strip_thinking_cache", "--strip-thinking-cache", ON, REFUSED,
        "kvguard does not guard stripped thinking caches (output KV is freed as over-allocated "
        "on finish; untested)"),
    Row("enable_page_major_kv_layout", "--enable-page-major-kv-layout", ON, REFUSED,
        "kvguard does not guard the page-major KV layout (one buffer for every layer, not the "
        "per-layer buffers it reads)"),
    Row("enable_unified_memory", "--enable-unified-memory", ON, REFUSED,
        "kvguard does not guard unified memory (one byte buffer split dynamically between "
        "sub-pools)"),
    Row("prefill_only_disable_kv_cache", "--prefill-only-disable-kv-cache", ON, REFUSED,
        "kvguard has no KV pool to guard without a physical KV cache"),
    Row("kv_cache_dtype", "--kv-cache-dtype", none_of("auto", "bf16", "bfloat16", "fp8_e4m3"),
        REFUSED, "kvguard guards KV stored as auto, bf16 or fp8_e4m3 only (the others store "
        "block scales beside the rows or are untested)"),
    Row("prefill_kv_cache_dequant_dtype", "--prefill-kv-cache-dequant-dtype", changed("auto"),
        REFUSED, "kvguard does not guard FP4 (nvfp4) KV"),
    Row("qsa_indexer_dtype", "--qsa-indexer-dtype", changed("auto"), REFUSED,
        "kvguard does not guard the compressed QSA indexer cache stored beside KV"),
    *_family(REFUSED, _PD,
        ("disaggregation_transfer_backend", "--disaggregation-transfer-backend",
         changed("mooncake")),
        ("disaggregation_decode_enable_radix_cache", "--disaggregation-decode-enable-radix-cache",
         ON),
        ("disaggregation_decode_enable_offload_kvcache",
         "--disaggregation-decode-enable-offload-kvcache", ON),
        ("disaggregation_decode_extra_slots", "--disaggregation-decode-extra-slots", SET),
        ("disaggregation_decode_host_receive_threshold",
         "--disaggregation-decode-host-receive-threshold", changed(1.0)),
        ("disaggregation_decode_allocation_policy", "--disaggregation-decode-allocation-policy",
         changed("early")),
        ("enable_pd_role_switch", "--enable-pd-role-switch", ON),
        ("optimistic_prefill_attempts", "--optimistic-prefill-attempts", changed(0)),
    ),
    Row("disaggregation_ib_device", "--disaggregation-ib-device", ANY, NEUTRAL,
        "picks the NIC a PD transfer uses; what lands is checked against the sender's digests "
        "whichever device carried it", _PASSES),
    Row("num_reserved_decode_tokens", "--num-reserved-decode-tokens", ANY, NEUTRAL,
        "reserves pool tokens for decode in admission; " + _ORDER.split("; ", 1)[1], _PASSES),
    *_family(REFUSED, "kvguard does not guard PD multiplexing (split-prefill forwards on "
             "green-context streams beside decode)",
        ("enable_pdmux", "--enable-pdmux", ON),
        ("pdmux_config_path", "--pdmux-config-path", SET),
    ),
    *_family(REFUSED, _PP,
        ("pp_size", "--pp-size", ABOVE_1),
        ("pp_max_micro_batch_size", "--pp-max-micro-batch-size", SET),
        ("pp_async_batch_depth", "--pp-async-batch-depth", changed(0)),
        ("enable_dynamic_chunking", "--enable-dynamic-chunking", ON),
    ),
    Row("dp_size", "--dp-size", ABOVE_1, REFUSED,
        "kvguard is not tested with data-parallel replicas (each replica's scheduler would run "
        "its own guard)"),
    *_family(REFUSED, "kvguard does not guard DP attention (DP groups inside the TP group run "
             "their own batches, idle ones included)",
        ("attn_dp_size", "--attn-dp-size", ABOVE_1),
        ("enable_dp_attention", "--enable-dp-attention", ON),
    ),
    *_family(REFUSED, "kvguard does not guard context parallelism (each rank stores a share of "
             "every sequence's KV)",
        ("dcp_size", "--dcp-size", ABOVE_1),
        ("attn_cp_size", "--attn-cp-size", ABOVE_1),
        ("enable_prefill_cp", "--enable-prefill-cp", ON),
        ("cp_strategy", "--cp-strategy", SET),
        ("enable_kv_cache_sharding", "--enable-kv-cache-sharding", ON),
        ("enable_dsa_cache_layer_split", "--enable-dsa-cache-layer-split", ON),
    ),
    Row("enable_two_batch_overlap", "--enable-two-batch-overlap", ON, REFUSED,
        "kvguard does not guard two-batch overlap (each batch runs as two micro-batch forwards)"),
    *_family(REFUSED, _SPEC,
        ("speculative_algorithm", "--speculative-algorithm", SET),
        ("speculative_draft_model_path", "--speculative-draft-model-path", SET),
        ("speculative_num_steps", "--speculative-num-steps", SET),
        ("speculative_eagle_topk", "--speculative-eagle-topk", SET),
        ("speculative_num_draft_tokens", "--speculative-num-draft-tokens", SET),
        ("speculative_dflash_block_size", "--speculative-dflash-block-size", SET),
        ("speculative_dspark_block_size", "--speculative-dspark-block-size", SET),
        ("speculative_draft_kv_cache_dtype", "--speculative-draft-kv-cache-dtype", SET),
        ("speculative_draft_window_size", "--speculative-draft-window-size", SET),
        ("speculative_draft_sink_size", "--speculative-draft-sink-size", SET),
        ("speculative_attention_mode", "--speculative-attention-mode", changed("prefill")),
        ("speculative_draft_attention_backend", "--speculative-draft-attention-backend", SET),
        ("enable_multi_layer_eagle", "--enable-multi-layer-eagle", ON),
        ("speculative_adaptive", "--speculative-adaptive", ON),
        ("decoupled_spec_role", "--decoupled-spec-role", changed("null")),
    ),
    *_family(REFUSED, "kvguard does not guard LoRA (KV depends on the adapter, which the guard's "
             "prefix chains do not bind)",
        ("enable_lora", "--enable-lora", ON),
        ("lora_paths", "--lora-paths", SET),
    ),
    Row("enable_memory_saver", "--enable-memory-saver", ON, REFUSED,
        "kvguard does not guard the memory saver (release and resume unmap and re-map the KV "
        "pool outside the forward)"),
    *_family(REFUSED, _CANARY,
        ("kv_canary", "--kv-canary", changed("none")),
        ("kv_canary_real_data", "--kv-canary-real-data", changed("none")),
        ("kv_canary_sweep_interval", "--kv-canary-sweep-interval", changed(0)),
    ),
    Row("dllm_algorithm", "--dllm-algorithm", SET, REFUSED,
        "kvguard does not guard diffusion LLM decoding (DLLM_EXTEND forwards rewrite a block's "
        "KV in place)"),
    Row("is_embedding", "--is-embedding", ON, REFUSED,
        "kvguard does not guard embedding models (their forwards bypass "
        "TpModelWorker.forward_batch_generation, where the guard takes the batch)"),
]
# fmt: on


def refusals(options: Mapping[str, Any] | object, off: str = "--kvguard-mode off") -> list[str]:
    """One line per refused option in effect, naming it: ``options`` is a ServerArgs (its raw
    input) or a mapping of ServerArgs field -> value (fields left out are not in effect)."""
    missing = object()
    if isinstance(options, Mapping):
        get = options.get
    else:

        def get(field: str, default: object) -> Any:
            return getattr(options, field, default)

    out = []
    for row in OPTIONS:
        value = get(row.field, missing)
        if row.status != REFUSED or value is missing or not row.when.holds(value):
            continue
        scalar = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        option = f"{row.flag} {value}" if scalar else row.flag
        out.append(f"{option}: {row.why}; serve without it or with {off}")
    return out


# -- Scheduler.__init__ (BEFORE) -------------------------------------------------------------------
def refuse_unguarded_options(scheduler: object, server_args: object, *args: Any, **kwargs: Any):
    """``python -m sglang.launch_server`` (kvguard-serve refuses these before SGLang starts):
    stop the scheduler before it builds anything, in one line."""
    from kvguard.config import GuardConfig

    if not GuardConfig.from_env().enabled:
        return None
    lines = refusals(server_args, off="KVGUARD_MODE=off")
    if lines:
        import structlog

        structlog.get_logger("kvguard").error("kvguard_unsupported_option", error=lines[0])
        # SystemExit: SGLang's scheduler does not catch it (no traceback); the process exits 1
        raise SystemExit(f"kvguard: error: {lines[0]}")
    return None


# -- http_server.launch_server (BEFORE) ------------------------------------------------------------
def refuse_before_launch(server_args: object, *args: Any, **kwargs: Any):
    """``python -m sglang.launch_server``, in the HTTP process before any scheduler starts: the
    same line and exit status as kvguard-serve (2), and nothing else printed."""
    from kvguard.config import GuardConfig

    if not GuardConfig.from_env().enabled:
        return None
    lines = refusals(server_args, off="KVGUARD_MODE=off")
    if lines:
        print(f"kvguard: error: {lines[0]}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return None


# -- docs/options.md ---------------------------------------------------------------------------------
BEGIN, END = "<!-- options table: begin -->", "<!-- options table: end -->"


def markdown() -> str:
    """The table for users, one line per row, grouped by status."""
    lines = ["| option | in effect | status | why | test |", "| --- | --- | --- | --- | --- |"]
    for status in (REFUSED, GUARDED, NEUTRAL):
        for row in _rows(status):
            test = f"`{row.test}`" if row.test else ""
            when = row.when.text.replace("|", "\\|")
            lines.append(f"| `{row.flag}` | {when} | {status} | {row.why} | {test} |")
    return "\n".join(lines) + "\n"


def _rows(status: str) -> Iterator[Row]:
    return (row for row in OPTIONS if row.status == status)


def write_doc(path: Path) -> None:
    """Replace the generated table between the markers in ``path``."""
    text = path.read_text()
    head, _, rest = text.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END)
    path.write_text(f"{head}{BEGIN}\n{markdown()}{END}{tail}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"] and len(sys.argv) == 3:
        write_doc(Path(sys.argv[2]))
    else:
        print(markdown(), end="")

"""``kvguard-serve``: SGLang's HTTP server (native ``/generate``, OpenAI ``/v1/...``, ``/metrics``)
with the guard loaded into every scheduler process.

Every SGLang server argument passes through unchanged; kvguard adds its own flags (``--kvguard-*``,
``--no-fp8-kv``, ``--log-format``) and defaults that the user did not set: the embedded default
model, ``--enable-metrics``, and on a machine without a GPU ``--device cpu --attention-backend
torch_native``, CUDA graphs off, no warm-up request, a KV pool of at most
:data:`CPU_MAX_TOTAL_TOKENS` tokens and, for more ranks than NUMA nodes, a core group per rank
(:data:`THREADS_BIND`). Bad input (model path, port, options, guard settings) and options the
guard cannot check (``kvguard.patches.engine_options``) are reported in one line before SGLang
starts.

The guard itself is configured through the environment (``KVGUARD_*``, see ``kvguard.config``):
the launcher validates it here and exports it, and SGLang's spawned scheduler processes inherit it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

from kvguard import logconfig
from kvguard.config import ConfigError, GuardConfig, Mode, OnViolation
from kvguard.patches.engine_options import refusals
from kvguard.patches.hook_check import HooksNotApplied
from kvguard.serve.preflight import (
    LaunchError,
    check_listen_address,
    check_model_path,
    supplied_model_fields,
)

PROG = "kvguard-serve"
# On CPU SGLang sizes the KV pool from free memory (about 70% of it) and knows nothing of the
# guard's state, which grows with the pool: with small KV rows (an MLA model's FP8 latent, 80 B
# per layer) that is tens of millions of slots, and the two together can exceed the machine.
# Unless the user sizes the pool (--max-total-tokens, --mem-fraction-static), it holds this many.
CPU_MAX_TOTAL_TOKENS = 262144
EMBEDDED_MODELS = ("default", "kimi", "glm")
# SGLang's CPU engine binds each rank's OpenMP threads to one '|'-separated group of cores; unset,
# it wants one NUMA node per rank and asserts there are enough.
THREADS_BIND = "SGLANG_CPU_OMP_THREADS_BIND"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line, not with SGLang's 500-flag usage."""

    def error(self, message):
        raise LaunchError(message)


def kvguard_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    g = p.add_argument_group("kvguard")
    g.add_argument(
        "--kvguard-mode",
        choices=[m.value for m in Mode],
        help="guard mode (env KVGUARD_MODE; default verified: every KV byte attention reads is "
        "checksummed as it is read and judged before the step's tokens leave)",
    )
    g.add_argument(
        "--kvguard-sweep-tokens-per-step",
        type=int,
        metavar="N",
        help="sampled mode: KV tokens of the batch's read set re-hashed per step, plus a quarter "
        "as many resting ones (env KVGUARD_SWEEP_TOKENS_PER_STEP; default 512)",
    )
    g.add_argument(
        "--kvguard-tenant-isolation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bind a request's tenant into its prefix chain (env KVGUARD_TENANT_ISOLATION)",
    )
    g.add_argument(
        "--kvguard-quarantine-cap",
        type=float,
        metavar="FRACTION",
        help="pages quarantined at once, as a fraction of the pool, at which the guard fails "
        "closed: /health 503, new requests refused (env KVGUARD_QUARANTINE_CAP; default 0.01)",
    )
    g.add_argument(
        "--kvguard-on-violation",
        choices=[v.value for v in OnViolation],
        help="what becomes of a request whose KV the guard found bad (env KVGUARD_ON_VIOLATION; "
        "default recompute: re-prefilled from its verified tokens and decoded on, where every "
        "read is verified before tokens leave; otherwise, and past the budget or breaker, abort)",
    )
    g.add_argument(
        "--kvguard-recompute-budget",
        type=int,
        metavar="N",
        help="recomputes per request before it is aborted (env KVGUARD_RECOMPUTE_BUDGET; default 2)",
    )
    g.add_argument(
        "--kvguard-recompute-breaker-per-minute",
        type=int,
        metavar="N",
        help="recomputes in the trailing minute past which violations abort and an alert is "
        "raised; 0: no breaker (env KVGUARD_RECOMPUTE_BREAKER_PER_MINUTE; default 60)",
    )
    g.add_argument(
        "--embedded-model",
        choices=EMBEDDED_MODELS,
        help="without --model-path, which embedded model to serve: default (a tiny Llama), "
        "kimi (a tiny Kimi K2 architecture model: MLA attention, MoE; DeepseekV3ForCausalLM) or "
        "glm (a tiny GLM-5 architecture model: MLA + DSA sparse attention, MoE; "
        "GlmMoeDsaForCausalLM)",
    )
    g.add_argument(
        "--no-fp8-kv",
        action="store_true",
        help="keep SGLang's KV cache dtype instead of kvguard's FP8 (fp8_e4m3) default",
    )
    g.add_argument(
        "--log-format",
        choices=logconfig.FORMATS,
        default=os.environ.get(logconfig.ENV_FORMAT) or "console",
        help="kvguard's structured log lines: console or json (env KVGUARD_LOG_FORMAT)",
    )
    return p


def fp8_kv_unsupported_by(model_path: str) -> str | None:
    """Why this model's KV cannot be stored FP8 (None: it can, or its config is not local):
    a DSA model whose latent SGLang's FP8 row cannot hold."""
    path = Path(model_path) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or "index_topk" not in cfg:  # DSA configs carry the indexer's
        return None
    from kvguard.patches.dsa_cpu import fp8_rows_unsupported

    return fp8_rows_unsupported(cfg)


def fp8_kv_supported() -> bool:
    """FP8 KV is kvguard's default only where kvguard's own FP8 KV support is installed."""
    return find_spec("kvguard.patches.cpu_fp8_kv") is not None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        server_args = prepare(argv)
    except LaunchError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if server_args is None:  # --help
        return 0
    return serve(server_args)


def prepare(argv: list[str]):
    """Validate, set the environment, return SGLang's ``ServerArgs`` (None: help was shown)."""
    kv, rest = kvguard_parser().parse_known_args(argv)
    if {"-h", "--help"} & set(rest):
        _set_platform_env(_wanted_device(rest))
        _print_help()
        return None
    try:
        config = GuardConfig.from_env(
            mode=kv.kvguard_mode,
            sweep_tokens_per_step=kv.kvguard_sweep_tokens_per_step,
            tenant_isolation=kv.kvguard_tenant_isolation,
            quarantine_cap=kv.kvguard_quarantine_cap,
            on_violation=kv.kvguard_on_violation,
            recompute_budget=kv.kvguard_recompute_budget,
            recompute_breaker_per_minute=kv.kvguard_recompute_breaker_per_minute,
        )
    except ConfigError as e:
        raise LaunchError(str(e)) from None

    _precheck(rest)  # the common mistakes answer in a second, before SGLang (and torch) import
    device = _wanted_device(rest)
    _set_platform_env(device)  # before SGLang is imported: it reads these at import time
    given, defaults = _parse_sglang_args(rest)
    if config.enabled:  # an option the guard cannot check: one line, before SGLang starts
        refused = refusals({**defaults, **given})
        if refused:
            raise LaunchError(refused[0])

    extra: list[str] = []
    model_path = given.get("model_path")
    if model_path is None:
        model_path = str(_embedded_model(kv.embedded_model or "default"))
        extra += ["--model-path", model_path]
    elif kv.embedded_model is not None:
        raise LaunchError("--embedded-model and --model-path: give one of them")
    check_model_path(model_path, given.get("load_format", "auto"))
    check_listen_address(given.get("host", defaults["host"]), given.get("port", defaults["port"]))
    # A config saved by transformers 5 lacks fields its model code fixes (DeepSeek MoE routing, the
    # GLM-5 indexer's rope layout): SGLang gets them as model overrides (the user's own win)
    supplied = supplied_model_fields(model_path)
    if supplied:
        try:
            user = json.loads(given.get("json_model_override_args") or "{}")
        except json.JSONDecodeError as e:
            raise LaunchError(f"--json-model-override-args: not JSON ({e})") from None
        supplied = {k: v for k, v in supplied.items() if k not in user}
        extra += ["--json-model-override-args", json.dumps({**supplied, **user})]

    if device == "cpu":
        extra += _unset(given, "device", ["--device", "cpu"])
        extra += _unset(given, "attention_backend", ["--attention-backend", "torch_native"])
        if (
            not {
                "disable_cuda_graph",
                "cuda_graph_config",
                "cuda_graph_backend_decode",
                "cuda_graph_backend_prefill",
            }
            & given.keys()
        ):
            extra += [
                "--cuda-graph-backend-decode",
                "disabled",
                "--cuda-graph-backend-prefill",
                "disabled",
            ]
        extra += _unset(given, "skip_server_warmup", ["--skip-server-warmup"])
        if not {"max_total_tokens", "mem_fraction_static"} & given.keys():
            extra += ["--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
        if given.get("disaggregation_mode") == "decode":  # SGLang's inferred host_pool needs CUDA
            extra += _unset(
                given,
                "disaggregation_decode_retraction_backup",
                ["--disaggregation-decode-retraction-backup", "cpu_tensor"],
            )
        ranks = 1
        for dest in ("tp_size", "pp_size", "dp_size"):
            ranks *= int(given.get(dest, defaults[dest]) or 1)
        if not os.environ.get(THREADS_BIND) and ranks > _numa_nodes():
            os.environ[THREADS_BIND] = cpu_threads_bind(sorted(os.sched_getaffinity(0)), ranks)
    extra += _unset(given, "enable_metrics", ["--enable-metrics"])
    # ---- FP8 KV default: the serving stack stores KV in fp8_e4m3 unless the user chose a dtype
    # ---- or passed --no-fp8-kv. Only where kvguard's FP8 KV support is installed.
    # ---- A model whose KV SGLang cannot store FP8 keeps its dtype (said in the log); asked for
    # ---- explicitly, FP8 is refused at start by the model's own check (patches/dsa_cpu.py).
    fp8_skipped = None
    if given.get("kv_cache_dtype") == "fp8_e4m3" and (why := fp8_kv_unsupported_by(model_path)):
        raise LaunchError(f"--kv-cache-dtype fp8_e4m3 cannot serve this model: {why}")
    if not kv.no_fp8_kv and fp8_kv_supported():
        fp8_skipped = None if "kv_cache_dtype" in given else fp8_kv_unsupported_by(model_path)
        if fp8_skipped is None:
            extra += _unset(given, "kv_cache_dtype", ["--kv-cache-dtype", "fp8_e4m3"])

    log_level = given.get("log_level") or defaults["log_level"] or "info"
    os.environ.update(config.to_env())  # spawned schedulers read the guard config from here
    logconfig.export(kv.log_format, log_level)
    logconfig.configure(kv.log_format, log_level)
    if fp8_skipped:
        _log().warning("kv_cache_fp8_default_skipped", reason=fp8_skipped)
    if supplied:
        _log().info(
            "model_config_fields_supplied",
            fields=supplied,
            why="config.json lacks them; transformers' model code for this architecture fixes them",
        )

    from sglang.srt.server_args import prepare_server_args

    try:
        server_args = prepare_server_args(rest + extra)
    except SystemExit as e:  # argparse inside SGLang; the same argv already parsed cleanly here
        raise LaunchError(f"SGLang rejected the arguments (exit {e.code})") from None
    except Exception as e:  # ServerArgs validation (ValueError, AssertionError, ...)
        raise LaunchError(_first_line(e)) from None
    _log().info(
        "kvguard_serve_starting",
        model_path=model_path,
        device=device,
        guard=config.mode.value,
        kv_cache_dtype=getattr(server_args, "kv_cache_dtype", None),
    )
    return server_args


def serve(server_args) -> int:
    """Run SGLang's HTTP server in this process until it is stopped (SIGINT / SIGTERM)."""
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.utils import kill_process_tree

    try:  # as `python -m sglang.launch_server` does: every installed plugin, kvguard too
        load_plugins()
    except HooksNotApplied as e:  # a hook of kvguard's tables is not in place: nothing starts
        print(f"{PROG}: error: {e.line}", file=sys.stderr)
        return 2
    logging.getLogger("sglang.srt.entrypoints.http_server").addFilter(_freeze_gc_race)
    rc = 0
    try:
        run_server(server_args)
    except KeyboardInterrupt:
        pass
    except Exception as e:  # e.g. a scheduler died while loading: its own traceback is above
        print(f"{PROG}: error: SGLang stopped: {_first_line(e)}", file=sys.stderr)
        rc = 1
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    _log().info("kvguard_serve_stopped", exit_code=rc)
    return rc


# -- helpers ---------------------------------------------------------------------------------------
def _freeze_gc_race(record: logging.LogRecord) -> bool:
    """With --skip-server-warmup, SGLang 0.5.23 posts /freeze_gc before uvicorn listens and logs
    the refused connection with three chained tracebacks. Say it in one line instead."""
    if record.getMessage() == "post-warmup freeze_gc failed" and record.exc_info:
        record.msg, record.args, record.exc_info, record.exc_text = (
            "post-warmup freeze_gc skipped: the HTTP server was not listening yet",
            (),
            None,
            None,
        )
    return True


def _precheck(argv: list[str]) -> None:
    """Model path and listen address as given literally on the command line (SGLang's defaults
    otherwise); :func:`prepare` checks them again once SGLang parsed everything."""
    p = _Parser(prog=PROG, add_help=False, allow_abbrev=False)
    p.add_argument("--model-path", "--model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    args, _ = p.parse_known_args(argv)
    if args.model_path is not None:
        check_model_path(args.model_path, args.load_format)
    check_listen_address(args.host, args.port)


def _wanted_device(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _set_platform_env(device: str) -> None:
    if device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's supported CPU route
    os.environ.setdefault("SGLANG_CACHE_DIR", str(_cache_dir() / "sglang"))
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # Set before anything imports prometheus_client (it picks its value class at import), so
        # this process's series and the schedulers' kvguard_* series share SGLang's /metrics.
        path = tempfile.mkdtemp(prefix="kvguard-metrics-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def _cache_dir() -> Path:
    root = Path(__file__).resolve().parents[1]  # the checkout, for an editable install
    if (root / "pyproject.toml").is_file() and os.access(root, os.W_OK):
        return root / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvguard"


def _sglang_parser(parents: tuple = ()) -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = _Parser(prog=PROG, parents=list(parents), description=__doc__.split("\n\n")[0])
    ServerArgs.add_cli_args(parser)
    return parser


def _parse_sglang_args(argv: list[str]) -> tuple[dict, dict]:
    """Parse SGLang's arguments as SGLang would. Returns (the options the user gave, defaults)."""
    parser = _sglang_parser()
    if "--config" in argv:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        try:
            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        except Exception as e:
            raise LaunchError(f"--config: {e}") from None
    defaults = {a.dest: a.default for a in parser._actions}
    for a in parser._actions:  # what is left in the namespace is exactly what was given
        a.default, a.required = argparse.SUPPRESS, False
    return vars(parser.parse_args(argv)), defaults


def cpu_threads_bind(cores: list[int], ranks: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on ``cores``: contiguous groups as even
    as the cores allow (a core each, shared in turn, when there are fewer cores than ranks)."""
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    size, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for r in range(ranks):
        end = start + size + (r < extra)
        groups.append(",".join(map(str, cores[start:end])))
        start = end
    return "|".join(groups)


def _numa_nodes() -> int:
    """NUMA nodes as SGLang's CPU engine counts them (one rank each when the bind is unset)."""
    from sglang.srt.utils.common import get_cpu_ids_by_node

    return len(get_cpu_ids_by_node())


def _unset(given: dict, dest: str, args: list[str]) -> list[str]:
    return [] if dest in given else args


def _embedded_model(name: str) -> Path:
    try:
        if name == "kimi":
            from kvguard.serve.kimi_model import ensure_kimi_model as ensure
        elif name == "glm":
            from kvguard.serve.glm_model import ensure_glm_model as ensure
        else:
            from kvguard.serve.default_model import ensure_default_model as ensure
    except ImportError:
        raise LaunchError(
            f"no --model-path given and kvguard's {name} model is not installed"
        ) from None
    try:
        return ensure()
    except FileNotFoundError as e:
        raise LaunchError(f"no --model-path given and {e}") from None


def _print_help() -> None:
    parser = _sglang_parser(parents=(kvguard_parser(),))
    for a in parser._actions:
        if a.dest == "model_path":
            a.required, a.help = False, "local model directory (default: kvguard's embedded model)"
    parser.print_help()


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _log():
    import structlog

    return structlog.get_logger("kvguard.serve")


if __name__ == "__main__":
    sys.exit(main())

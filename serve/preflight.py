"""Checks ``kvguard-serve`` makes before it starts SGLang, so that bad input ends in one line
(``kvguard-serve: error: ...``, exit 2), not in a traceback from a child process minutes later."""

from __future__ import annotations

import errno
import json
import re
import socket
from pathlib import Path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class LaunchError(Exception):
    """Bad input found before launch; the message is one line meant for the user."""


def check_model_path(path: str, load_format: str = "auto") -> None:
    """A local Hugging Face model directory (config.json naming a model, and weights unless
    ``--load-format dummy``), a ``.gguf`` file, or a repo id already in the local HF cache."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix == ".gguf":
            return
        raise LaunchError(f"--model-path {path}: is a file, not a model directory")
    if p.is_dir():
        config = p / "config.json"
        if not config.is_file():
            raise LaunchError(
                f"--model-path {path}: no config.json (not a Hugging Face model directory)"
            )
        try:
            fields = json.loads(config.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LaunchError(f"--model-path {path}: config.json is unreadable ({e})") from None
        if not isinstance(fields, dict) or not ({"model_type", "architectures"} & fields.keys()):
            raise LaunchError(
                f"--model-path {path}: config.json names no model_type or architectures"
            )
        if load_format != "dummy" and not any(next(p.glob(g), None) for g in WEIGHT_PATTERNS):
            raise LaunchError(f"--model-path {path}: no weight files (*.safetensors, *.bin, ...)")
        deepseek_moe_overrides(path)  # refuses what cannot be supplied
        return
    if _REPO_ID.match(path) and _in_hf_cache(path):
        return
    raise LaunchError(
        f"--model-path {path}: no such model directory"
        + (" (nor in the local Hugging Face cache)" if _REPO_ID.match(path) else "")
    )


# What SGLang's DeepSeek model code (DeepSeek-V2/V3, Kimi K2, GLM-5) reads from a MoE config
# without a default. Released DeepSeek-V3 / Kimi K2 / GLM-5 configs carry them; a config saved by
# transformers 5's DeepseekV3Config or GlmMoeDsaConfig does not, and SGLang then stops in the
# scheduler with an AttributeError.
DEEPSEEK_ARCHS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",
)
DEEPSEEK_MOE_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# transformers' own model code for these fixes what those fields say: sigmoid router scores with
# a correction bias and group-limited top-k (noaux_tc), every layer from first_k_dense_replace
# on MoE (or as mlp_layer_types lists). A config without them means exactly DEEPSEEK_MOE_FIELDS.
TRANSFORMERS_DEFINED_MOE = ("DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")


def deepseek_moe_overrides(path: str) -> dict:
    """The MoE fields SGLang's DeepSeek code needs and ``path``'s config.json lacks, to be passed
    to SGLang as model overrides (``--json-model-override-args``): {} where nothing is missing.
    Missing from an architecture whose transformers model fixes them: their values there.
    Missing elsewhere, or MoE layers SGLang would place differently from the config's
    ``mlp_layer_types``: :class:`LaunchError`."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        return {}
    fields = json.loads(config.read_text())
    archs = set(fields.get("architectures") or [])
    if not archs & set(DEEPSEEK_ARCHS) or fields.get("n_routed_experts") is None:
        return {}  # not SGLang's DeepSeek MoE code, or dense: it reads none of them
    layers = int(fields.get("num_hidden_layers") or 0)
    first_moe = int(fields.get("first_k_dense_replace") or 0)
    if first_moe >= layers:
        return {}  # every layer dense
    missing = [k for k in DEEPSEEK_MOE_FIELDS if k not in fields]
    freq = int(fields.get("moe_layer_freq") or 1)
    types = fields.get("mlp_layer_types")
    sglang_types = [
        "sparse" if i >= first_moe and i % freq == 0 else "dense" for i in range(layers)
    ]
    if types is not None and list(types) != sglang_types:
        raise LaunchError(
            f"--model-path {path}: config.json's mlp_layer_types {types} places MoE layers where "
            f"SGLang's DeepSeek MoE code does not (it follows first_k_dense_replace {first_moe} "
            f"and moe_layer_freq {freq}: {sglang_types})"
        )
    if not missing:
        return {}
    if archs & set(TRANSFORMERS_DEFINED_MOE):
        return {k: DEEPSEEK_MOE_FIELDS[k] for k in missing}
    example = ", ".join(f'"{k}": {json.dumps(DEEPSEEK_MOE_FIELDS[k])}' for k in missing)
    raise LaunchError(
        f"--model-path {path}: config.json lacks {', '.join(missing)}, which SGLang's DeepSeek "
        f"MoE model reads (DeepSeek-V3 / Kimi K2 / GLM-5 configs have e.g. {example})"
    )


# transformers' GlmMoeDsa indexer always applies interleaved rope and its config has no key for it;
# SGLang reads indexer_rope_interleave and defaults to NeoX (DeepSeek-V3.2's layout, which
# transformers' DeepseekV32 also uses): a GlmMoeDsa config without the key means True.
INDEXER_ROPE_INTERLEAVED = ("GlmMoeDsaForCausalLM",)


def supplied_model_fields(path: str) -> dict:
    """Every config field ``path``'s config.json lacks and its architecture's transformers model
    fixes, with that value: SGLang gets them as model overrides (see
    :func:`deepseek_moe_overrides`, which also refuses what cannot be supplied)."""
    fields = deepseek_moe_overrides(path)
    config = Path(path).expanduser() / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        archs = set(cfg.get("architectures") or [])
        if archs & set(INDEXER_ROPE_INTERLEAVED) and "indexer_rope_interleave" not in cfg:
            fields["indexer_rope_interleave"] = True
    return fields


def check_listen_address(host: str, port: int) -> None:
    """The HTTP server can bind ``host:port`` (checked the way uvicorn binds: SO_REUSEADDR)."""
    if not 0 < port < 65536:
        raise LaunchError(f"--port {port}: not a TCP port (1-65535)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise LaunchError(f"--host {host}: cannot resolve ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise LaunchError(f"--port {port}: already in use on {host}") from None
            if e.errno == errno.EADDRNOTAVAIL:
                raise LaunchError(f"--host {host}: not an address of this machine") from None
            raise LaunchError(f"cannot listen on {host}:{port} ({e.strerror})") from None


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)

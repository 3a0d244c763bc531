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
        check_deepseek_moe_fields(path, fields)
        return
    if _REPO_ID.match(path) and _in_hf_cache(path):
        return
    raise LaunchError(
        f"--model-path {path}: no such model directory"
        + (" (nor in the local Hugging Face cache)" if _REPO_ID.match(path) else "")
    )


# What SGLang's DeepSeek model code (DeepSeek-V2/V3, Kimi K2) reads from a MoE config without a
# default. Released DeepSeek-V3 / Kimi K2 configs carry them; a config saved by transformers 5's
# DeepseekV3Config does not, and SGLang then stops in the scheduler with an AttributeError.
DEEPSEEK_ARCHS = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    "GlmMoeDsaForCausalLM",  # GLM-5: the same MoE code (transformers 5's config saves none either)
)
DEEPSEEK_MOE_FIELDS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def check_deepseek_moe_fields(path: str, fields: dict) -> None:
    if not set(fields.get("architectures") or []) & set(DEEPSEEK_ARCHS):
        return
    if fields.get("n_routed_experts") is None:
        return  # dense: SGLang reads none of them
    if int(fields.get("first_k_dense_replace") or 0) >= int(fields.get("num_hidden_layers") or 0):
        return  # every layer dense: no MoE layer reads them
    missing = [k for k in DEEPSEEK_MOE_FIELDS if k not in fields]
    if missing:
        example = ", ".join(f'"{k}": {json.dumps(DEEPSEEK_MOE_FIELDS[k])}' for k in missing)
        raise LaunchError(
            f"--model-path {path}: config.json lacks {', '.join(missing)}, which SGLang's "
            f"DeepSeek MoE model reads (DeepSeek-V3 / Kimi K2 / GLM-5 configs have e.g. {example})"
        )


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

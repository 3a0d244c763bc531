"""Probe-only shims for docs/glm.md ("MTP (speculative decoding) on CPU"); not kvguard code.

Put this folder on PYTHONPATH and name the shims in MTP_PROBE_SHIMS (comma-separated): every
Python process of the server (SGLang spawns its scheduler) then applies them. Each gets past one
stop of SGLang 0.5.23's NEXTN/EAGLE path on CPU, in the order docs/glm.md lists them:

    sync             torch.cuda.synchronize a no-op without CUDA (deepseek_v2.py:3448)
    draft_backend    torch_native in the draft backend maps (speculative/draft_utils.py:64)
    tree             the XPU path's Triton tree kernels under Triton's interpreter for the
                     sgl_kernel CPU ops (kernels/ops/speculative/spec_tree.py:412, :510)
    verify_requests  TARGET_VERIFY batches in kvguard's torch DSA indexer and sparse MLA
                     (patches/dsa_cpu.py:242); topk 1 only (a chain: causal is the tree mask)
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

SHIMS = set(filter(None, os.environ.get("MTP_PROBE_SHIMS", "").split(",")))
_AFTER_IMPORT: dict[str, Callable[[Any], None]] = {}


def after_import(module: str) -> Callable[[Callable[[Any], None]], Callable[[Any], None]]:
    def register(patch: Callable[[Any], None]) -> Callable[[Any], None]:
        _AFTER_IMPORT[module] = patch
        return patch

    return register


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs the registered patch right after its module is executed (before anyone uses it)."""

    def find_spec(self, name, path, target=None):
        if name not in _AFTER_IMPORT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _AFTER_IMPORT[name](module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


if "sync" in SHIMS:
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None

if "draft_backend" in SHIMS:

    @after_import("sglang.srt.speculative.draft_utils")
    def _torch_native_draft(m):
        create = m.DraftBackendFactory._create_backend

        def _create_backend(self, backend_name, backend_map, error_template, stamps_children=False):
            from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

            def torch_native():
                return "torch_native", TorchNativeAttnBackend(self.draft_model_runner)

            backend_map = {**backend_map, "torch_native": torch_native}
            return create(self, backend_name, backend_map, error_template, stamps_children)

        m.DraftBackendFactory._create_backend = _create_backend


if "tree" in SHIMS:

    @after_import("sglang.kernels.ops.speculative.spec_tree")
    def _interpreted_tree_kernels(m):
        from triton.runtime.interpreter import InterpretedFunction

        for name in ("sgl_build_tree_kernel_efficient_triton", "verify_tree_greedy_kernel_triton"):
            setattr(m, name, InterpretedFunction(getattr(m, name).fn))
        m.sgl_build_tree_kernel_efficient_cpu = m.sgl_build_tree_kernel_triton

        def verify_tree_greedy_cpu(**kw):  # the CPU op's argument names are retrive_*
            return m.verify_tree_greedy_triton(
                **{k.replace("retrive_", "retrieve_"): v for k, v in kw.items()}
            )

        m.sgl_verify_tree_greedy_cpu = verify_tree_greedy_cpu


if "verify_requests" in SHIMS:

    @after_import("kvguard.patches.dsa_cpu")
    def _verify_requests(m):
        requests = m._requests

        def _requests(fb):
            if not fb.forward_mode.is_target_verify():
                yield from requests(fb)
                return
            # n draft tokens per request past seq_lens_cpu (any position past a token's own is
            # masked causally by the indexer and never selected)
            n = fb.spec_info.draft_token_num
            rows, seq_lens = fb.req_pool_indices.tolist(), fb.seq_lens_cpu.tolist()
            for i, (row, seq_len) in enumerate(zip(rows, seq_lens)):
                yield row, i * n, n, int(seq_len) + n

        m._requests = _requests


if _AFTER_IMPORT:
    sys.meta_path.insert(0, _PatchAfterImport())

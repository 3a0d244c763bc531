"""Which implementation runs the guard's kernels: one interface, three backends.

* ``torch``: ``guard_ref``, the executable specification; runs anywhere.
* ``cpu``: the compiled C kernels (``guard_cpu``), for CPU pools.
* ``triton``: the Triton kernels (``guard_triton``), for CUDA pools.

``select(device)`` picks the fastest one available for the pool's device; ``KVGUARD_KERNELS``
(``auto``, ``torch``, ``cpu``, ``triton``) forces one. Every backend leaves the same state and
verdicts as the reference (``tests/test_guard_kernels.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from . import guard_ref
from .guard_ref import CheckParams, StepCheck, StepInputs
from .guard_state import PageArrays, RowArrays
from .kv_checksum_ref import KvBuffer


class GuardKernels(Protocol):
    name: str

    def bind(self, P: PageArrays, R: RowArrays, buffers: Sequence[KvBuffer]) -> None:
        """The pool this backend serves (compiled backends keep its addresses)."""

    def workspace_bytes(self) -> int:
        """Memory the backend keeps besides the ledger and the records."""

    def check_step(
        self,
        P: PageArrays,
        R: RowArrays,
        x: StepInputs,
        cp: CheckParams,
        buffers: Sequence[KvBuffer],
    ) -> StepCheck: ...

    def apply_step(
        self, P: PageArrays, R: RowArrays, x: StepInputs, c: StepCheck, page_size: int
    ) -> None: ...

    def seal_step(
        self,
        P: PageArrays,
        x: StepInputs,
        c: StepCheck,
        buffers: Sequence[KvBuffer],
        page_size: int,
        checksums: bool,
        written: torch.Tensor | None = None,
    ) -> torch.Tensor | None: ...

    def alloc_pages(
        self, P: PageArrays, slots: torch.Tensor, page_size: int, step: int
    ) -> None: ...

    def release_pages(
        self, P: PageArrays, pages: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class TorchKernels:
    """The reference, as a backend."""

    name = "torch"

    def bind(self, P: PageArrays, R: RowArrays, buffers: Sequence[KvBuffer]) -> None:
        pass

    def workspace_bytes(self) -> int:
        return 0  # per-step temporaries only

    check_step = staticmethod(guard_ref.check_step)
    apply_step = staticmethod(guard_ref.apply_step)
    seal_step = staticmethod(guard_ref.seal_step)
    alloc_pages = staticmethod(guard_ref.alloc_pages)
    release_pages = staticmethod(guard_ref.release_pages)


# The per-request transitions: a backend may run them itself (the compiled CPU one does); any
# other runs the reference (they are not on the per-step path).
PER_REQUEST = ("share_pages", "attribute_free", "rebind_row", "reset_rows")


def per_request(kernels: object, name: str) -> Callable[..., Any]:
    assert name in PER_REQUEST
    fn = getattr(kernels, name, None)
    return fn if fn is not None else getattr(guard_ref, name)  # type: ignore[no-any-return]


class KernelsUnavailableError(RuntimeError):
    pass


def select(device: torch.device | str, prefer: str | None = None) -> GuardKernels:
    """The kernels for a pool on ``device``: ``prefer`` (or ``KVGUARD_KERNELS``) if given and
    available, else the compiled backend for the device, else the reference."""
    want = (prefer or os.environ.get("KVGUARD_KERNELS") or "auto").lower()
    dev = torch.device(device)
    if want not in ("auto", "torch", "cpu", "triton"):
        raise KernelsUnavailableError(
            f"KVGUARD_KERNELS={want!r}: choose auto, torch, cpu or triton"
        )
    if want == "torch":
        return TorchKernels()
    if want in ("auto", "cpu") and dev.type == "cpu":
        try:
            from .guard_cpu import CpuKernels

            return CpuKernels()
        except ImportError as exc:
            if want == "cpu":
                raise KernelsUnavailableError(f"compiled CPU kernels not available: {exc}") from exc
    if want in ("auto", "triton") and dev.type == "cuda":
        try:
            from .guard_triton import TritonKernels

            return TritonKernels()
        except ImportError as exc:
            if want == "triton":
                raise KernelsUnavailableError(f"Triton kernels not available: {exc}") from exc
    if want in ("cpu", "triton"):
        raise KernelsUnavailableError(f"{want} kernels do not run on a {dev.type} pool")
    return TorchKernels()

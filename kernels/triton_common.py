"""What every Triton kernel of the guard shares: the layout of the step's metadata (``HDR``,
``REC``, ``OREC``), the ``tl.constexpr`` globals (page states, history events, hash constants),
the jitted reductions, the hash mixers, the binary searches and the interpreter switch.

The mixers reproduce ``guard_ref.page_tag`` and ``guard_ref.chain_terms`` (``_page_tag``,
``_chain_term``) and ``kv_checksum_ref.splitmix64``, ``fmix64`` and ``poskey``. The kernels are
in ``triton_step_check`` (``guard_ref.check_step``), ``triton_transitions`` (``alloc_pages``,
``release_pages``, ``apply_step``) and ``triton_seal`` (``seal_step``, ``page_digests``); the
backend that launches them is ``guard_triton.TritonKernels``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from .guard_state import EPOCH_STEP_SHIFT, HISTORY, NO_ROW, PageState
from .kv_checksum_ref import FMIX_M1, FMIX_M2, POS_SEED, SM_GAMMA, SM_M1, SM_M2

_I64 = torch.int64
_I32 = torch.int32
_BIG32 = (1 << 31) - 1  # claim winner at rest (no claim)
HDR = 16  # header: hashed (check, seal), any read taint, any free read, refused; 8..12: flags
REC = 6  # metadata words per request: L, entry start, token start, kinds, held-tag sum, adopted sum
OREC = 8  # per-request results: n_pages, chain_len, chain_tail, write start, write end, agg
MCAP = 4096  # pages a workspace remembers having flagged (beyond: the whole array is cleared)
assert HISTORY == 4 and EPOCH_STEP_SHIFT == 24

# Globals used inside @triton.jit must be constexpr; values >= 2**63 become uint64 constants.
_GOLDEN = tl.constexpr(SM_GAMMA)
_SM1 = tl.constexpr(SM_M1)
_SM2 = tl.constexpr(SM_M2)
_FM1 = tl.constexpr(FMIX_M1)
_FM2 = tl.constexpr(FMIX_M2)
_POS = tl.constexpr(POS_SEED)
_HDR = tl.constexpr(HDR)
_REC = tl.constexpr(REC)
_OREC = tl.constexpr(OREC)
_BIG = tl.constexpr(_BIG32)
_NO_ROW = tl.constexpr(NO_ROW)
_FREE = tl.constexpr(int(PageState.FREE))
_OWNED = tl.constexpr(int(PageState.OWNED))
_SHARED = tl.constexpr(int(PageState.SHARED))
_QUAR = tl.constexpr(int(PageState.QUARANTINED))
_ALLOC = tl.constexpr(int(PageState.ALLOCATED))
_EV_CLAIM = tl.constexpr(1)
_EV_FREE = tl.constexpr(4)
_EV_ALLOC = tl.constexpr(6)
_REFUSED = tl.constexpr(4)  # header word: the step names an index outside the pool or table

# Triton kernel arguments are pointers and ints that Triton specializes on; annotations other
# than tl.constexpr would change that, so the jitted functions below stay unannotated.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"


def _dyn(*names: str) -> list[str]:
    """Arguments that change from step to step: never specialized (Triton compiles a variant for
    an integer equal to 1 or divisible by 16; a serving step must not trigger a compile)."""
    return list(names)


# Reductions and zeros through the builtins they wrap (triton.language's own wrappers are jitted
# functions, which the interpreter re-patches at every call; compiled, both are the same code).
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, tl.standard._sum_combine)


@triton.jit
def _zeros_like(x):
    return tl.full(x.shape, 0, x.dtype)


# -- hashes (all uint64, wrapping) ---------------------------------------------------------------
@triton.jit
def _u64(x):
    return x.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def _s64(x):
    return x.to(tl.int64, bitcast=True)


@triton.jit
def _splitmix64(x):
    z = x + _GOLDEN
    z = (z ^ (z >> 30)) * _SM1
    z = (z ^ (z >> 27)) * _SM2
    return z ^ (z >> 31)


@triton.jit
def _fmix64(x):
    x = x ^ (x >> 33)
    x = x * _FM1
    x = x ^ (x >> 33)
    x = x * _FM2
    return x ^ (x >> 33)


@triton.jit
def _page_tag(epoch, lpage):
    return _fmix64(_u64(epoch) * _GOLDEN + _u64(lpage))


@triton.jit
def _chain_term(tok, pos):
    return _splitmix64(_u64(tok) * _GOLDEN + _u64(pos))


@triton.jit
def _poskey(pos):
    return _splitmix64(_u64(pos) + _POS)


@triton.jit
def _upper_bound(base, stride, n, x, nsteps):
    """First k in [0, n) with base[k * stride] > x (n if none); base ascending."""
    lo = _zeros_like(x)
    hi = _zeros_like(x) + n
    for _ in range(nsteps):
        act = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(base + mid * stride, mask=act, other=0)
        right = act & (v <= x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(act & ~right, mid, hi)
    return lo


@triton.jit
def _lower_bound(base, n, x, nsteps):
    """First k in [0, n) with base[k] >= x (n if none); base ascending."""
    lo = _zeros_like(x)
    hi = _zeros_like(x) + n
    for _ in range(nsteps):
        act = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(base + mid, mask=act, other=0)
        right = act & (v < x)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(act & ~right, mid, hi)
    return lo


@triton.jit
def _probe_kernel(out):
    tl.store(out, 1)


def _interpreting() -> bool:
    return type(_probe_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1 at import


def _rewrite_helpers(namespace: dict[str, Any]) -> None:
    """Under the interpreter, put the rewritten bodies of a module's jitted helpers (not its
    kernels) in its namespace: every module of kernels calls it on its own globals, last.

    The interpreter re-patches triton.language at every call of a jitted helper (most of its
    time here); inside a kernel it is patched already, so the helpers' rewritten bodies are
    called directly. Same code, same semantics: only the interpreter's bookkeeping is skipped."""
    if not _interpreting():
        return
    for name, fn in list(namespace.items()):
        if type(fn).__name__ == "InterpretedFunction" and not name.endswith("_kernel"):
            namespace[name] = fn.rewrite()


# -- host side --------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


_rewrite_helpers(globals())  # under the interpreter: the helpers' rewritten bodies

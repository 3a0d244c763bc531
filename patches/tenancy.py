"""Tenants as SGLang 0.5.23 carries them: a request's prefix-cache namespace, turned into the seed
of its token chain so that KV written under one tenant never validates for another.

SGLang's radix tree keys every node by ``(Req.extra_key, Req.cache_salt)`` besides the tokens
(``RadixKey.child_key``): requests with different namespaces never share a node. The namespace
reaches ``Req`` from the ``extra_key`` / ``cache_salt`` fields of ``/generate``, ``/v1/completions``
and ``/v1/chat/completions`` (top-level JSON fields; an OpenAI client sends them in
``extra_body``). ``extra_key`` also carries the LoRA id SGLang appends to it, so adapters are
tenants too, exactly as the tree sees them. No namespace (both None) is seed 0: the chain of a
guard without isolation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from functools import lru_cache

import torch

# The Req attributes read here (SGLang 0.5.23, managers/schedule_batch.py), for patches/targets.py.
TENANT_FIELDS = ("Req.extra_key", "Req.cache_salt")


def namespace_of(req) -> tuple[str | None, str | None]:
    """The request's prefix-cache namespace, exactly as ``RadixKey`` keys it (an ``extra_key`` of
    "" is a namespace of its own there; a ``cache_salt`` of "" is none)."""
    return (getattr(req, "extra_key", None), getattr(req, "cache_salt", None) or None)


@lru_cache(maxsize=4096)
def namespace_seed(extra_key: str | None, cache_salt: str | None) -> int:
    """A stable int64 chain seed for one namespace: 0 for none, never 0 otherwise. Each part is
    length-prefixed, so ("a|b", None) and ("a", "b") differ; stable across processes and runs
    (blake2b, not Python's salted ``hash``)."""
    if extra_key is None and cache_salt is None:
        return 0
    h = hashlib.blake2b(b"kvguard-tenant-v1", digest_size=8)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode("utf-8", "surrogatepass")
            h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    seed = int.from_bytes(h.digest(), "little", signed=True)
    return seed or 1


def tenant_seeds(reqs: Iterable[object], device, enabled: bool) -> torch.Tensor | None:
    """[B] int64 chain seeds of a batch's requests (in batch order) when tenant isolation is on,
    else None (every chain seeded with 0, as without tenants)."""
    if not enabled:
        return None
    seeds = [namespace_seed(*namespace_of(r)) for r in reqs]
    return torch.tensor(seeds, dtype=torch.int64).to(device, non_blocking=True)

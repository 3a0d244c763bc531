"""Tenants: a request's prefix-cache namespace (SGLang 0.5.23's ``extra_key`` / ``cache_salt``) as a
chain seed (patches/tenancy.py), and the namespace reaching the scheduler from every route a client
sets it on (/generate, /v1/completions, /v1/chat/completions)."""

from __future__ import annotations

import subprocess
import sys
from array import array

import pytest
import requests
import torch

from kvguard.patches.tenancy import namespace_of, namespace_seed, tenant_seeds


def _req(rid: str, **kw):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("q", [1, 2, 3, 4]), SamplingParams(), **kw)


def test_seed_per_namespace_is_stable_and_never_zero_for_a_tenant():
    assert namespace_seed(None, None) == 0  # no tenant: the chain of a guard without isolation
    spaces = [
        ("a", None),
        (None, "a"),
        ("a", "b"),
        ("a|b", None),
        ("a", "b|"),
        ("", "a"),
        ("b", "a"),
    ]
    seeds = [namespace_seed(*ns) for ns in spaces]
    assert len(set(seeds)) == len(seeds) and 0 not in seeds
    assert all(-(2**63) <= s < 2**63 for s in seeds)
    code = "from kvguard.patches.tenancy import namespace_seed; print(namespace_seed('a', 'b'))"
    other = subprocess.run(  # another process (Python's hash() is salted per process; this is not)
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert int(other.stdout) == namespace_seed("a", "b")


def test_tenant_seeds_follow_sglangs_radix_namespace():
    """Two requests get the same seed exactly when SGLang's radix tree puts their prompts under the
    same key (LoRA adapters included: SGLang appends the adapter id to extra_key)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    reqs = [
        _req("plain"),
        _req("salt-a", cache_salt="a"),
        _req("salt-a-again", cache_salt="a"),
        _req("key-a", extra_key="a"),
        _req("both", extra_key="a", cache_salt="a"),
        _req("lora", cache_salt="a", lora_id="adapter-1"),
        _req("empty-salt", cache_salt=""),  # RadixKey: a "" salt is none
        _req("empty-key", extra_key=""),  # RadixKey: a "" extra_key is a namespace of its own
    ]
    assert tenant_seeds(reqs, "cpu", enabled=False) is None
    seeds = tenant_seeds(reqs, "cpu", enabled=True)
    assert seeds.dtype == torch.int64 and seeds.shape == (len(reqs),)
    assert seeds[0] == 0 and seeds[-2] == 0 and seeds[-1] != 0

    def radix_key(r):
        key = RadixKey(r.origin_input_ids, r.extra_key, cache_salt=r.cache_salt)
        return key.child_key(page_size=4)

    for i, a in enumerate(reqs):
        for j, b in enumerate(reqs):
            same_tree = radix_key(a) == radix_key(b)
            assert (seeds[i] == seeds[j]) == same_tree, (a.rid, b.rid, namespace_of(a))


# -- the namespace on the wire ------------------------------------------------------------------------
PROMPT = (
    "def parse_header(line):\n    key, _, value = line.partition(':')\n    return key.strip()\n"
)


@pytest.fixture(scope="module")
def tenant_server(shared_server):
    """The session's kvguard-serve (tests/shared_server.py): tenant isolation on, a cache report
    on the OpenAI routes, and a plain chat template (the default model has none)."""
    srv = shared_server.get()
    name = requests.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
    return srv, name


def _generate(url, text, **ns) -> int:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **ns}
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]["cached_tokens"]


def _completion(url, model, text, **ns) -> int:
    body = {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0, **ns}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _chat(url, model, text, **ns) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 2,
        "temperature": 0,
        **ns,
    }
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.engine
@pytest.mark.parametrize("route", ["generate", "completions", "chat"])
@pytest.mark.parametrize("field", ["cache_salt", "extra_key"])
def test_namespace_reaches_the_scheduler(tenant_server, route, field):
    """The scheduler's radix tree keys the prompt by the namespace the client sent: a repeat in the
    same namespace hits the prefix cache, the same prompt in another namespace (or none) does not.
    An OpenAI client sends these fields in ``extra_body`` (top-level JSON fields)."""
    srv, model = tenant_server
    send = {
        "generate": lambda text, **ns: _generate(srv.url, text, **ns),
        "completions": lambda text, **ns: _completion(srv.url, model, text, **ns),
        "chat": lambda text, **ns: _chat(srv.url, model, text, **ns),
    }[route]
    text = f"# {route} {field}\n" + PROMPT * 3  # a prompt of its own: no other test's cache
    assert send(text, **{field: "tenant-1"}) == 0
    assert send(text, **{field: "tenant-1"}) >= 16  # same tenant: whole pages from the cache
    assert send(text, **{field: "tenant-2"}) == 0  # another tenant: its own namespace
    assert send(text) == 0  # no namespace: SGLang's default tree

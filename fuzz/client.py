"""Send one wave of requests concurrently and record what each client saw."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass, field

import aiohttp

from kvguard.fuzz.workload import RequestSpec

GUARD_ABORT = re.compile(r"KV cache integrity violation (kvg-[0-9A-Za-z-]+)")
REQUEST_TIMEOUT_S = 900


@dataclass(slots=True)
class Response:
    rid: str
    key: str
    wave: int
    status: int | None = None  # HTTP status; None: no answer (connection error, timeout)
    output_ids: list[int] | None = None
    top2: list[list[float]] | None = None  # per output token: [logprob1, id1, logprob2, id2]
    error: str | None = None  # message of a non-200 answer or the client-side exception
    violation: str | None = None  # kvguard violation id named in a guard abort
    client_abort: bool = False
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    latency_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _body(spec: RequestSpec, rid: str, stream: bool) -> dict:
    tenant = {
        k: v for k, v in (("extra_key", spec.extra_key), ("cache_salt", spec.cache_salt)) if v
    }
    return {
        **tenant,  # SGLang's prefix-cache namespace (top-level fields of /generate)
        "rid": rid,
        "text": spec.text,
        "stream": stream,
        "return_logprob": True,  # the two best tokens at each step: the oracle's tie test
        "top_logprobs_num": 2,
        "sampling_params": {
            "max_new_tokens": spec.max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
    }


async def _one(
    session: aiohttp.ClientSession, url: str, spec: RequestSpec, prefix: str
) -> Response:
    rid = f"{prefix}-{spec.key}"
    out = Response(
        rid=rid, key=spec.key, wave=spec.wave, client_abort=spec.cancel_after_chunks is not None
    )
    t0 = time.monotonic()
    try:
        if spec.cancel_after_chunks is not None:
            await _streamed_then_dropped(session, url, spec, rid, out)
        else:
            async with session.post(f"{url}/generate", json=_body(spec, rid, False)) as r:
                out.status = r.status
                text = await r.text()
                if r.status == 200:
                    _fill(out, json.loads(text))
                else:
                    _error(out, text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.latency_s = time.monotonic() - t0
    return out


async def _streamed_then_dropped(session, url, spec, rid, out: Response):
    """A streamed request whose client goes away after a few chunks (SGLang aborts it)."""
    chunks = 0
    async with session.post(f"{url}/generate", json=_body(spec, rid, True)) as r:
        out.status = r.status
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            data = json.loads(line[5:])
            if "error" in data:
                _error(out, json.dumps(data["error"]))
                return
            _fill(out, data)
            chunks += 1
            if chunks >= spec.cancel_after_chunks:
                r.close()  # drop the connection mid-flight
                return


def _fill(out: Response, data: dict):
    out.output_ids = data.get("output_ids")
    meta = data.get("meta_info") or {}
    out.top2 = [_top2(pos) for pos in meta.get("output_top_logprobs") or []] or None
    reason = meta.get("finish_reason")
    out.finish_reason = reason.get("type") if isinstance(reason, dict) else reason
    out.prompt_tokens = meta.get("prompt_tokens")
    out.completion_tokens = meta.get("completion_tokens")
    out.cached_tokens = meta.get("cached_tokens")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        _error(out, json.dumps(reason))


def _top2(pos) -> list[float] | None:
    """SGLang's ``[[logprob, token_id, text], ...]`` at one position -> [lp1, id1, lp2, id2]."""
    if not pos or len(pos) < 2:
        return None
    (lp1, id1, *_), (lp2, id2, *_) = pos[0], pos[1]
    return [round(lp1, 4), id1, round(lp2, 4), id2]


def _error(out: Response, text: str):
    out.error = text[:2000]
    m = GUARD_ABORT.search(text)
    if m:
        out.violation = m.group(1)


async def run_wave(url: str, specs: list[RequestSpec], prefix: str, on_sent=None) -> list[Response]:
    """All of ``specs`` at once; ``on_sent()`` runs once every request is on its way."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        tasks = [asyncio.ensure_future(_one(session, url, s, prefix)) for s in specs]
        await asyncio.sleep(0)  # every request starts connecting before the injection lands
        if on_sent is not None:
            on_sent()
        return list(await asyncio.gather(*tasks))

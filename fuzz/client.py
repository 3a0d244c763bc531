"""Send one wave of requests concurrently and record what each client saw: a plain request's
answer, or a streamed request's every chunk (the tokens in the order they reached the client, and
how the stream ended)."""

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
    output_ids: list[int] | None = None  # streamed: every token the client was sent
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
    # -- streamed requests (SSE): what reached the client, chunk by chunk ----------------------
    streamed: bool = False
    stream_ids: list[int] | None = None  # every token the client was sent, in order
    stream_top2: list[list[float] | None] | None = None  # the top-2 sent with each of them
    stream_chunks: list[int] | None = None  # new tokens per data chunk
    # [position, token]: a later chunk restated a position with another token (the client was
    # sent both; SGLang never does this, and the oracle scores both)
    stream_rewrites: list[list[int]] | None = None
    stream_end: str | None = None  # "done", "abort", "error", "dropped" (by the client), "cut"
    # chunks that took back tokens already sent: counted fewer output tokens than an earlier
    # chunk (a token that left and was then dropped, e.g. by a recompute that let it out)
    stream_withdrawn: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def request_body(spec: RequestSpec, rid: str, stream: bool, extra: dict | None = None) -> dict:
    """The /generate body of ``spec``; ``extra``: more top-level fields (a PD pair's bootstrap
    fields)."""
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
        **(extra or {}),
    }


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    spec: RequestSpec,
    prefix: str,
    extra: dict | None = None,
) -> Response:
    """Send ``spec`` (rid ``<prefix>-<key>``, body fields ``extra`` added) and record what the
    client got."""
    rid = f"{prefix}-{spec.key}"
    out = Response(
        rid=rid,
        key=spec.key,
        wave=spec.wave,
        client_abort=spec.cancel_after_chunks is not None,
        streamed=spec.streamed,
    )
    t0 = time.monotonic()
    try:
        if spec.streamed:
            await _streamed(session, url, spec, rid, out, extra)
        else:
            async with session.post(
                f"{url}/generate", json=request_body(spec, rid, False, extra)
            ) as r:
                out.status = r.status
                text = await r.text()
                if r.status == 200:
                    _fill(out, json.loads(text))
                else:
                    _error(out, text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    if out.streamed and out.stream_ids is not None:  # the output is what the client was sent
        out.output_ids = list(out.stream_ids) if out.status == 200 else out.output_ids
        out.top2 = list(out.stream_top2 or []) or None
    out.latency_s = time.monotonic() - t0
    return out


async def _streamed(session, url, spec: RequestSpec, rid: str, out: Response, extra=None):
    """A streamed request (SSE): every chunk's tokens recorded in the order they arrived. A
    client abort (``cancel_after_chunks``) drops the connection after that many chunks (SGLang
    then aborts the request)."""
    stream = StreamFold(out)
    async with session.post(f"{url}/generate", json=request_body(spec, rid, True, extra)) as r:
        out.status = r.status
        if r.status != 200:
            _error(out, await r.text())
            return
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if line == "data: [DONE]":
                out.stream_end = out.stream_end or "done"
                return
            if not line.startswith("data:"):
                continue
            data = json.loads(line[5:])
            if "error" in data:
                _error(out, json.dumps(data["error"]))
                out.stream_end = "error"
                continue
            stream.chunk(data)
            _fill(out, data)
            if out.finish_reason == "abort":
                out.stream_end = "abort"
            chunks = len(out.stream_chunks or ())
            if spec.cancel_after_chunks is not None and chunks >= spec.cancel_after_chunks:
                out.stream_end = "dropped"
                r.close()  # drop the connection mid-flight
                return
    out.stream_end = out.stream_end or "cut"  # the stream ended without [DONE]


class StreamFold:
    """Folds a stream's data chunks into what the client was sent. SGLang sends either every
    output token so far in each chunk (its default) or only the new ones
    (``--incremental-streaming-output``). A chunk that extends what was sent is read as the
    former; else one whose ``completion_tokens`` counts it on top of what was sent, as the
    latter; else it restates earlier positions, and each position it restates with another
    token is a rewrite (the client was sent both tokens there). A chunk that counts fewer output
    tokens than an earlier one (``completion_tokens``, or a shorter cumulative list) took back
    tokens the client was sent (``stream_withdrawn``); the client keeps them."""

    def __init__(self, out: Response):
        self.out = out
        self.done = 0  # the most output tokens a chunk counted so far
        out.stream_ids, out.stream_top2, out.stream_chunks = [], [], []
        out.stream_rewrites = []

    def chunk(self, data: dict) -> None:
        out = self.out
        sent, sent_top = out.stream_ids, out.stream_top2
        assert sent is not None and sent_top is not None
        assert out.stream_chunks is not None and out.stream_rewrites is not None
        ids = [int(t) for t in data.get("output_ids") or []]
        meta = data.get("meta_info") or {}
        top = [_top2(pos) for pos in meta.get("output_top_logprobs") or []]
        done = meta.get("completion_tokens")
        before = len(sent)
        reason = meta.get("finish_reason")
        aborted = isinstance(reason, dict) and reason.get("type") == "abort"
        shorter = bool(ids) and len(ids) < before and ids == sent[: len(ids)] and done == len(ids)
        if (isinstance(done, int) and done < self.done and not aborted) or shorter:
            out.stream_withdrawn += 1
        if isinstance(done, int):
            self.done = max(self.done, done)
        if not ids:
            offset = before  # nothing new (an abort chunk may carry no tokens)
        elif ids[:before] == sent and (done is None or done == len(ids) or not before):
            offset = 0  # cumulative: every token so far
        elif done == before + len(ids):
            offset = before  # incremental: the new tokens only
        else:
            offset = 0  # restates earlier positions, some with other tokens
            out.stream_rewrites += [[p, t] for p, t in enumerate(ids[:before]) if t != sent[p]]
        for pos, tok in enumerate(ids, offset):
            if pos >= len(sent):
                sent.append(tok)
        # the top-2 list covers every position so far (cumulative) or the last ones
        base = 0 if len(top) >= len(sent) else len(sent) - len(top)
        for pos, t in enumerate(top, base):
            while len(sent_top) <= pos:
                sent_top.append(None)
            if sent_top[pos] is None:
                sent_top[pos] = t
        del sent_top[len(sent) :]
        sent_top += [None] * (len(sent) - len(sent_top))
        out.stream_chunks.append(len(sent) - before)


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
    if lp1 is None or lp2 is None:  # NaN logits (KV gone to garbage, guard off) arrive as null
        return None
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
        tasks = [asyncio.ensure_future(one_request(session, url, s, prefix)) for s in specs]
        await asyncio.sleep(0)  # every request starts connecting before the injection lands
        if on_sent is not None:
            on_sent()
        return list(await asyncio.gather(*tasks))

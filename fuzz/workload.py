"""The campaign's workload and injection schedule, both a pure function of the seed.

Workload: waves of concurrent /generate requests (greedy, so a clean run is a reference). Prompts
are slices of Python standard-library source (what kvguard's default model was trained on), with
the shapes that make a KV cache work hard:

- shared headers: several requests of a wave open with the same module header (prefix sharing
  between requests in flight);
- multi-turn conversations: a later wave extends an earlier prompt (prefix-cache hits on KV
  written in an earlier wave, or on its evicted remains);
- mixed lengths, many longer than the chunked-prefill size, more KV in flight than the pool holds
  (eviction, retraction);
- client aborts: a few streamed requests the client drops mid-flight (scored on the tokens they
  were sent before the drop, against what the clean pass was sent);
- streaming (``stream_fraction``): that share of the requests is streamed (SSE), so every token
  reaches its client as soon as it is made and the oracle scores each one;
- long prompts (``long_fraction``, ``long_tokens``): that share of the requests reads a prompt of
  that many tokens (counted with the served model's tokenizer when one is given), so a decode
  step reads more KV than the ``sampled`` mode's per-step budget (512 tokens);
- tenants (only when asked, for tenant isolation): each request has a prefix-cache namespace
  (none, ``cache_salt``, ``extra_key`` or both), a conversation keeps its tenant, and the shared
  headers are picked whatever the tenant, so the same prefix arrives under several tenants.

Schedule: ``num_injections`` entries spread over the waves, classes dealt round-robin from a
seeded shuffle so every class gets its share. Every configuration of a campaign (guard mode, page
size) runs the same workload and the same schedule.
"""

from __future__ import annotations

import random
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# Files of the standard library the prompts are cut from (sorted lines, fixed list: the same
# text for a seed on every machine with this Python).
_SOURCES = (
    "argparse.py",
    "ast.py",
    "calendar.py",
    "collections/__init__.py",
    "configparser.py",
    "csv.py",
    "dataclasses.py",
    "difflib.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "gettext.py",
    "heapq.py",
    "inspect.py",
    "ipaddress.py",
    "json/decoder.py",
    "logging/__init__.py",
    "pathlib.py",
    "pprint.py",
    "shlex.py",
    "statistics.py",
    "string.py",
    "textwrap.py",
    "tokenize.py",
    "typing.py",
    "uuid.py",
    "zipfile.py",
)
MAX_NEW_TOKENS = (4, 8, 8, 12, 16, 16, 24, 32)
LONG_TOKENS = (1500, 3000)  # prompt tokens of a long prompt (read sets past the sampled budget)
CHARS_PER_TOKEN = 3  # without a tokenizer: a long prompt's length estimated from its characters
EXTEND_CLASSES = (  # need a prefix-hit prefill
    "read_before_ready",
    "stale_prefix",
    "never_written",
    "cross_tenant",
)
REUSE_CLASSES = ("stale_writer",)  # harm only once a later request reuses the page
TENANT_CLASSES = ("cross_tenant",)  # need tenants in the workload and tenant isolation on
# (extra_key, cache_salt): SGLang's namespace fields, alone and together; (None, None) is none.
TENANTS = ((None, None), (None, "tenant-a"), ("tenant-b", None), ("tenant-c", "salt-c"))


@dataclass(frozen=True, slots=True)
class RequestSpec:
    key: str  # unique in the workload; the request id is "<pass>-<key>"
    wave: int
    text: str
    max_new_tokens: int
    conversation: int | None = None  # multi-turn: same conversation, later turn extends earlier
    turn: int = 0
    cancel_after_chunks: int | None = None  # client abort: drop the stream after N chunks
    extra_key: str | None = None  # prefix-cache namespace (SGLang's extra_key / cache_salt)
    cache_salt: str | None = None
    stream: bool = False  # streamed (SSE): every token reaches the client as it is made
    long: bool = False  # a long prompt (``long_tokens``)

    @property
    def streamed(self) -> bool:
        return self.stream or self.cancel_after_chunks is not None


@dataclass(slots=True)
class Wave:
    index: int
    requests: list[RequestSpec] = field(default_factory=list)
    injections: list[dict] = field(default_factory=list)  # control-file plan entries


def _corpus() -> list[list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in _SOURCES:
        path = root / name
        if path.is_file():
            lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
            if len(lines) > 80:
                files.append(lines)
    if not files:
        raise RuntimeError(f"no prompt source found under {root}")
    return files


def _snippet(rng: random.Random, corpus: list[list[str]], min_chars: int, max_chars: int) -> str:
    lines = rng.choice(corpus)
    want = rng.randint(min_chars, max_chars)
    i = rng.randrange(len(lines) - 40)
    out: list[str] = []
    while sum(len(x) + 1 for x in out) < want and i < len(lines):
        out.append(lines[i])
        i += 1
    return "\n".join(out)[:want] + "\n"


def _long_prompt(
    rng: random.Random,
    corpus: list[list[str]],
    lo: int,
    hi: int,
    count_tokens: Callable[[str], int] | None,
    head: str = "",
) -> str:
    """``head`` and whole lines of several source files after it, cut to a drawn target of
    ``lo``..``hi`` tokens (counted by ``count_tokens``, else ~3 characters a token)."""
    count = count_tokens or (lambda text: len(text) // CHARS_PER_TOKEN)
    want = rng.randint(lo, hi)
    lines: list[str] = []
    while True:
        src = rng.choice(corpus)
        i = rng.randrange(len(src) - 40)
        lines += src[i : i + 120]
        if count(head + "\n".join(lines)) >= want:
            break
    lo_n, hi_n = 1, len(lines)  # the most lines within the target (binary search)
    while lo_n < hi_n:
        mid = (lo_n + hi_n + 1) // 2
        if count(head + "\n".join(lines[:mid])) <= want:
            lo_n = mid
        else:
            hi_n = mid - 1
    return head + "\n".join(lines[:lo_n]) + "\n"


def build_workload(
    seed: int,
    num_requests: int,
    wave_size: int = 24,
    tenants: bool = False,
    stream_fraction: float = 0.0,
    long_fraction: float = 0.0,
    long_tokens: tuple[int, int] = LONG_TOKENS,
    count_tokens: Callable[[str], int] | None = None,
) -> list[Wave]:
    """``num_requests`` requests in waves of about ``wave_size`` (16..32 around it); with
    ``tenants``, each request in one of ``TENANTS``; ``stream_fraction`` of them streamed;
    ``long_fraction`` of them with a long prompt of ``long_tokens`` (lo, hi) tokens, counted
    by ``count_tokens`` (the served model's tokenizer; without it ~3 characters a token). Tenants,
    streaming and long prompts are drawn from generators of their own: every other request of
    a seed is the same either way."""
    rng = random.Random(f"kvguard-fuzz-workload-{seed}")
    tenant_rng = random.Random(f"kvguard-fuzz-tenants-{seed}")
    stream_rng = random.Random(f"kvguard-fuzz-stream-{seed}")
    long_rng = random.Random(f"kvguard-fuzz-long-{seed}")
    corpus = _corpus()
    headers = [_snippet(rng, corpus, 100, 320) for _ in range(6)]  # shared module headers
    open_convs: list[tuple[int, str, int, tuple]] = []  # (conversation, prompt, turn, tenant)
    waves: list[Wave] = []
    next_conv = 0
    made = 0
    while made < num_requests:
        w = Wave(len(waves))
        size = min(num_requests - made, max(1, rng.randint(wave_size * 2 // 3, wave_size * 4 // 3)))
        later: list[tuple[int, str, int, tuple]] = []
        for j in range(size):
            kind = rng.random()
            conv, turn = None, 0
            tenant = tenant_rng.choice(TENANTS) if tenants else (None, None)
            if kind < 0.35 and open_convs:  # next turn of an earlier conversation
                conv, prev, turn, tenant = open_convs.pop(rng.randrange(len(open_convs)))
                turn += 1
                text = prev + _snippet(rng, corpus, 20, 100) + _snippet(rng, corpus, 20, 150)
            elif kind < 0.70:  # shared header + own tail
                text = rng.choice(headers) + _snippet(rng, corpus, 20, 250)
            else:  # unrelated one-shot, short to long (many above the chunked-prefill size)
                text = _snippet(rng, corpus, 30, 800)
            if conv is None and rng.random() < 0.4:
                conv, next_conv = next_conv, next_conv + 1
            if conv is not None and turn < 3 and len(text) < 1200:
                later.append((conv, text, turn, tenant))
            long = long_rng.random() < long_fraction
            if long:  # a long prompt instead, often after a shared header (prefix hits on long
                # reads); a later turn still extends the short one, so the rest of the
                # workload is the seed's either way
                head = long_rng.choice(headers) if long_rng.random() < 0.5 else ""
                text = _long_prompt(long_rng, corpus, *long_tokens, count_tokens, head)
            cancel = rng.randint(1, 3) if rng.random() < 0.06 else None
            stream = stream_rng.random() < stream_fraction
            w.requests.append(
                RequestSpec(
                    f"w{w.index:03d}-{j:02d}",
                    w.index,
                    text,
                    rng.choice(MAX_NEW_TOKENS),
                    conv,
                    turn,
                    cancel,
                    *tenant,
                    stream,
                    long,
                )
            )
        open_convs.extend(later)
        del open_convs[:-24]  # keep conversations recent enough for their prefix to be cached
        waves.append(w)
        made += size
    return waves


def schedule_injections(
    seed: int, waves: list[Wave], num_injections: int, classes: list[str], max_tries: int = 80
) -> None:
    """Deal ``num_injections`` plan entries round-robin over the waves (none in the first wave: it
    has no earlier conversation to hit; none of ``REUSE_CLASSES`` in the last: nothing after it
    reuses the pages)."""
    rng = random.Random(f"kvguard-fuzz-schedule-{seed}")
    if num_injections <= 0 or not classes:
        return
    eligible = waves[1:] or waves
    deck: list[str] = []
    ids = iter(range(1, num_injections + 1))
    for i in range(num_injections):
        if not deck:
            deck = list(classes)
            rng.shuffle(deck)
        cls, k = deck.pop(), i % len(eligible)
        if cls in REUSE_CLASSES and eligible[k] is waves[-1] and len(eligible) > 1:
            k -= 1
        eligible[k].injections.append(
            {"id": 0, "cls": cls, "seed": rng.randrange(2**31), "max_tries": max_tries}
        )
    for w in waves:  # the plugin injects in order: prefix-hit classes first, while prefills run
        w.injections.sort(key=lambda e: e["cls"] not in EXTEND_CLASSES)
        for e in w.injections:
            e["id"] = next(ids)

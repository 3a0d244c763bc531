"""Prometheus series, namespace ``kvguard_``. In SGLang's scheduler (a child process) they reach the
server's ``/metrics`` through prometheus-client's multiprocess mode, which SGLang enables with
``--enable-metrics`` (``kvguard-serve`` turns it on)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_default: GuardMetrics | None = None


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Imported here, not at module import: prometheus-client picks its (multiprocess) value
        # store when first imported, which must happen after SGLang set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import REGISTRY, Counter, Gauge

        kw: dict[str, Any] = dict(
            namespace="kvguard", registry=REGISTRY if registry is None else registry
        )
        self.steps_checked = Counter(
            "steps_checked", "Forward steps whose reads and writes were checked", **kw
        )
        self.tokens_checked = Counter(
            "tokens_checked", "KV token reads and writes tag-checked", **kw
        )
        self.tokens_checksummed = Counter(
            "tokens_checksummed", "KV tokens hashed (seal, hand-off, sweep, paranoid)", **kw
        )
        self.violations = Counter(
            "violations", "Integrity violations found, by kind", ["kind"], **kw
        )
        self.requests_aborted = Counter("requests_aborted", "Requests aborted by the guard", **kw)
        self.requests_recomputed = Counter(
            "requests_recomputed",
            "Requests whose KV went bad, sent back to be recomputed instead of aborted",
            **kw,
        )
        self.recompute_seconds = Counter(
            "recompute_seconds",
            "Wall time from a recompute decision to the request's first token after it",
            **kw,
        )
        self.tokens_recomputed = Counter(
            "tokens_recomputed", "Tokens re-prefilled by recomputed requests", **kw
        )
        self.recompute_breaker_open = Gauge(
            "recompute_breaker_open",
            "1 while recomputes per minute are past the breaker (violations abort instead)",
            multiprocess_mode="livemax",
            **kw,
        )
        self.pages_quarantined = Counter("pages_quarantined", "KV pages withheld from reuse", **kw)
        self.check_seconds = Counter(
            "check_seconds", "CPU time of the scheduler thread inside guard hooks", **kw
        )
        self.forward_hash_seconds = Counter(
            "forward_hash_seconds",
            "CPU time of the scheduler thread hashing inside the forward: attention's hashed "
            "gather of the KV it reads and the writers' digests of its stores (part of "
            "check_seconds)",
            **kw,
        )
        self.transfers_checked = Counter(
            "transfers_checked",
            "KV transfers (prefill/decode) sealed as sent, claimed as issued or checked as landed",
            **kw,
        )
        self.transfer_check_seconds = Counter(
            "transfer_check_seconds",
            "CPU time of the scheduler thread in the hand-off checks (part of check_seconds)",
            **kw,
        )
        self.unchecked_forwards = Counter(
            "unchecked_forwards", "Forwards that ran without the guard's check (must stay 0)", **kw
        )
        self.internal_errors = Counter(
            "internal_errors",
            "Guard failures (its own code raised); the affected step's requests fail closed",
            ["hook"],
            **kw,
        )
        self.log_suppressed = Counter(
            "log_suppressed", "Guard log lines dropped by the storm rate limit", **kw
        )
        self.pages_scrubbed = Counter(
            "pages_scrubbed", "Quarantined KV pages scrubbed and returned to service", **kw
        )
        self.quarantined_pages = Gauge(
            "quarantined_pages",
            "KV pages quarantined now (held by the engine until released, then scrubbed)",
            multiprocess_mode="livesum",
            **kw,
        )
        self.quarantine_cap_pages = Gauge(
            "quarantine_cap_pages",
            "Quarantined pages at which the guard fails closed",
            multiprocess_mode="livesum",
            **kw,
        )
        self.healthy = Gauge(
            "healthy",
            "1 while the guard vouches for its server; 0 once it failed closed",
            multiprocess_mode="livemin",
            **kw,
        )
        self.state_bytes = Gauge(
            "state_bytes",
            "Device bytes of the guard's own state (ledger + records), summed over schedulers",
            multiprocess_mode="livesum",
            **kw,
        )

    @classmethod
    def default(cls) -> GuardMetrics:
        global _default
        if _default is None:
            _default = cls()
        return _default

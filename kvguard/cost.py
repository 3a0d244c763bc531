"""The guard's own cost: its time and work, counted as its hooks run and sent to Prometheus in
batches (each increment is a write into SGLang's multiprocess metric files, tens of
microseconds)."""

from __future__ import annotations

import time

from kvguard.metrics import GuardMetrics

# The guard's own time is the CPU time of the thread running its hooks: on a machine whose
# cores the scheduler shares (tokenizer, detokenizer, clients), wall time inside a hook also
# counts the moments the thread was preempted by others.
clock = time.thread_time
FLUSH_EVERY_S = 0.5


class GuardCost:
    """What the guard spent since the last flush."""

    def __init__(self, metrics: GuardMetrics):
        self.metrics = metrics
        self.seconds, self.steps, self.tokens, self.hashed = 0.0, 0, 0, 0
        self.transfer_seconds, self.transfers = 0.0, 0  # hand-off checks
        self.forward_seconds = 0.0  # hashing inside the forward
        self._flushed_at = 0.0

    def add_step(self, t0: float, tokens: int) -> None:
        """A step checked (``tokens``: read and written), and the guard's time since ``t0``."""
        self.steps += 1
        self.tokens += tokens
        self.seconds += clock() - t0

    def add(self, t0: float) -> None:
        """The guard's time since ``t0`` (``clock()``)."""
        self.seconds += clock() - t0

    def add_transfer(self, t0: float) -> None:
        """A hand-off check's time: the guard's, and also reported apart (the cost of guarding a
        prefill/decode pair per transfer)."""
        spent = clock() - t0
        self.seconds += spent
        self.transfer_seconds += spent
        self.transfers += 1

    def add_in_forward(self, seconds: float) -> None:
        """Time spent hashing inside the forward (attention's hashed gather, a store's digest):
        the guard's, and also reported apart. The gather is counted whole, SGLang's own share of
        it included (its loop would gather the same rows): an upper bound of the hash's cost."""
        self.seconds += seconds
        self.forward_seconds += seconds

    def flush(self, force: bool = False) -> bool:
        """Send the counters: at most every FLUSH_EVERY_S seconds while serving, at once when
        ``force``d (the engine went idle, the pool was flushed). False: nothing was sent."""
        if not (self.seconds or self.steps or self.hashed):
            return False  # nothing gathered (an idle engine calls this on every loop)
        now = time.monotonic()
        if not force and now - self._flushed_at < FLUSH_EVERY_S:
            return False
        self._flushed_at = now
        m = self.metrics
        m.check_seconds.inc(self.seconds)
        if self.forward_seconds:
            m.forward_hash_seconds.inc(self.forward_seconds)
            self.forward_seconds = 0.0
        if self.transfers:
            m.transfers_checked.inc(self.transfers)
            m.transfer_check_seconds.inc(self.transfer_seconds)
            self.transfer_seconds, self.transfers = 0.0, 0
        if self.steps:
            m.steps_checked.inc(self.steps)
            m.tokens_checked.inc(self.tokens)
        if self.hashed:
            m.tokens_checksummed.inc(self.hashed)
        self.seconds, self.steps, self.tokens, self.hashed = 0.0, 0, 0, 0
        return True

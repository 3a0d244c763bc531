"""Guard configuration: one frozen value, from code, environment (``KVGUARD_*``) or CLI flags."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from enum import Enum
from typing import Any


class Mode(str, Enum):
    OFF = "off"  # guard not installed
    TAGS = "tags"  # owner/epoch/position/chain tags on every read and write, no checksums
    SAMPLED = "sampled"  # tags + checksum at every hand-off + a rolling sweep of resting KV
    # tags + checksum at every hand-off + every KV byte attention reads, checksummed as it reads
    # it and judged before the step's tokens leave (a full pre-forward check where the attention
    # backend's read cannot be hashed)
    VERIFIED = "verified"
    PARANOID = "paranoid"  # verified + every KV token read is checksummed before each forward


class OnViolation(str, Enum):
    """What becomes of a request whose KV the guard found bad."""

    ABORT = "abort"  # finished with an error naming the violation
    # its KV released, re-queued with the tokens it produced (all from verified reads),
    # re-prefilled and decoded on; where that cannot apply (see kvguard.healing), aborted
    RECOMPUTE = "recompute"


class ReadPath(str, Enum):
    """How the reads of a mode that verifies them are verified on this server: decided once,
    from the mode and whether the adapter hashes the attention backend's read
    (:meth:`GuardConfig.read_path`); healing keeps a request's tokens only on the first."""

    # every byte attention reads is hashed as it reads it and judged before the step's tokens
    # leave: every emitted token came from verified bytes
    VERIFIED_IN_ATTENTION = "verified_in_attention"
    # every read is checked before the forward (another attention backend, a GPU pool): bytes
    # that change during the forward are consumed, and only the next step's check sees them
    PRE_FORWARD_CHECK = "pre_forward_check"
    NONE = "none"  # the mode does not verify every read (tags, sampled)


MIN_CAP_PAGES = 16  # the quarantine cap's floor, in pages


class ConfigError(ValueError):
    """An invalid guard setting; raised at start-up, never mid-serving."""


@dataclass(frozen=True, slots=True)
class GuardConfig:
    mode: Mode = Mode.VERIFIED
    # sampled mode, per step: this many tokens of the batch's read set are re-hashed (a rolling
    # window, so a read set this small is fully verified every step), and a quarter as many
    # resting ones on average (swept in batches every 8 steps).
    sweep_tokens_per_step: int = 512
    tenant_isolation: bool = False  # bind a request's tenant into its prefix chain
    # Pages quarantined at once, as a fraction of the pool, at which the guard fails closed
    # (server unhealthy, new requests refused; quarantined pages return to service scrubbed).
    quarantine_cap: float = 0.01
    on_violation: OnViolation = OnViolation.RECOMPUTE
    # recompute: a request is healed at most this many times, then aborted (a fault that comes
    # back is not healed away)
    recompute_budget: int = 2
    # recompute: past this many recomputes in the trailing minute (the whole server), requests
    # are aborted instead and an alert raised, until the rate falls back under it
    recompute_breaker_per_minute: int = 60

    def __post_init__(self) -> None:
        for name, enum, what in (
            ("mode", Mode, "mode"),
            ("on_violation", OnViolation, "on_violation"),
        ):
            value = getattr(self, name)
            if not isinstance(value, enum):
                try:
                    object.__setattr__(self, name, enum(str(value).lower()))
                except ValueError:
                    raise ConfigError(
                        f"invalid kvguard {what} {value!r}: choose one of "
                        + ", ".join(m.value for m in enum)
                    ) from None
        for name in ("recompute_budget", "recompute_breaker_per_minute"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ConfigError(f"{name} must be an integer >= 0, got {n!r}")
        sweep = self.sweep_tokens_per_step
        if isinstance(sweep, bool) or not isinstance(sweep, int) or sweep < 0:
            raise ConfigError(
                f"sweep_tokens_per_step must be an integer >= 0, got {self.sweep_tokens_per_step!r}"
            )
        cap = self.quarantine_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap <= 1:
            raise ConfigError(
                f"quarantine_cap must be a fraction of the pool in (0, 1], got {cap!r}"
            )

    def quarantine_cap_pages(self, num_pages: int) -> int:
        """The cap in pages for a pool of ``num_pages``: at least MIN_CAP_PAGES (an eighth of a
        smaller pool, and one page), so that one incident on a small pool, a page or two found
        bad and scrubbed as soon as their readers are released, does not take the server out
        of its router."""
        floor = min(MIN_CAP_PAGES, max(1, num_pages // 8))
        return max(floor, int(num_pages * self.quarantine_cap))

    @property
    def enabled(self) -> bool:
        return self.mode is not Mode.OFF

    @property
    def checksums(self) -> bool:
        return self.mode in (Mode.SAMPLED, Mode.VERIFIED, Mode.PARANOID)

    @property
    def verifies_reads(self) -> bool:
        """The mode asks for every read to be verified (how: :meth:`read_path`)."""
        return self.mode in (Mode.VERIFIED, Mode.PARANOID)

    def read_path(self, hashed_in_attention: bool) -> ReadPath:
        """The read path in force under this mode, given whether the adapter hashes the attention
        backend's read. The one place that decides it (``Guard.read_path``)."""
        if not self.verifies_reads:
            return ReadPath.NONE
        if hashed_in_attention:
            return ReadPath.VERIFIED_IN_ATTENTION
        return ReadPath.PRE_FORWARD_CHECK

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> GuardConfig:
        """Read ``KVGUARD_<FIELD>`` for each field (``KVGUARD_MODE``, ``KVGUARD_ON_VIOLATION``,
        ...; ``overrides`` that are not None win over the environment)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = environ.get(f"KVGUARD_{f.name.upper()}")
            if raw is None:
                continue
            values[f.name] = _parse(f.name, raw, f.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces this config in a child process."""
        out: dict[str, str] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f"KVGUARD_{f.name.upper()}"] = (
                v.value if isinstance(v, Enum) else str(int(v) if isinstance(v, bool) else v)
            )
        return out

    def with_(self, **kw: Any) -> GuardConfig:
        return replace(self, **kw)


def _parse(name: str, raw: str, typ: object) -> object:
    typ = str(typ)
    if "bool" in typ:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"KVGUARD_{name.upper()}={raw!r} is not a boolean (use 1/0, true/false)")
    if "float" in typ:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"KVGUARD_{name.upper()}={raw!r} is not a number") from None
    if "int" in typ:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"KVGUARD_{name.upper()}={raw!r} is not an integer") from None
    return raw

"""Is the guard running inside an in-process ``sglang.Engine``'s schedulers? (``kvguard.install``)

SGLang starts its schedulers as separate processes while ``sglang.Engine(...)`` is constructed;
kvguard loads into each of them through SGLang's plugin entry point and reads its configuration
from the environment those processes inherited. Nothing can be installed into them afterwards, so
``install`` checks instead: each scheduler reports its guard in the start-up handshake
(``kvguard.patches.guard_status``, which also reads the reports back from SGLang's engine) and
this module judges them.
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.config import GuardConfig

GuardStatus = dict[str, Any]  # one scheduler's report: active, pid, mode, page size, ...


class GuardNotActiveError(RuntimeError):
    """The engine's scheduler processes do not run the guard as asked."""


def check_statuses(
    reported: list[GuardStatus | None], config: GuardConfig | None = None
) -> list[GuardStatus]:
    """Check that every scheduler's report (``reported``, one per scheduler, None: no guard
    there) says the guard runs (with ``config``'s settings, if given) and return the reports.
    Raises :class:`GuardNotActiveError` otherwise: the guard must be configured in the
    environment *before* the Engine is created."""
    missing = [rank for rank, s in enumerate(reported) if not s or not s.get("active")]
    if missing:
        env = {
            k: v for k, v in os.environ.items() if k.startswith("KVGUARD_") or k == "SGLANG_PLUGINS"
        }
        raise GuardNotActiveError(
            f"kvguard is not running in {len(missing)} of {len(reported)} scheduler process(es) of "
            f"this sglang.Engine (environment now: {env or 'no KVGUARD_* set'}). The schedulers "
            "were started with the Engine and read the guard configuration from the environment "
            "then: set KVGUARD_MODE=tags|sampled|paranoid (os.environ.update(GuardConfig(...)"
            ".to_env())) before creating the Engine, keep 'kvguard' in SGLANG_PLUGINS if you set "
            "it, and check the scheduler log for a kvguard plugin error."
        )
    statuses = [s for s in reported if s]  # all of them, none missing
    if config is not None:
        want = {
            "mode": config.mode.value,
            "sweep_tokens_per_step": config.sweep_tokens_per_step,
            "tenant_isolation": config.tenant_isolation,
            "on_violation": config.on_violation.value,
            "recompute_budget": config.recompute_budget,
            "recompute_breaker_per_minute": config.recompute_breaker_per_minute,
        }
        for rank, s in enumerate(statuses):
            got = {k: s.get(k) for k in want}
            if got != want:
                raise GuardNotActiveError(
                    f"scheduler {rank} (pid {s.get('pid')}) runs the guard with {got}, asked for "
                    f"{want}: set {config.to_env()} in the environment before creating the Engine"
                )
    return statuses

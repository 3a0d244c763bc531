"""kvguard: KV-cache integrity guard for paged LLM serving.

Importing the package is cheap (no torch, no SGLang): a ``.pth`` file imports a submodule of it at
every interpreter start in the project's virtual environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvguard.config import GuardConfig


def install(engine: Any, config: GuardConfig | None = None) -> list[dict[str, Any]]:
    """Check that the guard runs in every scheduler process of an in-process ``sglang.Engine``.

    SGLang starts its schedulers while the Engine is created, and kvguard loads into them then
    (SGLang plugin entry point), configured by ``KVGUARD_*`` in the environment. So configure
    first, then create the Engine, then call ``install``::

        os.environ.update(kvguard.config.GuardConfig(mode="paranoid").to_env())
        engine = sglang.Engine(model_path=...)
        kvguard.install(engine)  # raises GuardNotActiveError if the schedulers run no guard

    With ``config``, the schedulers' settings must also match it. Returns one report per
    scheduler (mode, pid, page size, ...).
    """
    from kvguard.engine_status import check_statuses
    from kvguard.patches.guard_status import scheduler_statuses

    return check_statuses(scheduler_statuses(engine), config)


__all__ = ["install"]

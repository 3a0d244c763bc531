"""structlog set-up for the ``kvguard-serve`` application.

kvguard's library code only calls ``structlog.get_logger()``. The launcher (the application entry
point) picks the format once, configures its own process, and hands the choice to SGLang's child
processes in ``KVGUARD_LOG_FORMAT`` / ``KVGUARD_LOG_LEVEL``; the SGLang plugin calls
:func:`configure_from_env` when it loads there. Without ``KVGUARD_LOG_FORMAT`` (kvguard used inside
someone else's application) nothing is configured here: that application's choice stands.
Importing this module stays cheap (the plugin imports it in every SGLang process).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structlog.typing import Processor

FORMATS = ("console", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
ENV_FORMAT = "KVGUARD_LOG_FORMAT"
ENV_LEVEL = "KVGUARD_LOG_LEVEL"


def configure(fmt: str = "console", level: str = "info") -> None:
    """Configure structlog for this process: one line per event on stderr, with level, UTC
    timestamp and pid (kvguard runs in several processes; the pid says which)."""
    import logging

    import structlog

    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose one of {', '.join(FORMATS)}")
    tail: list[Processor]
    if fmt == "json":
        # Tracebacks as frames without their locals: structlog's default dict_tracebacks
        # renders every frame's locals, which in a scheduler hook are the batch (prompt token
        # ids, request ids) and the step's tensors: a stranger's prompt in the log, and 16-59 KB
        # a line (measured).
        frames = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        tail = [structlog.processors.ExceptionRenderer(frames), structlog.processors.JSONRenderer()]
    else:
        tail = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_pid,
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelName(level.upper()) if level in LEVELS else logging.INFO
        ),
        # one write per line (print() writes the newline apart: TP ranks sharing an unbuffered
        # stderr interleaved two events on one line)
        logger_factory=structlog.WriteLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )


def configure_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Apply the launcher's choice in a child process. Returns whether anything was configured.
    An unknown format falls back to console: logging must never keep the guard from loading."""
    environ = os.environ if environ is None else environ
    fmt = environ.get(ENV_FORMAT)
    if not fmt:
        return False
    level = environ.get(ENV_LEVEL, "info").lower()
    configure(fmt if fmt in FORMATS else "console", level)
    return True


def export(fmt: str, level: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Hand the choice to child processes (they inherit the environment)."""
    environ = os.environ if environ is None else environ
    environ[ENV_FORMAT] = fmt
    environ[ENV_LEVEL] = level


def _add_pid(
    logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    event_dict.setdefault("pid", os.getpid())
    return event_dict

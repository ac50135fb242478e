"""Logging set-up for entry points, and the context helpers the library uses.

Library modules only call ``structlog.get_logger(__name__)`` (or ``get_logger``
here) and ``bind_context``; processes call ``configure_logging`` once at start.
structlog events and stdlib records (rq, redis, urllib3 ...) go through the
same processors and one handler on the root logger: a console format on a
terminal, JSON lines otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator, MutableMapping
from typing import Any, TextIO

import structlog
from structlog.typing import Processor

from pipeline.errors import ConfigError

__all__ = [
    "PROGRESS_EVERY_S",
    "Throttle",
    "bind_context",
    "clear_context",
    "configure_logging",
    "get_logger",
    "quiet",
]

get_logger = structlog.get_logger

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


# Libraries whose info records say nothing an operator acts on ("Found credentials in
# environment variables" on every S3 command); shown at debug.
_QUIET_BELOW_DEBUG = ("botocore.credentials",)


class _DeltasyncHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler this module installed, so reconfiguring replaces it."""


def configure_logging(
    level: str = "info", json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Route structlog and stdlib logging to ``stream`` (default stderr).

    ``json=None`` picks the console renderer on a TTY and JSON lines otherwise.
    Calling it again replaces the previous configuration instead of adding a
    second handler.
    """
    try:
        numeric_level = _LEVELS[level.lower()]
    except KeyError:
        raise ConfigError(f"log level {level!r} is not one of {', '.join(_LEVELS)}") from None
    out = stream if stream is not None else sys.stderr
    if json is None:
        json = not _is_tty(out)

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.UnicodeDecoder(),
    ]
    renderer: Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
        # Tracebacks as data, without frame locals (they may hold secrets).
        tracebacks = structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        )
        final: list[Processor] = [tracebacks, renderer]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_is_tty(out))
        final = [renderer]

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            _drop_quiet,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a later configure_logging must reach loggers made earlier.
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = _DeltasyncHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _DeltasyncHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    for name in _QUIET_BELOW_DEBUG:
        quiet = numeric_level > logging.DEBUG
        logging.getLogger(name).setLevel(logging.WARNING if quiet else logging.NOTSET)


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:  # a closed stream
        return False


def bind_context(**values: Any) -> None:
    """Attach key-values (run, version, job_id ...) to every later log line in this context."""
    structlog.contextvars.bind_contextvars(**values)


def clear_context() -> None:
    structlog.contextvars.clear_contextvars()


_QUIET = "deltasync_quiet"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Leave out the log lines of this context (a thread's own): a background warm-up
    runs a whole small run whose lines would read as the process's own."""
    tokens = structlog.contextvars.bind_contextvars(**{_QUIET: True})
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)


def _drop_quiet(
    logger: Any, method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    if event.get(_QUIET):
        raise structlog.DropEvent
    return event


PROGRESS_EVERY_S = 10.0  # long work (uploads, rebuilds, downloads) logs progress this often


class Throttle:
    """Says a progress line is due at most once per ``PROGRESS_EVERY_S`` of long work."""

    def __init__(self) -> None:
        self.seconds = PROGRESS_EVERY_S
        self.started = self.last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

"""Structured logs for the daemons: one JSON object per line on stderr.

`configure_logging(level)` is called once when a daemon starts (again: it replaces
its own handler). Every line carries `timestamp`, `level`, `logger` and `event`,
plus whatever was bound: stdlib `logging.getLogger(...)` records go through the
same processors, so both

    log = logging.getLogger(__name__);  log.info("drained")
    log = structlog.get_logger(__name__); log.info("request started", prompt_tokens=12)

come out as JSON. When stderr is a terminal the lines are rendered for reading instead.

Request correlation: `bind_request_id(id)` puts `request_id` into the context
(structlog.contextvars) of the current task, so every line logged while serving that
request carries it. The router sends it to the engines as gRPC metadata
`x-request-id` (`request_metadata(id)`); the engine servicer binds what it receives
(`request_id_from_context`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

from dualpace.errors import InvalidArgument

REQUEST_ID_METADATA = "x-request-id"  # gRPC metadata keys are lower case


class _DaemonHandler(logging.StreamHandler):
    """Marks the handler this module installed, so a second configure replaces it."""


def parse_level(level: str | int, field: str = "--log-level") -> int:
    if isinstance(level, int):
        return level
    value = logging.getLevelNamesMapping().get(str(level).strip().upper())
    if value is None:
        raise InvalidArgument(field, f"unknown level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return value


def configure_logging(level: str | int = "INFO", stream: TextIO | None = None, json: bool | None = None) -> None:
    """Route structlog and stdlib logging to `stream` (stderr) as JSON lines (console
    rendering when the stream is a TTY, unless `json` says otherwise).
    Raises InvalidArgument("--log-level", ...) for an unknown level."""
    numeric_level = parse_level(level)
    stream = stream if stream is not None else sys.stderr
    if json is None:
        isatty = getattr(stream, "isatty", None)
        json = not (isatty is not None and isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        final: list[Any] = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(default=str)]
    else:
        final = [structlog.dev.ConsoleRenderer()]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = _DaemonHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _DaemonHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric_level)
    logging.captureWarnings(True)  # warnings.warn (torch's, say) as log lines too, not bare stderr text
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def reset_logging() -> bool:
    """Undo configure_logging, if it ran: its handler off the root logger, warnings back to stderr,
    structlog's defaults (an in-process command run by a test must not leave them pointing at a
    closed stream). False where there was nothing to undo. Log levels are the caller's to restore."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if isinstance(h, _DaemonHandler)]
    if not ours:
        return False
    for handler in ours:
        root.removeHandler(handler)
    logging.captureWarnings(False)
    structlog.reset_defaults()
    return True


def get_logger(name: str) -> Any:
    return structlog.stdlib.get_logger(name)


# ----------------------------------------------------------------- request correlation


def bind_request_id(request_id: str | None) -> None:
    """Every line logged from now on in this task (and tasks it creates) carries request_id."""
    if request_id:
        structlog.contextvars.bind_contextvars(request_id=request_id)


def unbind_request_id() -> None:
    # unbind (not a token reset): safe when an async generator is closed from another context
    structlog.contextvars.unbind_contextvars("request_id")


def request_metadata(request_id: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the request id to an engine; empty without one."""
    return ((REQUEST_ID_METADATA, request_id),) if request_id else ()


def request_id_from_context(context: Any) -> str | None:
    """The `x-request-id` a caller sent (None without one, or without a servicer context)."""
    try:
        metadata = context.invocation_metadata()
    except Exception:  # noqa: BLE001 - a test double, or no metadata at all
        return None
    for key, value in metadata or ():
        if key.lower() == REQUEST_ID_METADATA:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return None

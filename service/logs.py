"""structlog set-up: JSON lines by default, a readable console renderer for humans.

Per-message context (``message_id``, ``request_id``) is bound with
``structlog.contextvars`` so every line logged while handling a message carries it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import orjson
import structlog

from service import tracing


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def configure_logging(fmt: str = "json", level: str = "info", trace_ids: bool = False) -> None:
    lvl = logging.getLevelNamesMapping()[level.upper()]
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        *([tracing.log_trace_ids] if trace_ids else []),
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "console":
        processors += [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    else:
        processors += [
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries (botocore, asyncpg) log through stdlib logging; keep them quiet and on stderr.
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr, format="%(message)s")

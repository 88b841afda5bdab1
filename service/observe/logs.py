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
from structlog.tracebacks import ExceptionDictTransformer

from service import secrets
from service.observe import tracing


def _orjson_dumps(obj: Any, default: Any = None) -> str:
    return orjson.dumps(obj, default=default).decode()


def _orjson_dumps_inert(obj: Any, default: Any = None) -> str:
    # JSON escapes C0 controls itself; DEL, C1 and bidi characters it would leave raw.
    return secrets.inert_json(_orjson_dumps(obj, default))


def configure_logging(fmt: str = "json", level: str = "info", trace_ids: bool = False) -> None:
    lvl = logging.getLevelNamesMapping()[level.upper()]
    stamp: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        *([tracing.log_trace_ids] if trace_ids else []),
        *stamp,
    ]
    # Tracebacks without local variables: structlog's dict_tracebacks (and rich, in the
    # console renderer) print every frame's locals, where a DSN or a payload may sit.
    # Then every string of the event is scrubbed of the passwords this process knows.
    render: list[Any]
    if fmt == "console":
        render = [
            structlog.processors.format_exc_info,  # plain text, no locals
            secrets.scrub_event,
            # Message data (request ids, errors) must not drive the operator's terminal.
            secrets.inert_event(keep=("exception",)),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ]
    else:
        render = [
            structlog.processors.ExceptionRenderer(
                ExceptionDictTransformer(show_locals=False)),
            secrets.scrub_event,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps_inert),
        ]
    structlog.configure(
        processors=[*processors, *render],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries (botocore, asyncpg, asyncio) log through stdlib logging: their records go
    # through the same scrubbing, escaping and rendering (a driver's error may quote the
    # DSN, an asyncio "exception was never retrieved" a whole traceback), kept quiet.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *stamp],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
    ))
    handler.set_name(_HANDLER_NAME)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(lvl, logging.WARNING))


_HANDLER_NAME = "sqs-ingest"

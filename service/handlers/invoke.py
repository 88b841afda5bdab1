"""How a handler is called: request-id context, log context, timeout, and the batch form."""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

import structlog

from service.core.messages import Message
from service.core.registry import Registry
from service.core.seams import Batching
from service.handlers.context import request_context
from service.observe import tracing


class HandlerCancelled(Exception):
    """A handler raised ``CancelledError`` while nobody was cancelling its task (a cancelled
    inner task of its own or of a library, re-raised): the handler's failure — counted,
    retried, dead-lettered at the maximum like any other. Let through as a cancellation, it
    would roll the batch back and hand all of it back at once, uncounted, for ever (a hot
    loop that no dead-letter limit ends)."""


class HandlerBaseException(Exception):
    """A handler raised a ``BaseException`` that is not an ``Exception`` — ``SystemExit`` (a
    library's ``sys.exit()``), ``KeyboardInterrupt``, ``GeneratorExit``, a class of its own:
    the handler's failure like any other. Let through, it would end the batch's task with its
    claims held and nothing handed back or counted — and ``SystemExit`` the whole daemon, on
    every delivery. (The daemon's own SIGINT/SIGTERM arrive through the event loop's signal
    handlers, never as an exception inside a handler.)"""


class _OwnBaseExceptions:
    """``with``: a ``CancelledError`` out of the block becomes ``HandlerCancelled`` unless this
    task is really being cancelled (shutdown, a batch given up), which passes unchanged; any
    other ``BaseException`` that is not an ``Exception`` becomes ``HandlerBaseException``."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None or isinstance(exc, Exception):
            return
        if not isinstance(exc, asyncio.CancelledError):
            raise HandlerBaseException(f"handler raised {exc!r}") from exc
        task = asyncio.current_task()
        if task is None or task.cancelling():
            return
        raise HandlerCancelled(f"handler raised CancelledError, not cancelled: {exc!r}") from exc


_own_base_exceptions = _OwnBaseExceptions()


class Invoker:
    """Calls the registered handlers of messages; what ``Store.apply`` is given."""

    def __init__(self, registry: Registry, timeout: float = 0) -> None:
        self.registry = registry
        self.timeout = timeout or None  # 0 = no limit

    async def one(self, m: Message, conn: Any) -> dict[str, Any] | None:
        spec = self.registry.get(m.type)
        assert spec is not None  # parse() guarantees it
        with (
            tracing.handler(m),
            request_context(m.request_id, m.attributes),
            structlog.contextvars.bound_contextvars(
                message_id=m.raw.message_id, request_id=m.request_id),
            _own_base_exceptions,
        ):
            async with asyncio.timeout(self.timeout):
                return await spec.fn(m.payload, conn)

    def key(self, m: Message) -> object:
        """Messages with the same key may share one batch call (None: never)."""
        spec = self.registry.get(m.type)
        return spec.batch_fn if spec is not None else None

    async def many(self, ms: list[Message], conn: Any) -> list[dict[str, Any] | None] | None:
        spec = self.registry.get(ms[0].type)
        assert spec is not None and spec.batch_fn is not None
        with tracing.handlers(ms), _own_base_exceptions:
            async with asyncio.timeout(self.timeout):
                return await spec.batch_fn([(m.request_id, m.payload) for m in ms], conn)

    @property
    def batching(self) -> Batching:
        return (self.key, self.many)

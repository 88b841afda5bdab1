"""The handler registry: message ``type`` → (pydantic model, async function)."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)
#: The ``asyncpg.Connection`` of the handler's transaction. Named, not imported: service.core
#: imports no driver (asyncpg ships no type information, so mypy saw ``Any`` there anyway).
Connection = Any
HandlerFn = Callable[[Any, Connection], Awaitable[dict[str, Any] | None]]
#: Batch form: [(request_id, payload), …] → results in the same order, or None to decline
#: (the attempt is rolled back, then the messages run one by one through the plain function).
BatchFn = Callable[
    [list[tuple[str, Any]], Connection], Awaitable[list[dict[str, Any] | None] | None]
]


@dataclass(frozen=True)
class HandlerSpec:
    name: str
    model: type[BaseModel]
    fn: HandlerFn
    batch_fn: BatchFn | None = None


class Registry:
    def __init__(self) -> None:
        self._specs: dict[str, HandlerSpec] = {}

    def register(self, type_: str, model: type[BaseModel], fn: HandlerFn) -> None:
        existing = self._specs.get(type_)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"handler for {type_!r} registered twice")
        self._specs[type_] = HandlerSpec(type_, model, fn)

    def register_batch(self, type_: str, fn: BatchFn) -> None:
        spec = self._specs.get(type_)
        if spec is None:
            raise ValueError(f"register the handler for {type_!r} before its batch form")
        self._specs[type_] = dataclasses.replace(spec, batch_fn=fn)

    def get(self, type_: str) -> HandlerSpec | None:
        return self._specs.get(type_)

    def types(self) -> list[str]:
        return sorted(self._specs)

    def __contains__(self, type_: str) -> bool:
        return type_ in self._specs


#: The process-wide registry the ``@handler`` decorator writes to.
default_registry = Registry()


def handler(type_: str, model: type[M]) -> Callable[[HandlerFn], HandlerFn]:
    """Register ``fn`` as the handler of messages whose ``type`` is ``type_``.

    The function runs inside the transaction that marks the request COMPLETED; what it
    returns is stored as ``modifications.result``. A payload failing ``model`` is a poison
    message; an exception from the function is transient (retried, then dead-lettered).
    """

    def register(fn: HandlerFn) -> HandlerFn:
        default_registry.register(type_, model, fn)
        return fn

    return register


def batch_handler(*types: str) -> Callable[[BatchFn], BatchFn]:
    """Optional batch form of already registered handlers (one call for many messages).

    Messages of all ``types`` given share a batch. It must have exactly the effect of
    calling the plain handlers one by one; returning None declines (say, for a case it
    does not handle): the transaction is rolled back — what it wrote is undone — and
    they run one by one. If it raises, the transaction is rerun one message at a time to
    find the failing one.
    """

    def register(fn: BatchFn) -> BatchFn:
        for t in types:
            default_registry.register_batch(t, fn)
        return fn

    return register


def load_handler_modules(modules: list[str]) -> None:
    """Import user modules named by INGEST_HANDLERS; their decorators register handlers."""
    for name in modules:
        importlib.import_module(name)

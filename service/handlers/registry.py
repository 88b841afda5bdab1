"""The handler registry: message ``type`` → (pydantic model, async function)."""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)
HandlerFn = Callable[[Any, asyncpg.Connection], Awaitable[dict[str, Any] | None]]


@dataclass(frozen=True)
class HandlerSpec:
    name: str
    model: type[BaseModel]
    fn: HandlerFn


class Registry:
    def __init__(self) -> None:
        self._specs: dict[str, HandlerSpec] = {}

    def register(self, type_: str, model: type[BaseModel], fn: HandlerFn) -> None:
        existing = self._specs.get(type_)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"handler for {type_!r} registered twice")
        self._specs[type_] = HandlerSpec(type_, model, fn)

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


def load_handler_modules(modules: list[str]) -> None:
    """Import user modules named by INGEST_HANDLERS; their decorators register handlers."""
    for name in modules:
        importlib.import_module(name)

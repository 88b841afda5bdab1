"""Public extension point: ``from service.handlers import handler``."""

from __future__ import annotations

import contextvars

from service.handlers.registry import (
    HandlerSpec,
    Registry,
    batch_handler,
    default_registry,
    handler,
    load_handler_modules,
)

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def current_request_id() -> str:
    """The ``request_id`` of the message whose handler is running."""
    return _request_id.get()


def load_reference_handlers() -> None:
    import service.handlers.entities  # noqa: F401  (registers entity.upsert / entity.delete)


__all__ = [
    "HandlerSpec",
    "Registry",
    "batch_handler",
    "current_request_id",
    "default_registry",
    "handler",
    "load_handler_modules",
    "load_reference_handlers",
]

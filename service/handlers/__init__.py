"""The public surface for handler authors: ``from service.handlers import handler``, the
batch form, the request's context (``current_request_id``, ``current_attributes``) and the
payload field types ``IndexedText`` and ``Int64`` (what PostgreSQL accepts, checked at the
door). With ``service.testing`` (the test kit) this is everything a handler author imports;
every other module of ``service`` is internal."""

from __future__ import annotations

from service.core.limits import IndexedText, Int64
from service.core.registry import (
    HandlerConflict,
    HandlerLoadError,
    HandlerSpec,
    Registry,
    TypedHandlerFn,
    batch_handler,
    default_registry,
    handler,
    load_handler_modules,
)
from service.handlers.context import current_attributes, current_request_id, request_context


def load_reference_handlers() -> None:
    # Deferred on purpose: importing the module registers entity.upsert / entity.delete in
    # the default registry, which only ``sqs-ingest run`` (and tests that ask) want.
    import service.handlers.entities  # noqa: F401  (registers entity.upsert / entity.delete)


__all__ = [
    "HandlerConflict",
    "HandlerLoadError",
    "HandlerSpec",
    "IndexedText",
    "Int64",
    "Registry",
    "TypedHandlerFn",
    "batch_handler",
    "current_attributes",
    "current_request_id",
    "default_registry",
    "handler",
    "load_handler_modules",
    "load_reference_handlers",
    "request_context",
]

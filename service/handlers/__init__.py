"""Public extension point: ``from service.handlers import handler``.

The handler API (``handler``, ``batch_handler``, ``Registry``, ``current_request_id``, the
payload field types ``IndexedText`` and ``Int64`` from service.core.limits; the
registry itself lives in service.core.registry, which the pure parser reads), how the runtime
calls a handler (invoke) and the reference entity handlers (entities). It may import
service.observe, service.core and the foundation; the runtime, the app and the test kit
import it.
"""

from __future__ import annotations

from service.core.limits import IndexedText, Int64
from service.core.registry import (
    HandlerSpec,
    Registry,
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
    "HandlerSpec",
    "IndexedText",
    "Int64",
    "Registry",
    "batch_handler",
    "current_attributes",
    "current_request_id",
    "default_registry",
    "handler",
    "load_handler_modules",
    "load_reference_handlers",
    "request_context",
]

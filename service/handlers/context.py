"""The request-id context: which request's handler is running (``current_request_id``)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def current_request_id() -> str:
    """The ``request_id`` of the message whose handler is running."""
    return _request_id.get()


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Run a handler call with ``current_request_id()`` answering ``request_id``."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)

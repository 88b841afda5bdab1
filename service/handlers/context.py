"""The request-id context: which request's handler is running (``current_request_id``)."""

from __future__ import annotations

import contextvars

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


def current_request_id() -> str:
    """The ``request_id`` of the message whose handler is running."""
    return _request_id.get()


class request_context:  # lower case: used like a function, ``with request_context(r):``
    """Run a handler call with ``current_request_id()`` answering ``request_id``.

    A class rather than ``@contextmanager``: it runs once per message on the hot path."""

    __slots__ = ("_request_id", "_token")

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id

    def __enter__(self) -> None:
        self._token = _request_id.set(self._request_id)

    def __exit__(self, *exc: object) -> None:
        _request_id.reset(self._token)

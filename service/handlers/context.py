"""The request context: which request's handler is running (``current_request_id``) and
the message attributes it came with (``current_attributes``)."""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from types import MappingProxyType

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
_NONE: Mapping[str, Mapping[str, str]] = MappingProxyType({})
_attributes: contextvars.ContextVar[Mapping[str, Mapping[str, str]]] = contextvars.ContextVar(
    "attributes", default=_NONE)


def current_request_id() -> str:
    """The ``request_id`` of the message whose handler is running."""
    return _request_id.get()


def current_attributes() -> Mapping[str, Mapping[str, str]]:
    """The message attributes of the message whose handler is running — its SQS message
    attributes and those of the SNS envelope it came in — as SQS returns them::

        {"tenant": {"DataType": "String", "StringValue": "acme"}}

    Empty when it had none (and in a batch handler, which handles several messages)."""
    return _attributes.get()


class request_context:  # lower case: used like a function, ``with request_context(r):``
    """Run a handler call with ``current_request_id()`` answering ``request_id``.

    A class rather than ``@contextmanager``: it runs once per message on the hot path."""

    __slots__ = ("_attributes", "_request_id", "_token", "_token_attributes")

    def __init__(
        self, request_id: str, attributes: Mapping[str, Mapping[str, str]] | None = None
    ) -> None:
        self._request_id = request_id
        self._attributes = attributes

    def __enter__(self) -> None:
        self._token = _request_id.set(self._request_id)
        # Only a message that has attributes pays for the second variable.
        if self._attributes is not None:
            self._token_attributes = _attributes.set(self._attributes)

    def __exit__(self, *exc: object) -> None:
        _request_id.reset(self._token)
        if self._attributes is not None:
            _attributes.reset(self._token_attributes)

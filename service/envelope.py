"""Where a message's request_id, type and payload are read from: the standard envelope
``{"request_id", "type", "payload"}`` by default, or an existing producer's layout (a dotted
path into the body, a message attribute, a constant type per queue). A leaf: values only.
``service.core.messages`` applies it; the hostile-input checks run on the mapped fields."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Source:
    """Where one envelope field is read from: a dotted ``path`` into the body document
    (``()``: the whole document), a message ``attribute`` (SQS, or the SNS envelope's), or a
    ``constant``."""

    path: tuple[str, ...] | None = None
    attribute: str | None = None
    constant: str | None = None

    @classmethod
    def parse(cls, spec: str, *, constant_allowed: bool = False) -> Source:
        """``a.b`` (a path), ``.`` (the whole document), ``attribute:NAME``, ``const:VALUE``
        (where ``constant_allowed``); ValueError says what is accepted."""
        kind, _, rest = spec.partition(":")
        if rest and kind == "attribute":
            return cls(attribute=rest)
        if rest and kind == "const":
            if not constant_allowed:
                raise ValueError(f"{spec!r}: a constant is allowed for the type only")
            return cls(constant=rest)
        if spec == ".":
            return cls(path=())
        parts = tuple(spec.split("."))
        if not spec or ":" in spec or not all(parts):
            raise ValueError(f"{spec!r} is not a dotted path (a.b), '.', attribute:NAME"
                             + (" or const:VALUE" if constant_allowed else ""))
        return cls(path=parts)

    def read(self, doc: Any, attributes: Mapping[str, Any] | None, sns: Any) -> Any:
        """This field of a message: ``doc`` its decoded body, ``attributes`` its SQS
        message attributes, ``sns`` the SNS notification it came in (or None)."""
        if self.constant is not None:
            return self.constant
        if self.attribute is not None:
            return _attribute(self.attribute, attributes, sns)
        value = doc
        for key in self.path or ():
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return value


@dataclass(frozen=True, slots=True)
class Envelope:
    """Where request_id, type and payload come from. The default is the standard envelope
    ``{"request_id", "type", "payload"}``; an existing producer's messages can be mapped
    instead (INGEST_ENVELOPE_REQUEST_ID, INGEST_ENVELOPE_TYPE, INGEST_ENVELOPE_PAYLOAD)."""

    request_id: Source = Source(path=("request_id",))
    type: Source = Source(path=("type",))
    payload: Source = Source(path=("payload",))

    @classmethod
    def from_specs(cls, request_id: str, type_: str, payload: str) -> Envelope:
        return cls(Source.parse(request_id), Source.parse(type_, constant_allowed=True),
                   Source.parse(payload))

    @property
    def standard(self) -> bool:
        return self == STANDARD_ENVELOPE


STANDARD_ENVELOPE = Envelope()


def _attribute(name: str, attributes: Mapping[str, Any] | None, envelope: Any) -> str | None:
    """A String/Number message attribute: the SQS message's, else the SNS envelope's."""
    found = (attributes or {}).get(name)
    if isinstance(found, dict) and isinstance(found.get("StringValue"), str):
        return str(found["StringValue"])
    sns = envelope.get("MessageAttributes") if isinstance(envelope, dict) else None
    found = sns.get(name) if isinstance(sns, dict) else None
    if isinstance(found, dict) and isinstance(found.get("Value"), str):
        return str(found["Value"])
    return None

"""Message attributes kept with a request (``modifications.message_attributes``): the SQS
message's own and those of the SNS envelope it came in, in one shape.

Stored as SQS returns them, so operators and handlers read one familiar form::

    {"tenant": {"DataType": "String", "StringValue": "acme"},
     "blob":   {"DataType": "Binary", "BinaryValue": "<base64>"}}

An SNS envelope's ``{"Type": T, "Value": V}`` becomes ``{"DataType": T, "StringValue": V}``
(``BinaryValue`` for a Binary, whose envelope value is base64 already). Where both carry a
name (not seen in practice: raw delivery moves the SNS attributes onto the SQS message and
drops the envelope), the SQS attribute wins.
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from service.core.limits import storable

Attributes = dict[str, dict[str, str]]


def collect(sqs: dict[str, Any] | None, envelope: Any) -> Attributes | None:
    """The attributes of one message, or None when it has none (the common case costs two
    truth tests)."""
    if not sqs and not envelope:
        return None
    out: Attributes = {}
    if isinstance(envelope, dict):
        for name, a in envelope.items():
            if isinstance(a, dict) and isinstance(a.get("Type"), str) \
                    and isinstance(a.get("Value"), str):
                kind = "BinaryValue" if a["Type"].startswith("Binary") else "StringValue"
                out[_text(name)] = {"DataType": _text(a["Type"]), kind: _text(a["Value"])}
    for name, a in (sqs or {}).items():
        dtype = str(a.get("DataType", "String"))
        if "BinaryValue" in a:
            raw = a["BinaryValue"]
            value = base64.b64encode(raw).decode() if isinstance(raw, bytes | bytearray) \
                else str(raw)
            out[name] = {"DataType": dtype, "BinaryValue": value}
        else:
            out[name] = {"DataType": dtype, "StringValue": _text(str(a.get("StringValue", "")))}
    return out or None


def encode(attributes: Attributes | None) -> str | None:
    """The ``jsonb`` text stored with the claim (None: SQL NULL)."""
    return orjson.dumps(attributes).decode() if attributes else None


def _text(value: object) -> str:
    # jsonb cannot hold U+0000; an envelope in a body is whatever the producer wrote.
    return storable(value) if isinstance(value, str) else str(value)

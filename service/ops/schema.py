"""What a producer may send: the JSON Schema of a message body (`sqs-ingest schema`) and the
list of registered types (`sqs-ingest handlers`), both read from the handler registry.

The schema is one document a producer validates a body against before sending it: the
envelope (service.core.messages.parse's rules that a schema can express) and, per registered
``type``, that type's pydantic payload model. A body it rejects would be dead-lettered; a body
it accepts passes the daemon's validation (the models are the same objects). The daemon's
pydantic models also coerce in lax mode (e.g. ``"5"`` for an ``int``); the schema describes the
JSON types only, so it is the stricter of the two.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from service.core.limits import INDEXED_TEXT_MAX_CHARS, TYPE_MAX_CHARS
from service.core.registry import Registry

DIALECT = "https://json-schema.org/draft/2020-12/schema"
#: parse() refuses a request_id or type holding a character SQS and SNS refuse (NUL, the
#: other control characters but tab, LF and CR, U+FFFE, U+FFFF): its result could never be
#: published (``service.core.limits.unsendable``).
_NO_NUL = "^[^\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]*$"


def envelope_schema(types: list[str]) -> dict[str, Any]:
    """The envelope's own rules (service.core.messages.parse), ``type`` limited to ``types``."""
    return {
        "type": "object",
        "required": ["request_id", "type", "payload"],
        "properties": {
            "request_id": {
                "type": "string", "minLength": 1, "maxLength": INDEXED_TEXT_MAX_CHARS,
                "pattern": _NO_NUL,
                "description": "Idempotency key: a request_id is applied once; the same "
                "request_id with a different payload is dead-lettered (idempotency_key_reused)",
            },
            "type": {
                "type": "string", "minLength": 1, "maxLength": TYPE_MAX_CHARS,
                "pattern": _NO_NUL, "enum": types,
                "description": "A registered handler type (sqs-ingest handlers)",
            },
            "payload": {"type": "object", "description": "Validated by the type's model"},
            "sent_at": {
                "anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}],
                "description": "RFC 3339 time the producer sent the request (optional)",
            },
        },
    }


def document(registry: Registry) -> dict[str, Any]:
    """One JSON Schema (draft 2020-12) for a body of any registered type.

    ``$defs`` holds each payload model's schema; ``x-payloads`` maps each type to its model's
    ``$ref``, and ``allOf`` applies the model of the body's ``type`` to its ``payload``.
    """
    types = registry.types()
    specs = [registry.get(t) for t in types]
    models = {s.model for s in specs if s is not None}
    refs, top = models_json_schema(
        [(m, "validation") for m in sorted(models, key=lambda m: m.__qualname__)],
        ref_template="#/$defs/{model}",
    )
    payloads: dict[str, Any] = {}
    rules: list[dict[str, Any]] = []
    for t, spec in zip(types, specs, strict=True):
        assert spec is not None  # types() lists registered types only
        ref = refs[(spec.model, "validation")]
        payloads[t] = ref
        rules.append({
            "if": {"properties": {"type": {"const": t}}, "required": ["type"]},
            "then": {"properties": {"payload": ref}},
        })
    doc: dict[str, Any] = {
        "$schema": DIALECT,
        "title": "sqs-ingest message body",
        "description": "A body SQS delivers to sqs-ingest (an SNS Notification envelope is "
        "unwrapped first: validate its Message). Payloads larger than SQS allows go through "
        "S3 pointers (README 'Large payloads'); the payload read from S3 is validated the same.",
        **envelope_schema(types),
        "x-payloads": payloads,
    }
    if rules:
        doc["allOf"] = rules
    doc["$defs"] = top.get("$defs", {})
    return doc


def handler_lines(registry: Registry) -> list[str]:
    """One line per registered type: type, payload model, handler function, batch form."""
    lines = []
    for t in registry.types():
        spec = registry.get(t)
        assert spec is not None
        fn = f"{spec.fn.__module__}.{spec.fn.__qualname__}"
        model = f"{spec.model.__module__}.{spec.model.__qualname__}"
        batch = ""
        if spec.batch_fn is not None:
            batch = f"  batch={spec.batch_fn.__module__}.{spec.batch_fn.__qualname__}"
        lines.append(f"{t}  model={model}  handler={fn}{batch}")
    return lines

"""Envelope parsing: a raw SQS body becomes a Message or a Poison, never an exception."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from service.core import attributes
from service.core.limits import (
    INDEXED_TEXT_MAX_CHARS,
    MAX_JSON_VALUES,
    TYPE_MAX_CHARS,
    json_holds_nul,
    json_values,
    unsendable,
)
from service.core.pointers import Fetched, Pointer
from service.core.registry import Registry
from service.envelope import STANDARD_ENVELOPE, Envelope


@dataclass(frozen=True, slots=True)
class Received:
    """One SQS message as received, before parsing."""

    message_id: str
    receipt_handle: str
    body: str
    receive_count: int = 1
    sent_timestamp: float | None = None  # epoch seconds
    group_id: str | None = None
    # FIFO: SQS's SequenceNumber (rises within a group; the order the daemon enforces).
    sequence_number: int | None = None
    # Read only while tracing is on (service.observe.tracing): the string message attributes
    # (W3C traceparent/tracestate) and the AWSTraceHeader system attribute.
    attributes: dict[str, str] | None = field(default=None, hash=False, compare=False)
    trace_header: str | None = None
    # The SQS MessageAttributes as received (None: the message has none).
    message_attributes: dict[str, Any] | None = field(default=None, hash=False, compare=False)


@dataclass(slots=True)
class Message:
    raw: Received
    request_id: str
    type: str
    payload: BaseModel
    payload_json: dict[str, Any]
    payload_sha256: str
    sent_at: datetime | None = None
    failures: int = 0  # earlier handler failures, from the claim
    # SQS + SNS-envelope message attributes (service.core.attributes), and their jsonb text.
    attributes: dict[str, dict[str, str]] | None = None
    attributes_json: str | None = None
    pointer: Pointer | None = None  # where the payload was read from (S3), if offloaded
    # The token of the claim made for this very message (``service.adapters.store.claim`` draws it
    # before its statement runs): a release deletes only the row carrying it, never a claim
    # another batch made for a redelivery of the same SQS message.
    claim_token: str | None = field(default=None, compare=False)


@dataclass(slots=True)
class Poison:
    raw: Received
    reason: str
    error: str
    request_id: str | None = None
    type: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def canonical_json(value: Any) -> bytes:
    """Key-sorted compact JSON: equal payloads hash equal whatever their key order."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def payload_hash(payload: Any) -> str:
    return hashlib.sha256(canonical_json(payload)).hexdigest()


def parse(raw: Received, registry: Registry, fetched: Fetched | None = None) -> Message | Poison:
    """Validate one body — or, for a body that points to S3, the payload ``fetched`` from
    there (a Poison still carries the pointer body). Every way a body can be wrong is a
    Poison with a reason."""
    limit = registry.max_json_values or MAX_JSON_VALUES
    read = _document(raw, fetched, limit)
    if isinstance(read, Poison):
        return read
    doc, envelope = read
    mapping = registry.envelope if isinstance(registry.envelope, Envelope) else STANDARD_ENVELOPE
    fields = _fields(raw, doc if mapping.standard else _mapped(mapping, doc, raw, envelope))
    if isinstance(fields, Poison):
        return fields
    request_id, mtype, payload, sent_at = fields
    canonical = _canonical(raw, payload, request_id, mtype)
    if isinstance(canonical, Poison):
        return canonical
    spec = registry.get(mtype)
    if spec is None:
        return Poison(raw, "unknown_type", f"no handler for type {mtype!r}", request_id, mtype)
    try:
        model = spec.model.model_validate(payload)
    except ValidationError as exc:
        return Poison(raw, "invalid_payload", _short(exc), request_id, mtype)
    m = Message(raw, request_id, mtype, model, payload, hashlib.sha256(canonical).hexdigest(),
                sent_at)
    if raw.message_attributes or envelope is not None:
        m.attributes = attributes.collect(
            raw.message_attributes,
            envelope.get("MessageAttributes") if isinstance(envelope, dict) else None)
        m.attributes_json = attributes.encode(m.attributes)
    if fetched is not None:
        m.pointer = fetched.pointer
    return m


def _document(raw: Received, fetched: Fetched | None,
              limit: int) -> tuple[Any, Any] | Poison:
    """(the decoded document, its envelope: the pointer's or the SNS notification's).
    A text of more than ``limit`` JSON values is not parsed: its objects would hold
    dozens of times its size in memory until the batch ends (an SNS notification's
    ``Message`` is counted within the body)."""
    envelope: Any = None
    text: str | bytes | bytearray = fetched.data if fetched is not None else raw.body
    values = json_values(text)
    if values > limit:
        where = f"{fetched.pointer.uri}: " if fetched is not None else ""
        return Poison(raw, "payload_too_complex",
                      f"{where}{values} JSON values (counted by their {{ [ , characters, "
                      f"strings included), INGEST_MAX_JSON_VALUES is {limit}")
    if fetched is not None:
        envelope = fetched.pointer.envelope
        try:
            doc = orjson.loads(fetched.data)
        except orjson.JSONDecodeError as exc:
            return Poison(raw, "invalid_json", f"{fetched.pointer.uri}: {exc}")
    else:
        try:
            doc = orjson.loads(raw.body)
        except orjson.JSONDecodeError as exc:
            return Poison(raw, "invalid_json", str(exc))
    if fetched is None and isinstance(doc, dict) and doc.get("Type") == "Notification" \
            and "Message" in doc:
        envelope = doc
        inner = doc["Message"]
        if not isinstance(inner, str):
            return Poison(raw, "invalid_envelope", "SNS Message is not a string")
        try:
            doc = orjson.loads(inner)
        except orjson.JSONDecodeError as exc:
            return Poison(raw, "invalid_json", f"SNS Message: {exc}")
    return doc, envelope


def _mapped(mapping: Envelope, doc: Any, raw: Received, envelope: Any) -> Any:
    """The standard envelope of a document read through ``mapping``: the checks of
    ``_fields`` (types, NUL, lengths) then apply to the mapped fields as to any other."""
    if not isinstance(doc, dict):
        return doc  # _fields says what is wrong with it
    attrs = raw.message_attributes
    request_id = mapping.request_id.read(doc, attrs, envelope)
    if isinstance(request_id, int) and not isinstance(request_id, bool):
        request_id = str(request_id)  # a producer's numeric key (order 1234)
    return {"request_id": request_id, "type": mapping.type.read(doc, attrs, envelope),
            "payload": mapping.payload.read(doc, attrs, envelope),
            "sent_at": doc.get("sent_at")}


def _fields(
    raw: Received, doc: Any,
) -> tuple[str, str, dict[str, Any], datetime | None] | Poison:
    """(request_id, type, payload, sent_at) of a decoded document."""
    if not isinstance(doc, dict):
        kind = type(doc).__name__
        return Poison(raw, "invalid_envelope", f"body is a JSON {kind}, not an object")
    request_id, mtype, payload = doc.get("request_id"), doc.get("type"), doc.get("payload")
    if not isinstance(request_id, str) or not request_id:
        return Poison(raw, "missing_request_id", "request_id must be a non-empty string")
    # Checked before any poison that keeps the request_id: it would be the request_id
    # attribute (and the body) of a result SQS and SNS refuse, and PostgreSQL text cannot
    # hold NUL. Such a poison keeps no request_id, so no result is written for it.
    if (bad := _unsendable(request_id, "request_id")) is not None:
        return Poison(raw, "invalid_envelope", bad)
    if not isinstance(mtype, str) or not mtype:
        return Poison(raw, "missing_type", "type must be a non-empty string", request_id)
    if (bad := _unsendable(mtype, "type")) is not None:
        return Poison(raw, "invalid_envelope", bad)
    if not isinstance(payload, dict):
        return Poison(raw, "invalid_payload", "payload must be a JSON object", request_id, mtype)
    sent_at: datetime | None = None
    if "sent_at" in doc and doc["sent_at"] is not None:
        try:
            sent_at = _rfc3339(str(doc["sent_at"]))
        except ValueError as exc:
            return Poison(raw, "invalid_envelope", f"sent_at: {exc}", request_id, mtype)
    if len(request_id) > INDEXED_TEXT_MAX_CHARS:
        # A unique-index entry that large fails the whole batch's claim statement.
        return Poison(raw, "request_id_too_long",
                      f"request_id has {len(request_id)} characters, at most "
                      f"{INDEXED_TEXT_MAX_CHARS} are accepted")
    if len(mtype) > TYPE_MAX_CHARS:
        return Poison(raw, "type_too_long",
                      f"type has {len(mtype)} characters, at most {TYPE_MAX_CHARS} are accepted",
                      request_id)
    return request_id, mtype, payload, sent_at


def _unsendable(text: str, name: str) -> str | None:
    bad = unsendable(text)
    if bad is None:
        return None
    if bad == "\x00":
        return "request_id/type contain a NUL character"
    return f"{name} contains U+{ord(bad):04X}, a character SQS and SNS refuse"


def _rfc3339(text: str) -> datetime:
    """RFC 3339 allows the UTC designator in either case (section 5.6); fromisoformat only
    takes an upper-case one."""
    if text.endswith("z"):
        text = text[:-1] + "Z"
    return datetime.fromisoformat(text)


def _canonical(raw: Received, payload: dict[str, Any], request_id: str,
               mtype: str) -> bytes | Poison:
    """The payload's key-sorted JSON (its hash is the payload_sha256), if it can be stored."""
    try:
        canonical = canonical_json(payload)
    except orjson.JSONEncodeError as exc:
        # orjson reads 1,024 levels of nesting but writes only 254: without this a payload
        # between the two would raise out of parse() and fail its whole batch.
        return Poison(raw, "invalid_payload", f"payload cannot be stored: {exc}",
                      request_id, mtype)
    if json_holds_nul(canonical):
        # PostgreSQL's jsonb cannot store U+0000: it would fail the whole batch's claim.
        return Poison(raw, "invalid_payload", "payload contains a NUL character (\\u0000)",
                      request_id, mtype)
    return canonical


def _short(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "payload"
        parts.append(f"{loc}: {e['msg']}")
    return "; ".join(parts)

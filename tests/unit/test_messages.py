from __future__ import annotations

import json
from typing import Any

import pytest

from service.core.messages import Message, Poison, Received, parse, payload_hash
from service.handlers import Registry
from service.handlers.entities import EntityDelete, EntityUpsert, entity_delete, entity_upsert


@pytest.fixture
def registry() -> Registry:
    r = Registry()
    r.register("entity.upsert", EntityUpsert, entity_upsert)
    r.register("entity.delete", EntityDelete, entity_delete)
    return r


def raw(body: str) -> Received:
    return Received("mid-1", "rh-1", body, 1, 1700000000.0, None)


def upsert(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "request_id": "r1",
        "type": "entity.upsert",
        "payload": {"entity_id": "e1", "version": 3, "data": {"a": 1}},
    }
    doc.update(over)
    return doc


def test_valid_message(registry: Registry) -> None:
    m = parse(raw(json.dumps(upsert(sent_at="2026-01-02T03:04:05Z"))), registry)
    assert isinstance(m, Message)
    assert (m.request_id, m.type) == ("r1", "entity.upsert")
    assert isinstance(m.payload, EntityUpsert) and m.payload.version == 3
    assert m.sent_at is not None and m.sent_at.year == 2026 and m.sent_at.utcoffset() is not None


def test_sns_envelope_is_unwrapped(registry: Registry) -> None:
    inner = json.dumps(upsert())
    body = json.dumps({"Type": "Notification", "MessageId": "x", "Message": inner})
    m = parse(raw(body), registry)
    assert isinstance(m, Message)
    assert m.request_id == "r1"
    assert m.raw.body == body  # the raw body is kept as received


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("not json", "invalid_json"),
        ("", "invalid_json"),
        ("[1, 2]", "invalid_envelope"),
        ('"a string"', "invalid_envelope"),
        (json.dumps({"Type": "Notification", "Message": "{not json"}), "invalid_json"),
        (json.dumps({"Type": "Notification", "Message": {"a": 1}}), "invalid_envelope"),
        (json.dumps({"type": "entity.upsert", "payload": {}}), "missing_request_id"),
        (json.dumps(upsert(request_id="")), "missing_request_id"),
        (json.dumps(upsert(request_id=7)), "missing_request_id"),
        (json.dumps({"request_id": "r", "payload": {}}), "missing_type"),
        (json.dumps(upsert(type="no.such")), "unknown_type"),
        (json.dumps(upsert(payload=[1])), "invalid_payload"),
        (json.dumps(upsert(payload={"entity_id": "e"})), "invalid_payload"),
        (json.dumps(upsert(payload={"entity_id": "e", "version": "3", "data": {}})),
         "invalid_payload"),
        (json.dumps(upsert(sent_at="yesterday")), "invalid_envelope"),
        (json.dumps(upsert(payload={"entity_id": "e\u0000", "version": 1, "data": {}})),
         "invalid_payload"),
        (json.dumps(upsert(request_id="a\u0000b")), "invalid_envelope"),
    ],
)
def test_poison_shapes(registry: Registry, body: str, reason: str) -> None:
    p = parse(raw(body), registry)
    assert isinstance(p, Poison), p
    assert p.reason == reason
    assert p.raw.body == body
    assert p.error


def test_payload_hash_ignores_key_order() -> None:
    assert payload_hash({"a": 1, "b": [1, 2]}) == payload_hash({"b": [1, 2], "a": 1})
    assert payload_hash({"a": 1}) != payload_hash({"a": 2})


def test_invalid_payload_error_names_each_field_and_stops_at_five(registry: Registry) -> None:
    """dead_letters.error for a payload that fails its model: "field: message" per error,
    "; "-joined, nested locations dotted, a whole-payload error named "payload", at most 5."""
    bad = {"entity_id": 5, "version": "x", "data": {"a": 1}}
    p = parse(raw(json.dumps(upsert(payload=bad))), registry)
    assert isinstance(p, Poison) and p.reason == "invalid_payload"
    assert p.error == ("entity_id: Input should be a valid string; "
                       "version: Input should be a valid integer")
    from pydantic import BaseModel, model_validator

    class Whole(BaseModel):
        lo: int
        hi: int

        @model_validator(mode="after")
        def ordered(self) -> Whole:
            if self.lo > self.hi:
                raise ValueError("lo above hi")
            return self

    class Six(BaseModel):
        a: int
        b: int
        c: int
        d: int
        e: int
        f: int

    class Nested(BaseModel):
        inner: Six

    r = Registry()
    r.register("six", Six, entity_upsert)
    r.register("nested", Nested, entity_upsert)
    r.register("whole", Whole, entity_upsert)
    p = parse(raw(json.dumps({"request_id": "r", "type": "whole",
                              "payload": {"lo": 2, "hi": 1}})), r)
    assert isinstance(p, Poison) and p.error == "payload: Value error, lo above hi"
    p = parse(raw(json.dumps({"request_id": "r", "type": "six", "payload": {}})), r)
    assert isinstance(p, Poison)
    assert p.error == "; ".join(f"{k}: Field required" for k in "abcde")
    p = parse(raw(json.dumps({"request_id": "r", "type": "nested",
                              "payload": {"inner": {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}}})), r)
    assert isinstance(p, Poison) and p.error == "inner.f: Field required"


# -- every field of a Poison, exactly (they become dead_letters.reason/error/request_id/
# request_type, and a FAILED result for the request when results are on) --------------

def decode_error(text: str) -> str:
    """The decoder's own message for ``text`` (what dead_letters.error carries)."""
    import orjson

    try:
        orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return str(exc)
    raise AssertionError(f"{text!r} decodes")


def nested(depth: int) -> dict[str, object]:
    doc: dict[str, object] = {}
    inner = doc
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]  # type: ignore[assignment]
    return doc


LONG_ID = "r" * 513  # INDEXED_TEXT_MAX_CHARS + 1
LONG_TYPE = "t" * 257  # TYPE_MAX_CHARS + 1

EXACT_POISON = [
    ("not json", "invalid_json", decode_error("not json"), None, None),
    (json.dumps({"Type": "Notification", "Message": "{not json"}), "invalid_json",
     "SNS Message: " + decode_error("{not json"), None, None),
    (json.dumps({"Type": "Notification", "Message": {"a": 1}}), "invalid_envelope",
     "SNS Message is not a string", None, None),
    ("[1, 2]", "invalid_envelope", "body is a JSON list, not an object", None, None),
    ('"s"', "invalid_envelope", "body is a JSON str, not an object", None, None),
    (json.dumps(upsert(request_id="")), "missing_request_id",
     "request_id must be a non-empty string", None, None),
    (json.dumps(upsert(type="")), "missing_type", "type must be a non-empty string", "r1", None),
    (json.dumps(upsert(type=7)), "missing_type", "type must be a non-empty string", "r1", None),
    (json.dumps(upsert(payload=[1])), "invalid_payload", "payload must be a JSON object",
     "r1", "entity.upsert"),
    (json.dumps(upsert(sent_at="yesterday")), "invalid_envelope",
     "sent_at: Invalid isoformat string: 'yesterday'", "r1", "entity.upsert"),
    (json.dumps(upsert(request_id="a\u0000b")), "invalid_envelope",
     "request_id/type contain a NUL character", None, None),
    (json.dumps(upsert(type="entity.upsert\u0000")), "invalid_envelope",
     "request_id/type contain a NUL character", None, None),
    # SQS and SNS refuse these in the result's request_id attribute (and its body): no
    # request_id is kept, so no result is written that could never be published.
    (json.dumps(upsert(request_id="x\u0001")), "invalid_envelope",
     "request_id contains U+0001, a character SQS and SNS refuse", None, None),
    (json.dumps(upsert(request_id="x\uffff", type=7)), "invalid_envelope",
     "request_id contains U+FFFF, a character SQS and SNS refuse", None, None),
    (json.dumps(upsert(request_id="x\u001b[31m", payload=[1])), "invalid_envelope",
     "request_id contains U+001B, a character SQS and SNS refuse", None, None),
    (json.dumps(upsert(type="nope\ufffe")), "invalid_envelope",
     "type contains U+FFFE, a character SQS and SNS refuse", None, None),
    (json.dumps(upsert(request_id=LONG_ID)), "request_id_too_long",
     "request_id has 513 characters, at most 512 are accepted", None, None),
    (json.dumps(upsert(type=LONG_TYPE)), "type_too_long",
     "type has 257 characters, at most 256 are accepted", "r1", None),
    (json.dumps(upsert(type="no.such")), "unknown_type", "no handler for type 'no.such'",
     "r1", "no.such"),
    (json.dumps(upsert(payload={"entity_id": "e"})), "invalid_payload",
     "version: Field required; data: Field required", "r1", "entity.upsert"),
    (json.dumps(upsert(payload={"entity_id": "e\u0000", "version": 1, "data": {}})),
     "invalid_payload", "payload contains a NUL character (\\u0000)", "r1", "entity.upsert"),
    # orjson reads 1,024 levels of nesting and writes 254: stored, this would fail the claim.
    (json.dumps(upsert(payload=nested(300))), "invalid_payload",
     "payload cannot be stored: Recursion limit reached", "r1", "entity.upsert"),
]


@pytest.mark.parametrize(("body", "reason", "error", "request_id", "type_"), EXACT_POISON,
                         ids=[f"{i}-{p[1]}" for i, p in enumerate(EXACT_POISON)])
def test_every_poison_exactly(registry: Registry, body: str, reason: str, error: str,
                              request_id: str | None, type_: str | None) -> None:
    p = parse(raw(body), registry)
    assert isinstance(p, Poison), p
    assert (p.reason, p.error, p.request_id, p.type) == (reason, error, request_id, type_)
    assert p.raw is not None and p.raw.body == body


def test_the_longest_request_id_and_type_are_accepted(registry: Registry) -> None:
    r = Registry()
    r.register("t" * 256, EntityUpsert, entity_upsert)
    m = parse(raw(json.dumps(upsert(request_id="r" * 512, type="t" * 256))), r)
    assert isinstance(m, Message) and len(m.request_id) == 512 and len(m.type) == 256


def test_a_message_carries_its_payload_its_hash_and_no_attributes(registry: Registry) -> None:
    """payload_sha256 is the request's identity check (claim): the hash of the key-sorted
    compact JSON of the payload as sent; no sent_at, no attributes, no pointer: None."""
    import hashlib

    payload = {"version": 3, "entity_id": "e1", "data": {"b": 1, "a": [1, 2]}}
    m = parse(raw(json.dumps(upsert(payload=payload))), registry)
    assert isinstance(m, Message)
    assert m.payload_json == payload
    canonical = b'{"data":{"a":[1,2],"b":1},"entity_id":"e1","version":3}'
    assert m.payload_sha256 == hashlib.sha256(canonical).hexdigest() == payload_hash(payload)
    assert (m.sent_at, m.attributes, m.attributes_json, m.pointer) == (None, None, None, None)
    assert m.failures == 0


def test_sent_at_in_utc_with_a_z_or_an_offset(registry: Registry) -> None:
    from datetime import UTC, datetime, timedelta

    z = parse(raw(json.dumps(upsert(sent_at="2026-01-02T03:04:05Z"))), registry)
    off = parse(raw(json.dumps(upsert(sent_at="2026-01-02T05:04:05+02:00"))), registry)
    assert isinstance(z, Message) and isinstance(off, Message)
    assert z.sent_at == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC) == off.sent_at
    assert off.sent_at is not None and off.sent_at.utcoffset() == timedelta(hours=2)
    assert z.sent_at is not None and z.sent_at.utcoffset() == timedelta(0)
    # RFC 3339 5.6: the "Z" may be lower case (the schema's date-time format accepts it).
    lower = parse(raw(json.dumps(upsert(sent_at="2026-01-02t03:04:05z"))), registry)
    assert isinstance(lower, Message) and lower.sent_at == z.sent_at
    none = parse(raw(json.dumps(upsert(sent_at=None))), registry)
    assert isinstance(none, Message) and none.sent_at is None


def test_a_body_with_a_message_field_is_not_an_sns_envelope(registry: Registry) -> None:
    body = json.dumps({**upsert(), "Message": "not the document"})
    m = parse(raw(body), registry)
    assert isinstance(m, Message) and m.request_id == "r1" and m.attributes is None


def test_attributes_of_the_sqs_message_and_of_the_sns_envelope(registry: Registry) -> None:
    """Message attributes are kept with the claim (attributes_json): the SQS ones, the SNS
    envelope's, or both."""
    sqs = {"tenant": {"DataType": "String", "StringValue": "acme"}}
    m = parse(Received("mid-1", "rh-1", json.dumps(upsert()), message_attributes=sqs), registry)
    assert isinstance(m, Message)
    assert m.attributes == {"tenant": {"DataType": "String", "StringValue": "acme"}}
    assert m.attributes_json is not None and json.loads(m.attributes_json) == m.attributes

    envelope = {"Type": "Notification", "Message": json.dumps(upsert()),
                "MessageAttributes": {"region": {"Type": "String", "Value": "eu"}}}
    m = parse(raw(json.dumps(envelope)), registry)
    assert isinstance(m, Message)
    assert m.attributes == {"region": {"DataType": "String", "StringValue": "eu"}}
    assert m.attributes_json is not None and json.loads(m.attributes_json) == m.attributes

    m = parse(Received("mid-1", "rh-1", json.dumps(envelope), message_attributes=sqs), registry)
    assert isinstance(m, Message) and m.attributes == {
        "region": {"DataType": "String", "StringValue": "eu"},
        "tenant": {"DataType": "String", "StringValue": "acme"}}


def test_a_fetched_payload_is_parsed_instead_of_the_pointer_body(registry: Registry) -> None:
    """A body that points to S3: the document is the fetched object's bytes, the message
    keeps the pointer (and its SNS envelope's attributes); the raw body stays the pointer."""
    from service.core.pointers import Fetched, Pointer

    pointer_body = '["software.amazon.payloadoffloading.PayloadS3Pointer", {}]'
    envelope = {"Type": "Notification", "Message": pointer_body,
                "MessageAttributes": {"region": {"Type": "String", "Value": "eu"}}}
    pointer = Pointer("bucket", "key", envelope)
    fetched = Fetched(pointer, json.dumps(upsert()).encode())
    m = parse(raw(pointer_body), registry, fetched)
    assert isinstance(m, Message)
    assert (m.request_id, m.pointer, m.raw.body) == ("r1", pointer, pointer_body)
    assert m.attributes == {"region": {"DataType": "String", "StringValue": "eu"}}

    bad = parse(raw(pointer_body), registry, Fetched(Pointer("bucket", "key"), b"{not json"))
    assert isinstance(bad, Poison)
    assert (bad.reason, bad.error, bad.request_id, bad.raw.body) == (
        "invalid_json", "s3://bucket/key: " + decode_error("{not json"), None, pointer_body)


def test_a_body_of_more_json_values_than_the_limit_is_not_parsed(
    registry: Registry, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A nested bomb ({"junk": [{}, {}, …]}) is 26 times its size once parsed: above
    INGEST_MAX_JSON_VALUES it is poison before orjson ever reads it; at the limit it is
    parsed as usual. The same bound holds for an S3 payload and an SNS notification."""
    import orjson

    from service.core.limits import MAX_JSON_VALUES, json_values
    from service.core.pointers import Fetched, Pointer
    from service.settings import Settings

    assert Settings.model_fields["max_json_values"].default == MAX_JSON_VALUES
    # Commas inside strings count too: an overcount only refuses sooner.
    assert json_values('{"a": [1, {}], "b": "x,y"}') == json_values(b'{"a":[1,{}],"b":"x,y"}') == 6
    registry.max_json_values = 1000
    real_loads = orjson.loads
    loads: list[int] = []

    def spy(text: str | bytes) -> Any:
        loads.append(len(text))
        return real_loads(text)

    monkeypatch.setattr(orjson, "loads", spy)  # the module messages parses with

    def bomb(n: int) -> str:
        return json.dumps(upsert(payload={"entity_id": "e1", "version": 1,
                                          "data": {"junk": [{}] * n}}))

    body = bomb(1000)
    assert json_values(body) > 1000
    p = parse(raw(body), registry)
    assert isinstance(p, Poison) and p.raw.body == body
    assert (p.reason, p.request_id) == ("payload_too_complex", None)
    assert p.error == (f"{json_values(body)} JSON values (counted by their {{ [ , characters, "
                       "strings included), INGEST_MAX_JSON_VALUES is 1000")
    assert loads == []  # never parsed

    registry.max_json_values = json_values(body)  # at the limit: parsed as usual
    assert isinstance(parse(raw(body), registry), Message)
    registry.max_json_values = 1000

    sns = json.dumps({"Type": "Notification", "Message": body})
    assert parse(raw(sns), registry).reason == "payload_too_complex"  # type: ignore[union-attr]

    pointer_body = '["software.amazon.payloadoffloading.PayloadS3Pointer", {}]'
    loads.clear()
    s3 = parse(raw(pointer_body), registry, Fetched(Pointer("bucket", "key"), body.encode()))
    assert isinstance(s3, Poison) and s3.raw.body == pointer_body
    assert s3.reason == "payload_too_complex" and s3.error.startswith("s3://bucket/key: ")
    assert loads == []

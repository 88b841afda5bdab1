from __future__ import annotations

import json

import pytest

from service.handlers import Registry
from service.handlers.entities import EntityDelete, EntityUpsert, entity_delete, entity_upsert
from service.messages import Message, Poison, Received, parse, payload_hash


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

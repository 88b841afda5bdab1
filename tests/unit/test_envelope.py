"""Envelope mapping: an existing producer's messages read without re-wrapping them — the
request id, type and payload from a path into the body, a message attribute or a constant
type — with the same hostile-input rules as the standard envelope."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from service.core.messages import Message, Poison, Received, parse
from service.envelope import Envelope, Source
from service.handlers import Registry


class Order(BaseModel):
    orderId: int
    amount: int


async def _noop(payload: Order, conn: object) -> None:
    return None


def registry(request_id: str = "request_id", type_: str = "type",
             payload: str = "payload") -> Registry:
    r = Registry()
    r.register("order.created", Order, _noop)
    r.envelope = Envelope.from_specs(request_id, type_, payload)
    return r


def received(body: object, attributes: dict | None = None) -> Received:
    return Received("m-1", "h", body if isinstance(body, str) else json.dumps(body),
                    message_attributes=attributes)


def test_the_whole_body_as_payload_with_a_constant_type_and_a_numeric_key() -> None:
    r = registry("orderId", "const:order.created", ".")
    m = parse(received({"orderId": 1234, "amount": 5}), r)
    assert isinstance(m, Message), m
    assert (m.request_id, m.type, m.payload_json) == ("1234", "order.created",
                                                      {"orderId": 1234, "amount": 5})


def test_nested_paths_and_attributes() -> None:
    r = registry("meta.id", "attribute:event-type", "data")
    body = {"meta": {"id": "evt-7"}, "data": {"orderId": 1, "amount": 2}}
    m = parse(received(body, {"event-type": {"DataType": "String",
                                             "StringValue": "order.created"}}), r)
    assert isinstance(m, Message) and (m.request_id, m.type) == ("evt-7", "order.created")


def test_an_attribute_of_the_sns_envelope() -> None:
    r = registry("attribute:idempotency-key", "const:order.created", ".")
    inner = json.dumps({"orderId": 1, "amount": 2})
    body = {"Type": "Notification", "Message": inner,
            "MessageAttributes": {"idempotency-key": {"Type": "String", "Value": "k-1"}}}
    m = parse(received(body), r)
    assert isinstance(m, Message) and m.request_id == "k-1"


@pytest.mark.parametrize(("body", "attrs", "reason"), [
    ({"amount": 5}, None, "missing_request_id"),                 # the key's path is absent
    ({"orderId": True, "amount": 5}, None, "missing_request_id"),  # a bool is no key
    ({"orderId": "a\x00b", "amount": 5}, None, "invalid_envelope"),  # NUL, mapped or not
    ({"orderId": "x" * 513, "amount": 5}, None, "request_id_too_long"),
    ({"orderId": 1, "amount": "many"}, None, "invalid_payload"),
    ([1, 2], None, "invalid_envelope"),
])
def test_hostile_input_rules_apply_to_mapped_fields(body, attrs, reason) -> None:
    r = registry("orderId", "const:order.created", ".")
    p = parse(received(body, attrs), r)
    assert isinstance(p, Poison) and p.reason == reason, p


def test_a_missing_attribute_is_a_missing_type() -> None:
    p = parse(received({"orderId": 1, "amount": 1}), registry("orderId", "attribute:t", "."))
    assert isinstance(p, Poison) and p.reason == "missing_type"


def test_the_default_is_the_standard_envelope() -> None:
    r = registry()
    assert r.envelope == Envelope() and Envelope().standard
    m = parse(received({"request_id": "r", "type": "order.created",
                        "payload": {"orderId": 1, "amount": 1}}), r)
    assert isinstance(m, Message)


@pytest.mark.parametrize("spec", ["", "a..b", "const:x", "att:x", "a:b"])
def test_bad_sources_are_refused(spec: str) -> None:
    with pytest.raises(ValueError):
        Source.parse(spec)


def test_bad_mapping_settings_exit_2_naming_the_variable(monkeypatch) -> None:
    from service.settings import ConfigError, load_settings

    monkeypatch.setenv("INGEST_QUEUE_URL", "http://127.0.0.1:1/q")
    monkeypatch.setenv("INGEST_DATABASE_URL", "postgresql://u@h/d")
    monkeypatch.setenv("INGEST_ENVELOPE_REQUEST_ID", "const:x")
    with pytest.raises(ConfigError, match="INGEST_ENVELOPE_REQUEST_ID"):
        load_settings()
    monkeypatch.setenv("INGEST_ENVELOPE_REQUEST_ID", "orderId")
    monkeypatch.setenv("INGEST_ENVELOPE_TYPE", "const:order.created")
    monkeypatch.setenv("INGEST_ENVELOPE_PAYLOAD", ".")
    s = load_settings()
    assert Envelope.from_specs(s.envelope_request_id, s.envelope_type, s.envelope_payload) \
        == Envelope.from_specs("orderId", "const:order.created", ".")

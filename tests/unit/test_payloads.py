"""S3-offloaded payloads and message attributes, over the in-package fakes and a fake S3
client (the real extended clients against LocalStack: tests/acceptance/test_extended_clients.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from pydantic import BaseModel
from structlog.testing import capture_logs

from service.adapters.payloads import LATER, S3Payloads
from service.core.budget import MemoryBudget
from service.core.labels import ERROR_KINDS
from service.core.messages import Message, Received, parse
from service.core.pointers import Fetched, Pointer, Refused, Unreachable, find_pointer
from service.core.retry import RetryPolicy
from service.handlers import Registry, current_attributes
from service.observe import metrics
from service.runtime.resolve import resolve_batch
from service.runtime.worker import EXIT_ACK_FAILED, Worker
from service.s3access import AllowList
from service.testing import FakeQueue, FakeStore
from tests.unit.test_worker import settings, until

CURRENT = "software.amazon.payloadoffloading.PayloadS3Pointer"
LEGACY = "com.amazon.sqs.javamessaging.MessageS3Pointer"


def pointer_body(key: str, cls: str = CURRENT, bucket: str = "payloads") -> str:
    # What the Python extended clients write (json.dumps: ", " and ": " separators).
    return json.dumps([cls, {"s3BucketName": bucket, "s3Key": key}])


def sns(message: str, attributes: dict[str, Any] | None = None) -> str:
    env: dict[str, Any] = {"Type": "Notification", "MessageId": "sns-1", "Message": message,
                           "TopicArn": "arn:aws:sns:us-east-1:000000000000:t"}
    if attributes is not None:
        env["MessageAttributes"] = attributes
    return json.dumps(env)


def doc(rid: str, n: int = 1) -> bytes:
    return json.dumps({"request_id": rid, "type": "note", "payload": {"n": n}}).encode()


# -- recognising a pointer ---------------------------------------------------------------


def test_pointer_forms_the_extended_clients_write() -> None:
    assert find_pointer(pointer_body("k1")) == Pointer("payloads", "k1")
    assert find_pointer(pointer_body("k1", LEGACY)) == Pointer("payloads", "k1")
    java = f'["{CURRENT}",{{"s3BucketName":"payloads","s3Key":"a/b c"}}]'  # Jackson: compact
    assert find_pointer(java) == Pointer("payloads", "a/b c")
    inside = find_pointer(sns(pointer_body("k2")))
    assert isinstance(inside, Pointer) and (inside.bucket, inside.key) == ("payloads", "k2")
    assert inside.envelope is not None and inside.envelope["MessageId"] == "sns-1"


def test_an_s3_key_is_up_to_1024_bytes_of_utf_8_without_nul() -> None:
    """S3's own limit, in bytes (not characters): the longest key is still a pointer."""
    for key in ("k" * 1024, "é" * 512):
        assert find_pointer(pointer_body(key)) == Pointer("payloads", key)
    for key in ("k" * 1025, "é" * 513, "a\x00b"):
        r = find_pointer(pointer_body(key))
        assert isinstance(r, Refused) and r.reason == "invalid_envelope", key


@pytest.mark.parametrize("body", [
    json.dumps({"request_id": "r", "type": "note", "payload": {"text": "S3Pointer"}}),
    json.dumps(["some.other.S3Pointer", {"s3BucketName": "payloads", "s3Key": "k"}]),
    json.dumps([CURRENT, {"s3BucketName": "payloads", "s3Key": "k"}, "extra"]),
    sns(json.dumps({"request_id": "r", "type": "note", "payload": {"S3Pointer": 1}})),
    "[not json S3Pointer",
    # A notification whose Message is no string (the mark elsewhere): not a pointer, no crash.
    json.dumps({"Type": "Notification", "Message": 5, "Subject": "S3Pointer"}),
    json.dumps({"Type": "Notification", "Message": None, "Subject": "S3Pointer"}),
    json.dumps({"Type": "Notification", "Message": ["S3Pointer"]}),
])
def test_anything_else_is_parsed_as_usual(body: str) -> None:
    assert find_pointer(body) is None


NOT_A_KEY = "S3 pointer: s3Key is not an S3 key (1 to 1024 bytes)"


@pytest.mark.parametrize("where,error", [
    ("nope", "S3 pointer: second element is not an object"),
    ({"s3BucketName": "Bad_Bucket", "s3Key": "k"},
     "S3 pointer: s3BucketName 'Bad_Bucket' is not a bucket name"),
    ({"s3BucketName": "B" * 100, "s3Key": "k"},  # the dead letter quotes 80 characters
     f"S3 pointer: s3BucketName {'B' * 80!r} is not a bucket name"),
    ({"s3BucketName": "payloads", "s3Key": "k" * 1025}, NOT_A_KEY),
    ({"s3BucketName": "payloads", "s3Key": ""}, NOT_A_KEY),
    ({"s3BucketName": "payloads"}, NOT_A_KEY),
])
def test_a_malformed_pointer_is_an_invalid_envelope(where: Any, error: str) -> None:
    """The dead letter's error, as the user reads it (the pointer's own bytes are kept in
    its body)."""
    r = find_pointer(json.dumps([CURRENT, where]))
    assert isinstance(r, Refused) and r.reason == "invalid_envelope" and r.pointer is None
    assert r.error == error


# -- fetching ---------------------------------------------------------------------------


def client_error(code: str, status: int, op: str = "GetObject") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, op)


class FakeBody:
    def __init__(self, data: bytes, truncate_at: int | None = None) -> None:
        self.data = data[:truncate_at] if truncate_at is not None else data
        self.pos = 0
        self.reads = 0
        self.closed = False

    async def read(self, n: int) -> bytes:
        self.reads += 1
        chunk = self.data[self.pos:self.pos + n]
        self.pos += len(chunk)
        return chunk

    def close(self) -> None:
        self.closed = True


class FakeS3:
    """get_object / delete_object over a dict, with injected failures and a record of
    concurrency and of the order of events (shared with the queue's acks)."""

    def __init__(self, events: list[str] | None = None) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}
        self.fail: dict[str, BaseException] = {}
        self.truncate: dict[str, int] = {}
        self.short_length: dict[str, int] = {}  # Content-Length below the real size
        self.bodies: list[FakeBody] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.events = events if events is not None else []
        self.latency = 0.0
        self.calls: list[tuple[str, str, str, dict[str, Any]]] = []  # (op, bucket, key, kw)
        self.fail_delete: dict[str, BaseException] = {}  # key -> what DeleteObject raises

    def put(self, key: str, data: bytes, bucket: str = "payloads") -> None:
        self.objects[(bucket, key)] = data

    async def get_object(self, Bucket: str, Key: str, **kw: Any) -> dict[str, Any]:
        self.calls.append(("get", Bucket, Key, kw))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.latency)
            if Key in self.fail:
                raise self.fail[Key]
            if (Bucket, Key) not in self.objects:
                raise client_error("NoSuchKey", 404)
            data = self.objects[(Bucket, Key)]
            body = FakeBody(data, self.truncate.get(Key))
            self.bodies.append(body)
            return {"Body": body, "ContentLength": len(data) - self.short_length.get(Key, 0)}
        finally:
            self.in_flight -= 1

    async def delete_object(self, Bucket: str, Key: str, **kw: Any) -> dict[str, Any]:
        self.calls.append(("delete", Bucket, Key, kw))
        self.events.append(f"s3-delete:{Key}")
        if Key in self.fail_delete:
            raise self.fail_delete[Key]
        self.objects.pop((Bucket, Key), None)
        return {}


def s3p(client: Any, max_bytes: int = 1 << 20) -> S3Payloads:
    """S3Payloads allowed to read the tests' bucket."""
    return S3Payloads(client, max_bytes, allowed="payloads")


def value(counter: Any, *labels: str) -> float:
    return float((counter.labels(*labels) if labels else counter)._value.get())


async def test_fetch_reads_the_object_after_checking_its_size() -> None:
    s3 = FakeS3()
    s3.put("k", b"x" * 200_000)
    before = value(metrics.s3_fetched_bytes)
    fetched = value(metrics.s3_fetches, "fetched")
    r = await s3p(s3, 200_000).fetch(Pointer("payloads", "k"))
    assert isinstance(r, Fetched) and r.data == b"x" * 200_000
    assert value(metrics.s3_fetched_bytes) - before == 200_000
    assert value(metrics.s3_fetches, "fetched") - fetched == 1
    assert s3.bodies[0].closed


async def test_too_large_is_refused_without_reading_the_body() -> None:
    s3 = FakeS3()
    s3.put("big", b"x" * 5000)
    before = value(metrics.s3_fetches, "too_large")
    r = await s3p(s3, 4999).fetch(Pointer("payloads", "big"))
    assert isinstance(r, Refused) and r.reason == "payload_too_large" and "5000 bytes" in r.error
    assert s3.bodies[0].reads == 0 and s3.bodies[0].closed
    assert value(metrics.s3_fetches, "too_large") - before == 1


class NoLengthS3(FakeS3):
    async def get_object(self, Bucket: str, Key: str, **kw: Any) -> dict[str, Any]:
        resp = await super().get_object(Bucket, Key, **kw)
        del resp["ContentLength"]
        return resp


async def test_an_object_of_unknown_length_is_refused_unread_and_sent_no_owner_unless_set(
) -> None:
    """A GetObject answer without Content-Length is never read (its size cannot be checked
    against INGEST_MAX_PAYLOAD_BYTES); and without INGEST_S3_EXPECTED_OWNER no
    ExpectedBucketOwner goes with the call (botocore refuses a None parameter)."""
    s3 = NoLengthS3()
    s3.put("k", b"x" * 10)
    p = Pointer("payloads", "k")
    r = await s3p(s3).fetch(p)
    assert r == Refused(p, "payload_too_large",
                        "s3://payloads/k: unknown bytes, INGEST_MAX_PAYLOAD_BYTES=1048576")
    assert s3.bodies[0].reads == 0 and s3.bodies[0].closed
    assert s3.calls == [("get", "payloads", "k", {})]


@pytest.mark.parametrize("exc,kind", [
    (client_error("AccessDenied", 403), "access_denied"),
    (client_error("SlowDown", 503), "throttled"),
    (client_error("InternalError", 500), "server"),
    (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), "network"),
])
async def test_other_s3_errors_are_transient_and_counted(exc: BaseException, kind: str) -> None:
    s3 = FakeS3()
    s3.fail["k"] = exc
    before = value(metrics.s3_errors, kind)
    r = await s3p(s3, 1 << 20).fetch(Pointer("payloads", "k"))
    assert isinstance(r, Unreachable)
    assert value(metrics.s3_errors, kind) - before == 1


def s3_error(code: str | None, status: int | None) -> ClientError:
    """A ClientError as botocore may build it: without the Error code or the HTTP status
    when the response did not carry one (a HEAD answers no body; S3 answers some errors
    inside a 200 OK body — then only the code says what happened)."""
    response: dict[str, Any] = {}
    if code is not None:
        response["Error"] = {"Code": code, "Message": "m"}
    if status is not None:
        response["ResponseMetadata"] = {"HTTPStatusCode": status}
    return ClientError(response, "GetObject")


#: Every S3 error code and status _error_kind names, with the label it must count under.
#: A code is shown with a status that decides nothing (200: an error in an OK body), a
#: status with a code S3 does not name for it, so each row needs its own entry in the map.
ERROR_KINDS_TABLE = [
    *[(code, 200, "access_denied") for code in (
        "AccessDenied", "Forbidden", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch",
        "ExpiredToken")],
    ("Unlisted", 403, "access_denied"),
    ("AccessDenied", None, "access_denied"),  # no ResponseMetadata at all
    *[(code, 200, "throttled") for code in (
        "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "503")],
    ("Unlisted", 429, "throttled"),
    ("Unlisted", 503, "throttled"),
    (None, 503, "throttled"),  # no Error in the response
    ("Unlisted", 500, "server"),
    ("Unlisted", 502, "server"),
    ("Unlisted", 504, "server"),
    ("InvalidRange", 416, "client"),
    ("KMS.DisabledException", 400, "client"),
    (None, None, "client"),
]


@pytest.mark.parametrize("code,status,kind", ERROR_KINDS_TABLE)
async def test_each_s3_error_code_and_status_counts_under_its_kind(
    code: str | None, status: int | None, kind: str,
) -> None:
    """``sqs_ingest_s3_errors_total{kind}``: the label an operator's alert keys on, and
    what decides whether a failure counts against INGEST_S3_UNREADABLE_AFTER."""
    s3 = FakeS3()
    s3.fail["k"] = s3_error(code, status)
    before = {k: value(metrics.s3_errors, k) for k in ERROR_KINDS}
    errors = value(metrics.s3_fetches, "error")
    r = await s3p(s3).fetch(Pointer("payloads", "k"))
    assert isinstance(r, Unreachable) and r.kind == kind
    assert r.refused == (kind in ("access_denied", "client"))
    assert {k: value(metrics.s3_errors, k) - before[k] for k in ERROR_KINDS} == {
        k: 1.0 if k == kind else 0.0 for k in ERROR_KINDS}
    assert value(metrics.s3_fetches, "error") - errors == 1


async def test_an_s3_failure_reads_as_the_error_s3_gave_and_is_cut_at_500_characters(
) -> None:
    s3 = FakeS3()
    s3.fail["k"] = client_error("SlowDown", 503)
    s3.fail["long"] = OSError("x" * 600)
    r = await s3p(s3).fetch(Pointer("payloads", "k"))
    assert isinstance(r, Unreachable) and r.error == (
        "s3://payloads/k: ClientError: An error occurred (SlowDown) when calling the "
        "GetObject operation: SlowDown")
    long = await s3p(s3).fetch(Pointer("payloads", "long"))
    assert isinstance(long, Unreachable) and long.kind == "network"
    assert long.error == "s3://payloads/long: OSError: " + "x" * 491  # 500 after the uri


async def test_missing_object_and_truncated_stream() -> None:
    s3 = FakeS3()
    r = await s3p(s3, 1 << 20).fetch(Pointer("payloads", "gone"))
    assert isinstance(r, Refused) and r.reason == "payload_object_missing"
    assert "s3://payloads/gone" in r.error
    s3.put("cut", b"y" * 100)
    s3.truncate["cut"] = 60
    assert isinstance(await s3p(s3).fetch(Pointer("payloads", "cut")), Unreachable)
    s3.put("long", b"z" * 100)
    s3.short_length["long"] = 1  # the stream does not end where its length says
    assert isinstance(await s3p(s3).fetch(Pointer("payloads", "long")),
                      Unreachable)


@pytest.mark.parametrize("code,status", [
    ("NoSuchKey", 404), ("NotFound", 404), ("404", 404), ("NoSuchBucket", 404),
    # The code alone (no status in the response) ...
    ("NoSuchKey", None), ("NotFound", None), ("404", None), ("NoSuchBucket", None),
    # ... and the status alone: a 404 whatever the code (a missing version, no Error).
    ("NoSuchVersion", 404), (None, 404),
])
async def test_every_form_of_a_missing_object_is_a_dead_letter_reason_not_an_s3_error(
    code: str | None, status: int | None,
) -> None:
    s3 = FakeS3()
    s3.fail["gone"] = s3_error(code, status)
    missing, errors = value(metrics.s3_fetches, "missing"), value(metrics.s3_fetches, "error")
    r = await s3p(s3).fetch(Pointer("payloads", "gone"))
    assert isinstance(r, Refused) and r.reason == "payload_object_missing", r
    assert value(metrics.s3_fetches, "missing") - missing == 1
    assert value(metrics.s3_fetches, "error") == errors


@pytest.mark.parametrize("code,status", [("AccessDenied", 403), ("NoSuchKeyX", 400),
                                         ("InternalError", 500), (None, None)])
async def test_an_error_that_is_no_missing_object_is_no_dead_letter(
    code: str | None, status: int | None,
) -> None:
    s3 = FakeS3()
    s3.fail["k"] = s3_error(code, status)
    assert isinstance(await s3p(s3).fetch(Pointer("payloads", "k")), Unreachable)


async def test_what_the_dead_letter_of_a_missing_or_cut_object_says() -> None:
    """The error text a user reads (dead_letters.error; the s3_fetch_failed line)."""
    s3 = FakeS3()
    gone = await s3p(s3).fetch(Pointer("payloads", "gone"))
    assert isinstance(gone, Refused) and gone.error == (
        "s3://payloads/gone: ClientError: An error occurred (NoSuchKey) when calling the "
        "GetObject operation: NoSuchKey")
    s3.put("cut", b"y" * 100)
    s3.truncate["cut"] = 60
    cut = await s3p(s3).fetch(Pointer("payloads", "cut"))
    assert isinstance(cut, Unreachable) and cut.kind == "network"
    assert cut.error == "s3://payloads/cut: OSError: S3 object truncated at 60 of 100 bytes"
    s3.put("long", b"z" * 100)
    s3.short_length["long"] = 1
    long = await s3p(s3).fetch(Pointer("payloads", "long"))
    assert isinstance(long, Unreachable) and long.error == (
        "s3://payloads/long: OSError: S3 object longer than its Content-Length (99 bytes)")


async def test_a_stream_longer_than_its_length_is_caught_past_the_first_chunk() -> None:
    """Over several 64 KiB reads, no read asks for more than the bytes still due: the
    surplus is found by the end-of-stream read, never written past the buffer."""
    s3 = FakeS3()
    s3.put("big", b"z" * 100_000)
    s3.short_length["big"] = 10
    before = value(metrics.s3_fetched_bytes)
    r = await s3p(s3).fetch(Pointer("payloads", "big"))
    assert isinstance(r, Unreachable) and r.error == (
        "s3://payloads/big: OSError: S3 object longer than its Content-Length (99990 bytes)")
    assert value(metrics.s3_fetched_bytes) == before and s3.bodies[0].closed
    s3.short_length["big"] = 0
    ok = await s3p(s3).fetch(Pointer("payloads", "big"))
    assert isinstance(ok, Fetched) and ok.data == b"z" * 100_000


async def test_a_batch_s_pointers_are_fetched_concurrently() -> None:
    s3 = FakeS3()
    s3.latency = 0.05
    batch = []
    for i in range(10):
        s3.put(f"k{i}", doc(f"r{i}"))
        batch.append(Received(f"m{i}", "rh", pointer_body(f"k{i}")))
    batch.append(Received("plain", "rh", doc("inline").decode()))
    resolved = await s3p(s3).resolve(batch)
    assert sorted(resolved) == [f"m{i}" for i in range(10)]  # the plain body costs no call
    assert s3.max_in_flight == 10


async def test_delete_removes_every_object_and_a_failed_delete_is_counted_never_raised() -> None:
    # INGEST_S3_DELETE_AFTER_ACK: runs after the ack, so a failure must not raise (the
    # bucket's lifecycle rule removes what is left); each outcome is counted and a failure
    # is logged with its own pointer's uri.
    s3 = FakeS3()
    for key in "abcd":
        s3.put(key, b"x")
    denied = client_error("AccessDenied", 403, "DeleteObject")
    down = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    s3.fail_delete.update({"b": denied, "d": down})
    deleted, failed = value(metrics.s3_deletes, "deleted"), value(metrics.s3_deletes, "failed")
    payloads = S3Payloads(s3, 1 << 20, True, allowed="payloads", expected_owner="123456789012")
    with capture_logs() as logs:
        await payloads.delete([Pointer("payloads", key) for key in "abcd"])
    owner = {"ExpectedBucketOwner": "123456789012"}
    assert s3.calls == [("delete", "payloads", key, owner) for key in "abcd"]
    assert set(s3.objects) == {("payloads", "b"), ("payloads", "d")}
    assert value(metrics.s3_deletes, "deleted") - deleted == 2
    assert value(metrics.s3_deletes, "failed") - failed == 2
    assert [(e["event"], e["uri"], e["error"]) for e in logs] == [
        ("s3_delete_failed", "s3://payloads/b", f"ClientError: {denied}"),
        ("s3_delete_failed", "s3://payloads/d", f"EndpointConnectionError: {down}")]


async def test_delete_of_nothing_calls_nothing_and_a_cancelled_delete_is_passed_on() -> None:
    s3 = FakeS3()
    await s3p(s3).delete([])
    assert s3.calls == []
    s3.put("a", b"x")
    s3.fail_delete["b"] = asyncio.CancelledError()
    deleted, failed = value(metrics.s3_deletes, "deleted"), value(metrics.s3_deletes, "failed")
    with pytest.raises(asyncio.CancelledError):
        await s3p(s3).delete([Pointer("payloads", "a"), Pointer("payloads", "b")])
    assert s3.objects == {}
    assert value(metrics.s3_deletes, "deleted") - deleted == 1
    assert value(metrics.s3_deletes, "failed") - failed == 0


async def test_a_malformed_pointer_in_a_batch_is_refused_without_an_s3_call() -> None:
    s3 = FakeS3()
    s3.put("k", doc("r1"))
    bad = json.dumps([CURRENT, {"s3BucketName": "Bad_Bucket", "s3Key": "k"}])
    resolved = await s3p(s3).resolve([Received("bad", "rh", bad),
                                      Received("ok", "rh", pointer_body("k"))])
    r = resolved["bad"]
    assert isinstance(r, Refused) and r.reason == "invalid_envelope" and r.pointer is None
    assert "not a bucket name" in r.error
    assert isinstance(resolved["ok"], Fetched)
    assert [c[2] for c in s3.calls] == ["k"]


async def test_a_batch_s_payload_bytes_are_held_for_it_until_it_gives_them_back() -> None:
    """With a memory budget (INGEST_MAX_INFLIGHT_BYTES) and the batch as owner, what was
    read stays counted for that batch (until it commits); what could not be read is given
    back at once. Without an owner (a worker with no budget) nothing is counted."""
    s3 = FakeS3()
    s3.put("k0", doc("r0"))
    s3.put("k1", doc("r1", 100_000))  # not the size of k0's
    s3.truncate["k1"] = 5  # read fails: its bytes go back
    batch = [Received("m0", "rh", pointer_body("k0")), Received("m1", "rh", pointer_body("k1"))]
    payloads = s3p(s3)
    payloads.budget = MemoryBudget(10_000)
    owner = object()
    resolved = await payloads.resolve(batch, owner)
    assert isinstance(resolved["m0"], Fetched) and isinstance(resolved["m1"], Unreachable)
    assert payloads.budget.holds(owner) == len(doc("r0")) == payloads.budget.used
    payloads.budget.give_all(owner)
    again = await payloads.resolve(batch)  # no owner: not counted
    assert isinstance(again["m0"], Fetched) and isinstance(again["m1"], Unreachable)
    assert payloads.budget.used == 0
    no_budget = await s3p(s3).resolve(batch, owner)  # an owner but no budget: no count
    assert isinstance(no_budget["m0"], Fetched) and isinstance(no_budget["m1"], Unreachable)


def budgeted(s3: FakeS3, limit: int) -> S3Payloads:
    payloads = s3p(s3)
    payloads.budget = MemoryBudget(limit)
    return payloads


async def test_what_does_not_fit_after_a_read_is_left_for_later_and_the_rest_still_decided(
) -> None:
    """Room for one payload: the first is read, every other pointer after it is Later
    (opened, closed unread), and a malformed one further on is still refused."""
    s3 = FakeS3()
    for k in ("k0", "k1", "k3"):
        s3.put(k, doc("r0"))
    n = len(doc("r0"))
    payloads = budgeted(s3, n + 10)
    bad = json.dumps([CURRENT, "nope"])
    owner = object()
    resolved = await payloads.resolve(
        [Received(f"m{i}", "rh", b) for i, b in enumerate(
            [pointer_body("k0"), pointer_body("k1"), bad, pointer_body("k3")])], owner)
    assert isinstance(resolved["m0"], Fetched)
    assert resolved["m1"] is LATER and resolved["m3"] is LATER
    assert isinstance(resolved["m2"], Refused) and resolved["m2"].reason == "invalid_envelope"
    assert list(resolved) == ["m0", "m1", "m2", "m3"]
    assert all(b.closed for b in s3.bodies) and [b.reads for b in s3.bodies][1:] == [0, 0]
    assert payloads.budget is not None and payloads.budget.holds(owner) == n


async def test_a_batch_s_payloads_go_ahead_of_polls_waiting_for_room() -> None:
    """A poll waits to receive (no room for its share); a batch's payloads that fit are
    still read at once, all in this round (a batch in flight is urgent: finishing it is
    what frees memory)."""
    s3 = FakeS3()
    s3.put("k0", doc("r0"))
    s3.put("k1", doc("r1"))
    payloads = budgeted(s3, 10_000)
    budget = payloads.budget
    assert budget is not None and budget.try_take(5_000, "other batch")
    poll = asyncio.create_task(budget.take(6_000, "poll"))
    try:
        await until(lambda: len(budget._waiting) == 1, "the poll waits")  # queued, no room
        resolved = await payloads.resolve(
            [Received("m0", "rh", pointer_body("k0")), Received("m1", "rh", pointer_body("k1"))],
            "batch")
        assert isinstance(resolved["m0"], Fetched) and isinstance(resolved["m1"], Fetched)
        assert budget.holds("batch") == 2 * len(doc("r0")) and not poll.done()
    finally:
        poll.cancel()


async def test_a_batch_holding_no_payload_waits_for_room_for_one_before_the_polls() -> None:
    """No room for the first payload and the batch holds none: it waits for room for that
    one (the rest are Later, a malformed one refused at once), and when room comes it is
    served before a poll that was waiting first."""
    s3 = FakeS3()
    s3.put("k0", doc("r0"))
    s3.put("k1", doc("r1"))
    n = len(doc("r0"))
    payloads = budgeted(s3, 1_000)
    budget = payloads.budget
    assert budget is not None and budget.try_take(1_000 - n + 1, "other batch")
    poll = asyncio.create_task(budget.take(1_000 - n + 1, "poll"))
    batch = [Received("m0", "rh", pointer_body("k0")), Received("m1", "rh", pointer_body("k1")),
             Received("m2", "rh", json.dumps([CURRENT, "nope"]))]
    resolving = asyncio.create_task(payloads.resolve(batch, "batch"))
    try:
        await until(lambda: any(b.closed for b in s3.bodies), "m1 left for later")
        assert not resolving.done()
        budget.give_all("other batch")
        resolved = await asyncio.wait_for(resolving, 10)
        assert isinstance(resolved["m0"], Fetched) and resolved["m1"] is LATER
        assert isinstance(resolved["m2"], Refused) and resolved["m2"].reason == "invalid_envelope"
        assert budget.holds("batch") == n and not poll.done()  # the poll still waits
    finally:
        resolving.cancel()
        poll.cancel()


# -- the batch's S3 step (service.runtime.resolve) ------------------------------------------------


def policy0() -> RetryPolicy:
    return RetryPolicy(base_seconds=2, max_seconds=900, rng=lambda: 0.0)  # backoff(1) == 1


def msg(mid: str, body: str, group: str | None) -> Received:
    return Received(mid, f"rh-{mid}", body, group_id=group)


@pytest.mark.parametrize("fifo", [True, False])
async def test_a_payload_left_for_later_takes_the_rest_of_its_fifo_group_with_it(
    fifo: bool,
) -> None:
    """The budget holds one payload: m1's is left for a later round. On a FIFO queue m2,
    behind it in group G, waits for that round too; H's message does not. On a standard
    queue (group ids of a fair queue order nothing) only m1 waits."""
    s3 = FakeS3()
    s3.put("k0", doc("r0"))
    s3.put("k1", doc("r1"))
    payloads = s3p(s3)
    payloads.budget = MemoryBudget(len(doc("r0")) + 10)
    part = [msg("m0", pointer_body("k0"), "G"), msg("m1", pointer_body("k1"), "G"),
            msg("m2", doc("r2").decode(), "G"), msg("h", doc("rh").decode(), "H")]
    rest, fetched, plan, later = await resolve_batch(
        payloads, FakeStore(), policy0(), part, fifo, owner=object())
    assert plan is None and set(fetched) == {"m0"}
    if fifo:
        assert ([m.message_id for m in rest], [m.message_id for m in later]) == (
            ["m0", "h"], ["m1", "m2"])
    else:
        assert ([m.message_id for m in rest], [m.message_id for m in later]) == (
            ["m0", "m2", "h"], ["m1"])


class LookupRecordingStore(FakeStore):
    def __init__(self) -> None:
        super().__init__()
        self.lookups: list[tuple[str, Any]] = []

    async def known_pointers(self, uris: Any) -> Any:
        self.lookups.append(("known_pointers", list(uris)))
        return await super().known_pointers(uris)

    async def note_refusals(self, errors: Any) -> Any:
        self.lookups.append(("note_refusals", dict(errors)))
        return await super().note_refusals(errors)


async def test_pointers_refused_for_good_need_no_round_trip_to_the_database() -> None:
    """A malformed pointer, one outside the allow-list and one too large are dead letters
    whatever PostgreSQL knows: no lookup is made for them. A missing object and an S3
    failure are looked up (a completed request's redelivery is a duplicate); only a
    refusal (403) is recorded."""
    s3 = FakeS3()
    s3.put("big", b"x" * 100)
    s3.fail["denied"] = client_error("AccessDenied", 403)
    store = LookupRecordingStore()
    part = [msg("bad", json.dumps([CURRENT, "nope"]), None),
            msg("other", pointer_body("k", bucket="elsewhere"), None),
            msg("big", pointer_body("big"), None)]
    rest, _, plan, _ = await resolve_batch(s3p(s3, 99), store, policy0(), part, False)
    assert plan is not None and rest == []
    assert [(d.sqs_message_id, d.reason) for d in plan.letters] == [
        ("bad", "invalid_envelope"), ("other", "payload_bucket_not_allowed"),
        ("big", "payload_too_large")]
    assert store.lookups == []
    part += [msg("gone", pointer_body("gone"), None), msg("denied", pointer_body("denied"), None)]
    await resolve_batch(s3p(s3, 99), store, policy0(), part, False)
    assert store.lookups == [
        ("note_refusals", {"s3://payloads/denied": "s3://payloads/denied: ClientError: An error "
                           "occurred (AccessDenied) when calling the GetObject operation: "
                           "AccessDenied"}),
        ("known_pointers", ["s3://payloads/gone", "s3://payloads/denied"])]


@pytest.mark.parametrize("fifo", [True, False])
async def test_only_a_message_handed_back_holds_back_its_fifo_group(fifo: bool) -> None:
    """G's head cannot be read now (S3 500: handed back after its backoff): on a FIFO queue
    the rest of G is handed back with it, at once (``hold_followers`` then keeps them
    behind it), never parsed ahead of it. D's head is a dead letter (object missing): done,
    so the rest of D goes on. On a standard queue (a fair queue's group ids) nothing is
    held back."""
    s3 = FakeS3()
    s3.fail["down"] = client_error("InternalError", 500)
    part = [msg("g0", pointer_body("down"), "G"), msg("g1", doc("rg1").decode(), "G"),
            msg("d0", pointer_body("gone"), "D"), msg("d1", doc("rd1").decode(), "D"),
            msg("x", doc("rx").decode(), "X")]
    rest, fetched, plan, later = await resolve_batch(
        s3p(s3), FakeStore(), policy0(), part, fifo)
    assert plan is not None and fetched == {} and later == []
    assert [(d.sqs_message_id, d.reason) for d in plan.letters] == [("d0", "payload_object_missing")]
    if fifo:
        assert [m.message_id for m in rest] == ["d1", "x"]
        assert plan.deferrals == [(part[0], 1), (part[1], 0)]
    else:
        assert [m.message_id for m in rest] == ["g1", "d1", "x"]
        assert plan.deferrals == [(part[0], 1)]


# -- parsing a fetched payload ----------------------------------------------------------


class Note(BaseModel):
    n: int


def note_registry(seen: list[tuple[str, dict[str, Any]]] | None = None) -> Registry:
    r = Registry()

    async def note(p: Note, conn: Any) -> dict[str, int]:
        if seen is not None:
            from service.handlers import current_request_id

            seen.append((current_request_id(), dict(current_attributes())))
        return {"n": p.n}

    r.register("note", Note, note)
    return r


def test_a_fetched_payload_hashes_like_the_same_payload_inline() -> None:
    reg = note_registry()
    inline = parse(Received("m1", "rh", doc("r1", 7).decode()), reg)
    p = Pointer("payloads", "k")
    raw = Received("m2", "rh", pointer_body("k"))
    fetched = parse(raw, reg, Fetched(p, bytearray(doc("r1", 7))))
    assert isinstance(inline, Message) and isinstance(fetched, Message)
    assert fetched.payload_sha256 == inline.payload_sha256 and fetched.pointer == p
    bad = parse(raw, reg, Fetched(p, b"{nope"))
    assert not isinstance(bad, Message) and bad.reason == "invalid_json"
    assert bad.raw.body == pointer_body("k")  # the dead letter keeps the pointer


def test_attributes_of_the_message_and_of_its_sns_envelope() -> None:
    reg = note_registry()
    sqs_attrs = {"tenant": {"DataType": "String", "StringValue": "acme"},
                 "raw": {"DataType": "Binary", "BinaryValue": b"\x01\x02"}}
    m = parse(Received("m1", "rh", doc("r1").decode(), message_attributes=sqs_attrs), reg)
    assert isinstance(m, Message) and m.attributes == {
        "tenant": {"DataType": "String", "StringValue": "acme"},
        "raw": {"DataType": "Binary", "BinaryValue": "AQI="}}
    assert json.loads(m.attributes_json or "") == m.attributes
    env = {"origin": {"Type": "String", "Value": "billing"},
           "ExtendedPayloadSize": {"Type": "Number", "Value": "300000"},
           "bad": {"Type": "String", "Value": "nul\x00"}, "junk": "x"}
    m2 = parse(Received("m2", "rh", sns(doc("r2").decode(), env)), reg)
    assert isinstance(m2, Message) and m2.attributes == {
        "origin": {"DataType": "String", "StringValue": "billing"},
        "ExtendedPayloadSize": {"DataType": "Number", "StringValue": "300000"},
        "bad": {"DataType": "String", "StringValue": "nul\\x00"}}  # jsonb-storable
    plain = parse(Received("m3", "rh", doc("r3").decode()), reg)
    assert isinstance(plain, Message) and plain.attributes is None \
        and plain.attributes_json is None


# -- the worker with pointers -----------------------------------------------------------


class Rig:
    """A worker over FakeQueue + FakeStore + FakeS3."""

    def __init__(self, *, max_bytes: int = 1 << 20, delete_after_ack: bool = False,
                 fifo: bool = False, allowed: str = "payloads",
                 expected_owner: str | None = None, unreadable_after: float = 3600,
                 **settings_over: Any) -> None:
        self.events: list[str] = []
        self.queue = AckRecordingQueue(self.events, fifo)
        self.store = FakeStore()
        self.s3 = FakeS3(self.events)
        self.seen: list[tuple[str, dict[str, Any]]] = []
        url = "http://127.0.0.1:1/q.fifo" if fifo else "http://127.0.0.1:1/q"
        self.worker = Worker(settings(pollers=1, queue_url=url, **settings_over), self.queue,
                             self.store,
                             note_registry(self.seen), visibility_timeout=30, rng=lambda: 0.0,
                             payloads=S3Payloads(self.s3, max_bytes, delete_after_ack,
                                                 allowed=allowed,
                                                 expected_owner=expected_owner,
                                                 unreadable_after=unreadable_after))
        self.task: asyncio.Task[int] | None = None

    async def stop(self) -> int:
        assert self.task is not None
        self.worker.request_stop()
        return await asyncio.wait_for(self.task, 20)


class AckRecordingQueue(FakeQueue):
    def __init__(self, events: list[str], fifo: bool = False) -> None:
        super().__init__(fifo)
        self.events = events

    async def delete_batch(self, messages: Any) -> None:
        await super().delete_batch(messages)
        self.events.extend(f"ack:{m.message_id}" for m in messages)


@pytest.fixture
async def rig_factory() -> AsyncIterator[Any]:
    rigs: list[Rig] = []

    async def make(**kw: Any) -> Rig:
        r = Rig(**kw)
        r.task = asyncio.create_task(r.worker.run())
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        if r.task is not None and not r.task.done():
            await r.stop()


async def test_pointer_payload_is_applied_and_recorded_with_its_request(rig_factory: Any) -> None:
    rig = await rig_factory()
    rig.s3.put("k1", doc("r1", 5))
    rig.queue.send(pointer_body("k1"))
    rig.queue.send(sns(pointer_body("k1", LEGACY)))  # the same request through SNS: duplicate
    await until(lambda: not rig.queue.messages, "drained")
    row = rig.store.rows["r1"]
    assert (row.status, row.result, row.payload_pointer) == ("COMPLETED", {"n": 5},
                                                               "s3://payloads/k1")
    assert not rig.store.dead and ("payloads", "k1") in rig.s3.objects  # kept by default


async def test_missing_and_too_large_are_dead_letters_that_keep_the_pointer(
    rig_factory: Any,
) -> None:
    rig = await rig_factory(max_bytes=2000)
    rig.s3.put("big", b" " * 2001)
    gone, big = pointer_body("gone"), sns(pointer_body("big"))
    m_gone, m_big = rig.queue.send(gone), rig.queue.send(big)
    await until(lambda: not rig.queue.messages, "drained")
    assert {k: (d.reason, d.body) for k, d in rig.store.dead.items()} == {
        m_gone: ("payload_object_missing", gone), m_big: ("payload_too_large", big)}
    assert not rig.store.rows


async def test_s3_failure_hands_back_with_backoff_then_completes(rig_factory: Any) -> None:
    rig = await rig_factory()
    rig.s3.put("k1", doc("r1"))
    rig.s3.put("k2", doc("r2"))
    rig.s3.fail["k1"] = client_error("InternalError", 500)
    m1 = rig.queue.send(pointer_body("k1"))
    rig.queue.send(pointer_body("k2"))
    await until(lambda: "r2" in rig.store.rows and rig.store.rows["r2"].status == "COMPLETED",
                "the neighbour completes")
    await until(lambda: any(mid == m1 for mid, _ in rig.queue.visibility_calls), "handed back")
    assert not rig.store.dead and m1 in rig.queue.messages
    assert next(t for mid, t in rig.queue.visibility_calls if mid == m1) >= 1  # backoff, not 0
    del rig.s3.fail["k1"]
    await until(lambda: not rig.queue.messages, "retried and completed", timeout=15)
    assert rig.store.rows["r1"].status == "COMPLETED" and not rig.store.dead


async def test_opt_in_delete_comes_after_commit_and_ack_and_a_redelivery_is_a_duplicate(
    rig_factory: Any,
) -> None:
    rig = await rig_factory(delete_after_ack=True)
    rig.s3.put("k1", doc("r1", 3))
    mid = rig.queue.send(pointer_body("k1"))
    await until(lambda: ("payloads", "k1") not in rig.s3.objects, "object deleted")
    assert rig.events.index(f"ack:{mid}") < rig.events.index("s3-delete:k1")
    before = value(metrics.messages_processed, "note", "duplicate")
    rig.queue.send(pointer_body("k1"))  # redelivered after the delete: object is gone
    await until(lambda: not rig.queue.messages, "redelivery settled")
    assert not rig.store.dead  # not payload_object_missing
    assert value(metrics.messages_processed, "note", "duplicate") - before == 1


async def test_opt_in_delete_never_happens_when_the_ack_failed(rig_factory: Any) -> None:
    rig = await rig_factory(delete_after_ack=True)
    rig.s3.put("k1", doc("r1"))
    mid = rig.queue.send(pointer_body("k1"))
    rig.queue.fail_delete_ids.add(mid)
    assert rig.task is not None
    assert await asyncio.wait_for(rig.task, 20) == EXIT_ACK_FAILED
    assert rig.store.rows["r1"].status == "COMPLETED"
    assert ("payloads", "k1") in rig.s3.objects  # its redelivery must still find it


async def test_a_pointer_still_in_progress_waits_instead_of_dead_lettering(
    rig_factory: Any,
) -> None:
    rig = await rig_factory()
    other = FakeStore("other-worker", rig.store.db)
    await other.register_worker("other")
    m = parse(Received("mo", "rh", pointer_body("k1")), note_registry(),
              Fetched(Pointer("payloads", "k1"), doc("r1")))
    assert isinstance(m, Message)
    await other.claim([m])  # another replica holds r1; its object is already gone
    mid = rig.queue.send(pointer_body("k1"))
    await until(lambda: any(i == mid for i, _ in rig.queue.visibility_calls), "deferred")
    assert not rig.store.dead and mid in rig.queue.messages


async def test_fifo_s3_failure_holds_back_the_rest_of_its_group(rig_factory: Any) -> None:
    rig = await rig_factory(fifo=True)
    for i in range(3):
        rig.s3.put(f"k{i}", doc(f"r{i}"))
    rig.s3.fail["k1"] = client_error("SlowDown", 503)
    ids = [rig.queue.send(pointer_body(f"k{i}"), group_id="G") for i in range(3)]
    await until(lambda: ids[2] in [i for i, _ in rig.queue.visibility_calls], "held back")
    assert rig.store.rows["r0"].status == "COMPLETED"
    assert "r2" not in rig.store.rows  # never applied ahead of r1


async def test_handlers_see_the_attributes_of_their_own_message(rig_factory: Any) -> None:
    rig = await rig_factory()
    attrs = {"tenant": {"DataType": "String", "StringValue": "acme"}}
    rig.s3.put("k3", doc("r3"))
    # One batch: the handlers run one after the other in the same task.
    rig.queue.send(doc("r1").decode(), message_attributes=attrs)
    rig.queue.send(doc("r2").decode())
    rig.queue.send(sns(pointer_body("k3"), {"origin": {"Type": "String", "Value": "billing"}}))
    await until(lambda: not rig.queue.messages, "drained")
    assert dict(rig.seen) == {
        "r1": attrs, "r2": {},  # none: nothing left over from r1
        "r3": {"origin": {"DataType": "String", "StringValue": "billing"}}}
    assert rig.store.rows["r1"].message_attributes == attrs
    assert rig.store.rows["r2"].message_attributes is None


async def test_an_s3_outage_never_pushes_a_message_into_the_queue_s_own_dlq(
    rig_factory: Any,
) -> None:
    rig = await rig_factory()
    rig.queue.max_receive_count = 2  # RedrivePolicy: SQS moves it on the third receive
    rig.s3.put("k1", doc("r1"))
    rig.s3.fail["k1"] = client_error("InternalError", 500)
    rig.queue.send(pointer_body("k1"))
    await until(lambda: rig.queue.requeued, "deferred as a fresh copy near the limit",
                timeout=15)
    del rig.s3.fail["k1"]
    await until(lambda: not rig.queue.messages, "completed after the outage", timeout=15)
    assert rig.queue.dead_lettered_by_sqs == [] and not rig.store.dead
    assert rig.store.rows["r1"].status == "COMPLETED"


def test_settings_of_offloaded_payloads() -> None:
    from service.settings import ConfigError, load_settings

    base = {"queue_url": "http://127.0.0.1:1/q", "database_url": "postgresql://u@h/d"}
    s = load_settings(**base, sqs_endpoint_url="http://127.0.0.1:4566")
    assert (s.effective_s3_endpoint_url, s.max_payload_bytes, s.s3_delete_after_ack) == (
        "http://127.0.0.1:4566", 10 * 1024 * 1024, False)
    assert load_settings(**base, s3_endpoint_url="http://127.0.0.1:9000") \
        .effective_s3_endpoint_url == "http://127.0.0.1:9000"
    for bad, var in (({"max_payload_bytes": 10}, "INGEST_MAX_PAYLOAD_BYTES"),
                     ({"s3_endpoint_url": "s3.example"}, "INGEST_S3_ENDPOINT_URL")):
        with pytest.raises(ConfigError, match=var):
            load_settings(**base, **bad)


async def test_a_completed_request_s_pointer_is_a_duplicate_even_while_s3_fails(
    rig_factory: Any,
) -> None:
    """A redelivery of a completed request's pointer needs no payload: acked as a duplicate
    even when S3 refuses the read. Deferred instead, it would cycle (fresh copies reset its
    SQS retention) for as long as S3 refuses — past INGEST_RETENTION_DAYS the request's row
    is pruned and the copy, once readable, applied a second time."""
    rig = await rig_factory()
    rig.s3.put("k1", doc("r1"))
    rig.queue.send(pointer_body("k1"))
    await until(lambda: not rig.queue.messages, "completed")
    rig.s3.fail["k1"] = client_error("AccessDenied", 403)
    before = value(metrics.messages_processed, "note", "duplicate")
    mid = rig.queue.send(pointer_body("k1"))
    await until(lambda: not rig.queue.messages
                or any(i == mid for i, _ in rig.queue.visibility_calls), "settled")
    assert mid in rig.queue.deleted and not rig.store.dead
    assert value(metrics.messages_processed, "note", "duplicate") - before == 1


# -- the allow-list (INGEST_S3_BUCKETS) ---------------------------------------------------


async def test_a_pointer_outside_the_allow_list_is_dead_lettered_unread(
    rig_factory: Any,
) -> None:
    """The object exists in the other bucket (and under the other prefix) and the fake S3
    would serve it: it is never fetched, the message is a dead letter on its first receive
    that keeps the pointer body byte for byte, and nothing of it is applied."""
    rig = await rig_factory(allowed="payloads/tenant-a/")
    rig.s3.put("tenant-a/k1", doc("r1"))
    rig.s3.put("k2", doc("r2"), bucket="elsewhere")
    rig.s3.put("tenant-ab/k3", doc("r3"))
    ok = rig.queue.send(pointer_body("tenant-a/k1"))
    other = pointer_body("k2", bucket="elsewhere")
    prefix = pointer_body("tenant-ab/k3")
    m_other, m_prefix = rig.queue.send(other), rig.queue.send(sns(prefix))
    await until(lambda: not rig.queue.messages, "drained")
    assert {k: (d.reason, d.body) for k, d in rig.store.dead.items()} == {
        m_other: ("payload_bucket_not_allowed", other),
        m_prefix: ("payload_bucket_not_allowed", sns(prefix))}
    assert "INGEST_S3_BUCKETS=payloads/tenant-a/" in rig.store.dead[m_other].error
    assert [(c[1], c[2]) for c in rig.s3.calls] == [("payloads", "tenant-a/k1")]
    assert set(rig.store.rows) == {"r1"} and ok in rig.queue.deleted
    # On the first receive: never handed back, acked once its letter was committed.
    assert not [i for i, _ in rig.queue.visibility_calls if i in (m_other, m_prefix)]
    assert {m_other, m_prefix} <= set(rig.queue.deleted)


async def test_unset_allow_list_reads_no_pointer_and_names_the_variable(
    rig_factory: Any,
) -> None:
    rig = await rig_factory(allowed="")
    rig.s3.put("k1", doc("r1"))
    body = pointer_body("k1")
    with capture_logs() as logs:  # the events themselves, wherever logging is configured
        mids = [rig.queue.send(body), rig.queue.send(body)]
        rig.queue.send(doc("inline").decode())
        await until(lambda: not rig.queue.messages, "drained")
    assert {k: (d.reason, d.body) for k, d in rig.store.dead.items()} == {
        m: ("payload_bucket_not_allowed", body) for m in mids}
    assert "INGEST_S3_BUCKETS is not set" in rig.store.dead[mids[0]].error
    assert rig.s3.calls == [] and set(rig.store.rows) == {"inline"}
    not_read = [e for e in logs if e["event"] == "s3_pointers_not_read"]
    assert len(not_read) == 1, logs  # one line, not one per pointer
    assert not_read[0]["log_level"] == "warning" and "INGEST_S3_BUCKETS" in str(not_read[0])


async def test_the_allow_list_refusal_names_the_list_and_only_an_unset_list_warns_once(
) -> None:
    """Refused before any S3 call, the error naming the variable and its value; the
    s3_pointers_not_read hint ("set INGEST_S3_BUCKETS") is for an unset list, once per
    process — a list that is set but refuses a pointer logs no such hint."""
    s3 = FakeS3()
    s3.put("k", doc("r1"), bucket="elsewhere")
    p = Pointer("elsewhere", "k")
    set_list = S3Payloads(s3, 1 << 20, allowed="payloads/tenant-a/,other")
    unset = S3Payloads(s3, 1 << 20)  # the default: no list, nothing read (fails closed)
    with capture_logs() as logs:
        r = await set_list.fetch(p)
        r2 = await set_list.fetch(p)
        assert not [e for e in logs if e["event"] == "s3_pointers_not_read"]
        u = [await unset.fetch(p) for _ in range(3)]
    assert r == r2 == Refused(p, "payload_bucket_not_allowed",
                              "s3://elsewhere/k: not in INGEST_S3_BUCKETS=payloads/tenant-a/,other")
    assert u == [Refused(p, "payload_bucket_not_allowed", "s3://elsewhere/k: INGEST_S3_BUCKETS "
                         "is not set: no S3 pointer is read")] * 3
    assert len([e for e in logs if e["event"] == "s3_pointers_not_read"]) == 1
    assert s3.calls == []
    parsed = S3Payloads(s3, 1 << 20, allowed=AllowList.parse("elsewhere"))  # given parsed
    assert isinstance(await parsed.fetch(p), Fetched)


async def test_expected_bucket_owner_goes_with_every_s3_call(rig_factory: Any) -> None:
    rig = await rig_factory(expected_owner="123456789012", delete_after_ack=True)
    rig.s3.put("k1", doc("r1"))
    rig.queue.send(pointer_body("k1"))
    await until(lambda: ("payloads", "k1") not in rig.s3.objects, "fetched and deleted")
    assert [(c[0], c[3]) for c in rig.s3.calls] == [
        ("get", {"ExpectedBucketOwner": "123456789012"}),
        ("delete", {"ExpectedBucketOwner": "123456789012"})]


def test_settings_of_the_allow_list() -> None:
    from service.s3access import AllowList
    from service.settings import ConfigError, load_settings

    base = {"queue_url": "http://127.0.0.1:1/q", "database_url": "postgresql://u@h/d"}
    s = load_settings(**base, s3_buckets=" payloads , other/in/", s3_expected_owner="000000000000")
    assert AllowList.parse(s.s3_buckets).entries == (("payloads", ""), ("other", "in/"))
    assert load_settings(**base).s3_buckets == ""
    for bad, var in (({"s3_buckets": "payloads,Bad_Bucket"}, "INGEST_S3_BUCKETS"),
                     ({"s3_buckets": "/prefix"}, "INGEST_S3_BUCKETS"),
                     ({"s3_expected_owner": "acme"}, "INGEST_S3_EXPECTED_OWNER")):
        with pytest.raises(ConfigError, match=var):
            load_settings(**base, **bad)


# -- unreadable payloads (INGEST_S3_UNREADABLE_AFTER) --------------------------------------


async def test_a_refusal_past_the_bound_is_a_dead_letter_and_an_outage_never_is(
    rig_factory: Any,
) -> None:
    """S3 refuses k1 (403) and fails k2 (500) alike. Within the bound both are handed back;
    once the first refusal of k1 (kept by the store) is older than the bound, k1 is a dead
    letter ``payload_unreadable`` with its pointer body; k2 — S3 not answering, not refusing
    — is still handed back however old, and the inline neighbour completes meanwhile."""
    rig = await rig_factory(unreadable_after=60)
    rig.queue.max_receive_count = 50
    for key, code, status in (("k1", "AccessDenied", 403), ("k2", "InternalError", 500)):
        rig.s3.put(key, doc(f"r-{key}"))
        rig.s3.fail[key] = client_error(code, status)
    b1, b2 = pointer_body("k1"), sns(pointer_body("k2"))
    m1, m2 = rig.queue.send(b1), rig.queue.send(b2)
    rig.queue.send(doc("inline").decode())
    await until(lambda: {m1, m2} <= {i for i, _ in rig.queue.visibility_calls}, "handed back")
    assert not rig.store.dead and set(rig.store.rows) == {"inline"}
    assert set(rig.store.db.refusals) == {"s3://payloads/k1"}  # the 500 is no refusal
    rig.store.db.refusals["s3://payloads/k1"] -= 61  # the first refusal, a minute ago
    for mid, _ in list(rig.queue.visibility_calls):
        if mid in rig.queue.messages:
            rig.queue.messages[mid].visible_at = 0  # next receive now, not after the backoff
    await until(lambda: m1 in rig.store.dead, "dead-lettered past the bound")
    d = rig.store.dead[m1]
    assert (d.reason, d.body) == ("payload_unreadable", b1)
    assert "INGEST_S3_UNREADABLE_AFTER=60" in (d.error or "")
    assert m2 in rig.queue.messages and m2 not in rig.store.dead
    assert rig.queue.dead_lettered_by_sqs == []


class _Session:
    """A stand-in for the aiobotocore session: records each client it makes and whether
    that client was closed."""

    def __init__(self) -> None:
        self.made: list[dict[str, Any]] = []
        self.closed = 0

    def user_agent(self) -> str:
        return "aiobotocore/0 Python/3 Linux/6 botocore/1"

    user_agent_extra = "botocore/1"

    def create_client(self, service: str, **kwargs: Any) -> Any:
        session = self

        class Made:
            async def __aenter__(self) -> Any:
                await asyncio.sleep(0)  # a concurrent first call arrives meanwhile
                session.made.append({"service": service, **kwargs})

                class Client:
                    async def get_object(self, **kw: Any) -> Any:
                        return ("get", kw)

                    async def delete_object(self, **kw: Any) -> Any:
                        return ("delete", kw)

                return Client()

            async def __aexit__(self, *exc: object) -> None:
                session.closed += 1

        return Made()


async def test_the_s3_client_is_made_once_at_the_first_call_and_closed_with_its_block() -> None:
    from service.adapters.payloads import s3_client

    session = _Session()
    async with s3_client(session, "eu-west-1", "http://127.0.0.1:9", 7) as s3:
        assert not s3.made and session.made == []  # no pointer yet: no client
        got = await asyncio.gather(s3.get_object(Bucket="b", Key="k"),
                                   s3.delete_object(Bucket="b", Key="j"))
        assert got == [("get", {"Bucket": "b", "Key": "k"}),
                       ("delete", {"Bucket": "b", "Key": "j"})]
        assert s3.made and len(session.made) == 1  # two concurrent first calls, one client
        assert await s3.get_object(Bucket="b", Key="x") == ("get", {"Bucket": "b", "Key": "x"})
        assert len(session.made) == 1 and session.closed == 0
    assert session.closed == 1
    made = session.made[0]
    assert made["service"] == "s3" and made["region_name"] == "eu-west-1"
    assert made["endpoint_url"] == "http://127.0.0.1:9"
    config = made["config"]
    assert config.max_pool_connections == 7
    assert config.s3 == {"addressing_style": "path"}  # a custom endpoint: path addressing
    assert config.user_agent == "sqs-ingest/0.1.0 aiobotocore/0 Python/3 Linux/6"
    assert (config.connect_timeout, config.read_timeout) == (5, 30)
    assert config.retries == {"max_attempts": 3, "mode": "standard"}


async def test_aws_s3_itself_is_addressed_by_virtual_host_and_an_unused_client_never_made() -> None:
    from service.adapters.payloads import s3_client

    session = _Session()
    async with s3_client(session, "us-east-1", None) as s3:
        await s3.get_object(Bucket="b", Key="k")
    assert session.made[0]["config"].s3 is None and session.made[0]["endpoint_url"] is None
    assert session.made[0]["config"].max_pool_connections == 50
    unused = _Session()
    async with s3_client(unused, "us-east-1", None):
        pass
    assert unused.made == [] and unused.closed == 0


async def test_a_batch_whose_payloads_take_rounds_keeps_its_bodies_counted_throughout(
    rig_factory: Any,
) -> None:
    """A budget with room for one payload at a time: a batch of three pointers is resolved
    in three rounds, each round's message committed before the next round reads. Between
    rounds only the round's payload goes back — the batch's bodies stay counted (they are
    still in memory) until the batch ends."""
    pad = "x" * 1400
    docs = {f"k{i}": json.dumps({"request_id": f"r{i}", "type": "note",
                                 "payload": {"n": i, "pad": pad}}).encode() for i in range(3)}
    rig = await rig_factory(max_bytes=2000, max_payload_bytes=2000, max_inflight_bytes=2500)
    budget = rig.worker.budget
    used_at_read: list[int] = []
    committed_at_read: list[int] = []
    get_object = rig.s3.get_object

    async def probed(**kw: Any) -> dict[str, Any]:
        used_at_read.append(budget.used)
        committed_at_read.append(len(rig.store.rows))
        return await get_object(**kw)

    rig.s3.get_object = probed
    for k, data in docs.items():
        rig.s3.put(k, data)
    bodies = [pointer_body(k) for k in docs]
    for b in bodies:
        rig.queue.send(b)
    await until(lambda: not rig.queue.messages, "drained")
    assert sorted(rig.store.rows) == ["r0", "r1", "r2"]
    # Each round opens every pointer left (3, 2, 1), reads what fits: at each open the
    # budget holds the bodies and nothing else (the previous round's payload went back; a
    # poll waiting for its room got none).
    # (A body is charged for its JSON values too: service.core.limits.held_bytes.)
    from service.core.limits import held_bytes

    assert used_at_read == [sum(held_bytes(b) for b in bodies)] * 6
    assert committed_at_read == [0, 0, 0, 1, 1, 2]  # a commit between rounds
    await rig.stop()
    assert budget.used == 0


def test_a_body_of_many_json_values_is_not_parsed_to_look_for_a_pointer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Security review, issue 42: the pointer's class name inside a nested bomb made the
    pointer check parse the whole body (26 times its size) before parse() could refuse it."""
    import orjson

    from service.core import pointers
    from service.core.limits import MAX_JSON_VALUES

    bomb = json.dumps({"request_id": "r", "type": "note", "payload": {
        "n": 1, "note": pointers.MARK, "junk": [{}] * MAX_JSON_VALUES}})
    loads: list[int] = []
    real = orjson.loads

    def spy(text: str | bytes) -> Any:
        loads.append(len(text))
        return real(text)

    monkeypatch.setattr(orjson, "loads", spy)  # the module pointers parses with
    assert find_pointer(bomb) is None
    assert loads == []
    assert find_pointer(pointer_body("k1")) == Pointer("payloads", "k1")  # still found

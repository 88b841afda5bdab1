"""The AWS extended clients as the producers (``amazon-sqs-extended-client``,
``amazon-sns-extended-client``, none of it written by us), LocalStack (SQS, SNS, S3) in host
mode, the real daemon process and PostgreSQL: payloads offloaded to S3 land exactly as
sent, through SQS directly and through SNS with raw delivery on and off; the pointers that
cannot be read are dead letters that keep the pointer byte for byte; after the opt-in
delete a redelivered pointer is a duplicate; message attributes reach the table and the
handler."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import boto3
import pytest
from aiohttp import web

from tests.acceptance.harness import Daemon, daemon_env
from tests.faultproxy import FaultProxy

REGION = "us-east-1"
CURRENT = "software.amazon.payloadoffloading.PayloadS3Pointer"
LEGACY = "com.amazon.sqs.javamessaging.MessageS3Pointer"
HANDLERS = "tests.acceptance.chaos_handlers,tests.acceptance.attribute_handlers"
TENANT = {"DataType": "String", "StringValue": "acme"}


def _extended_sessions() -> tuple[Any, Any]:
    """The two client sessions. Importing the packages replaces ``boto3.Session`` for the
    whole process (each with its own class): put boto3 back, use the classes explicitly."""
    saved = (boto3.session.Session, boto3.Session, boto3.DEFAULT_SESSION)
    try:
        from sns_extended_client.session import SNSExtendedClientSession
        from sqs_extended_client.client import SQSExtendedClientSession
    finally:
        boto3.session.Session, boto3.Session, boto3.DEFAULT_SESSION = saved
    return SQSExtendedClientSession, SNSExtendedClientSession


class Producers:
    """An extended SQS client and an extended SNS client offloading to ``bucket``."""

    def __init__(self, endpoint: str, bucket: str) -> None:
        sqs_session, sns_session = _extended_sessions()
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
        self.s3.create_bucket(Bucket=bucket)
        self.bucket = bucket
        # Their own S3 client would go to AWS: the same LocalStack instead.
        self.sqs = sqs_session(region_name=REGION).client("sqs", endpoint_url=endpoint)
        self.sqs.s3_client = self.s3
        self.sqs.large_payload_support = bucket
        self.sns = sns_session(region_name=REGION).client("sns", endpoint_url=endpoint)
        self.sns.s3_client = self.s3
        self.sns.large_payload_support = bucket
        self.plain_sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)

    def send(self, queue_url: str, body: str, *, always: bool = False, legacy: bool = False,
             attributes: dict[str, Any] | None = None) -> None:
        self.sqs.always_through_s3 = always
        self.sqs.use_legacy_attribute = legacy
        self.sqs.send_message(QueueUrl=queue_url, MessageBody=body,
                              MessageAttributes=dict(attributes or {}))

    def publish(self, topic: str, body: str, *, always: bool = False,
                attributes: dict[str, Any] | None = None) -> None:
        self.sns.always_through_s3 = always
        self.sns.publish(TopicArn=topic, Message=body, MessageAttributes=dict(attributes or {}))

    def exists(self, key: str) -> bool:
        try:
            self.s3.head_object(Bucket=self.bucket, Key=key)
        except self.s3.exceptions.ClientError:
            return False
        return True


def upsert(rid: str, eid: str, size: int, seed: int) -> tuple[str, dict[str, Any]]:
    """An entity.upsert of about ``size`` bytes of JSON (incompressible data)."""
    blob = base64.b64encode(random.Random(seed).randbytes(size * 3 // 4)).decode()
    data = {"seed": seed, "blob": blob}
    return json.dumps({"request_id": rid, "type": "entity.upsert",
                       "payload": {"entity_id": eid, "version": 1, "data": data}}), data


def echo(rid: str, note: str) -> str:
    return json.dumps({"request_id": rid, "type": "attributes.echo", "payload": {"note": note}})



@pytest.fixture
def producers(localstack: str) -> Producers:
    return Producers(localstack, f"payloads-{uuid.uuid4().hex[:10]}")


def make_queue(sqs: Any) -> tuple[str, str]:
    url = sqs.create_queue(QueueName=f"src-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return str(url), str(arn)


def subscribe(sns: Any, queue_arn: str, raw: bool) -> str:
    topic = sns.create_topic(Name=f"t-{uuid.uuid4().hex[:10]}")["TopicArn"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn,
                  Attributes={"RawMessageDelivery": "true" if raw else "false"})
    return str(topic)


async def wait_for(conn: asyncpg.Connection, sql: str, want: int, what: str, d: Daemon,
                   timeout: float = 40) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (got := await conn.fetchval(sql)) < want:
        assert not d.exited(), d.logs()
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: {got} of {want}\n{d.logs()}")
        await asyncio.sleep(0.2)


def drained(sqs: Any, url: str) -> bool:
    a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    return a["ApproximateNumberOfMessages"] == "0" and a["ApproximateNumberOfMessagesNotVisible"] == "0"


async def test_offloaded_payloads_through_sqs_and_sns_land_exactly_as_sent(
    database_url: str, localstack: str, producers: Producers, spawn: Callable[..., Daemon],
) -> None:
    p = producers
    url, arn = make_queue(p.plain_sqs)
    raw_topic, env_topic = subscribe(p.sns, arn, raw=True), subscribe(p.sns, arn, raw=False)
    sent: dict[str, dict[str, Any]] = {}
    seed = 0

    def entity(route: str, size: int) -> str:
        nonlocal seed
        seed += 1
        body, data = upsert(f"r-{route}-{size}", f"e-{route}-{size}", size, seed)
        sent[f"e-{route}-{size}"] = data
        return body

    for size, always in ((300_000, False), (2_000_000, False), (2_000, True)):
        p.send(url, entity("sqs", size), always=always,
               attributes={"tenant": TENANT} if size == 300_000 else None)
        p.publish(raw_topic, entity("raw", size), always=always)
        p.publish(env_topic, entity("env", size), always=always,
                  attributes={"tenant": TENANT} if size == 2_000 else None)
    p.send(url, entity("legacy", 300_000), legacy=True)  # MessageS3Pointer
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=entity("inline", 2_000))
    # A handler reads the attributes of its own message (offloaded, through SNS, raw off).
    p.publish(env_topic, echo("r-echo", "hi"), always=True, attributes={"tenant": TENANT})
    p.send(url, echo("r-echo-sqs", "hi"), always=True, attributes={"tenant": TENANT})

    d = spawn(daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                         INGEST_S3_BUCKETS=p.bucket))
    conn = await asyncpg.connect(database_url)
    try:
        await wait_for(conn, "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'",
                       len(sent) + 2, "requests completed", d)
        rows = await conn.fetch("SELECT entity_id, data FROM entities")
        assert {r["entity_id"]: json.loads(r["data"]) for r in rows} == sent  # as sent
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0, d.logs()
        mods = {r["request_id"]: {k: json.loads(v) if k in ("message_attributes", "result")
                                  and v is not None else v for k, v in r.items()}
                for r in await conn.fetch("SELECT request_id, payload_pointer,"
                                          " message_attributes, result FROM modifications")}
    finally:
        await conn.close()
    offloaded = {rid for rid, r in mods.items() if r["payload_pointer"]}
    assert offloaded == set(mods) - {"r-inline-2000"}
    assert all(r["payload_pointer"].startswith(f"s3://{p.bucket}/") for rid, r in mods.items()
               if rid in offloaded)
    size_attr = {"DataType": "Number", "StringValue": "300"}
    assert mods["r-sqs-300000"]["message_attributes"]["tenant"] == TENANT
    assert mods["r-sqs-300000"]["message_attributes"]["ExtendedPayloadSize"]["DataType"] == "Number"
    assert "SQSLargePayloadSize" in mods["r-legacy-300000"]["message_attributes"]
    for rid in ("r-raw-300000", "r-env-300000"):  # SQS attribute (raw) or envelope's (not raw)
        got = mods[rid]["message_attributes"]["ExtendedPayloadSize"]
        assert got["DataType"] == size_attr["DataType"] and int(got["StringValue"]) > 300_000
    assert mods["r-env-2000"]["message_attributes"]["tenant"] == TENANT
    assert mods["r-inline-2000"]["message_attributes"] is None
    for rid in ("r-echo", "r-echo-sqs"):
        assert mods[rid]["result"]["attributes"]["tenant"] == TENANT, mods[rid]["result"]
    assert d.metric("sqs_ingest_s3_fetches_total", outcome="fetched") == len(offloaded)
    # The S3 client is the daemon's session's: its requests are counted like SQS's.
    assert d.metric("sqs_ingest_aws_requests_total", service="s3",
                    operation="GetObject") >= len(offloaded)
    assert d.stop() == 0


async def test_unreadable_pointers_are_dead_letters_and_a_redelivery_after_delete_is_a_duplicate(
    database_url: str, localstack: str, producers: Producers, spawn: Callable[..., Daemon],
) -> None:
    p = producers
    url, _ = make_queue(p.plain_sqs)
    tag = uuid.uuid4().hex[:8]

    def pointer(key: str) -> str:  # the body the Python extended client writes
        return json.dumps([CURRENT, {"s3BucketName": p.bucket, "s3Key": key}])

    def keyed(key: str) -> dict[str, Any]:  # the client's own way to choose the key
        return {"S3Key": {"DataType": "String", "StringValue": key}}

    body, _ = upsert("r-gone", "e-gone", 300_000, 1)
    p.send(url, body, attributes=keyed(f"gone-{tag}"))
    p.s3.delete_object(Bucket=p.bucket, Key=f"gone-{tag}")
    body, _ = upsert("r-big", "e-big", 2_000_000, 2)
    p.send(url, body, attributes=keyed(f"big-{tag}"))
    body, kept = upsert("r-keep", "e-keep", 300_000, 3)
    p.send(url, body, attributes=keyed(f"keep-{tag}"))

    d = spawn(daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                         INGEST_S3_BUCKETS=p.bucket,
                         INGEST_MAX_PAYLOAD_BYTES=str(1024 * 1024),
                         INGEST_S3_DELETE_AFTER_ACK="true"))
    conn = await asyncpg.connect(database_url)
    try:
        await wait_for(conn, "SELECT count(*) FROM dead_letters", 2, "dead letters", d)
        await wait_for(conn, "SELECT count(*) FROM entities", 1, "the readable one", d)
        letters = {r["reason"]: r["body"] for r in await conn.fetch(
            "SELECT reason, body FROM dead_letters")}
        assert letters == {"payload_object_missing": pointer(f"gone-{tag}"),
                           "payload_too_large": pointer(f"big-{tag}")}  # byte for byte
        assert json.loads(await conn.fetchval(
            "SELECT data FROM entities WHERE entity_id = 'e-keep'")) == kept
        # Opt-in: deleted after its commit and ack; a dead letter's object stays (replay).
        deadline = asyncio.get_running_loop().time() + 20
        while p.exists(f"keep-{tag}"):
            assert asyncio.get_running_loop().time() < deadline, d.logs()
            await asyncio.sleep(0.2)
        assert p.exists(f"big-{tag}")

        # The same pointer delivered again (SQS at-least-once, an SNS duplicate): its object
        # is gone, its request is known and COMPLETED.
        before = d.metric("sqs_ingest_messages_processed_total", outcome="duplicate")
        p.plain_sqs.send_message(QueueUrl=url, MessageBody=pointer(f"keep-{tag}"))
        deadline = asyncio.get_running_loop().time() + 20
        while d.metric("sqs_ingest_messages_processed_total", outcome="duplicate") == before:
            assert asyncio.get_running_loop().time() < deadline, d.logs()
            await asyncio.sleep(0.2)
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 2
        assert drained(p.plain_sqs, url)
    finally:
        await conn.close()
    assert d.metric("sqs_ingest_dead_letters_total", reason="payload_object_missing") == 1
    assert d.metric("sqs_ingest_s3_fetches_total", outcome="too_large") == 1
    assert d.metric("sqs_ingest_s3_deletes_total", outcome="deleted") == 1
    assert d.stop() == 0


class S3Outage(FaultProxy):
    """S3 in front of LocalStack that answers every request 503 SlowDown while ``down``."""

    down = True
    refused = 0

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        if not self.down:
            return await super()._serve(request)
        self.refused += 1
        return web.Response(status=503, content_type="application/xml", text=(
            "<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
            "<Message>injected: S3 down</Message></Error>"))


async def test_an_s3_outage_hands_pointers_back_until_s3_answers_again(
    database_url: str, localstack: str, producers: Producers, spawn: Callable[..., Daemon],
) -> None:
    p = producers
    url, _ = make_queue(p.plain_sqs)
    sent = {}
    for i in range(3):
        body, sent[f"e-out-{i}"] = upsert(f"r-out-{i}", f"e-out-{i}", 300_000, 10 + i)
        p.send(url, body)
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=upsert("r-inline", "e-inline", 500, 9)[0])
    with S3Outage(localstack) as s3:
        d = spawn(daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                             INGEST_S3_BUCKETS=p.bucket,
                             INGEST_S3_ENDPOINT_URL=s3.url, INGEST_RETRY_BASE_SECONDS="1",
                             INGEST_RETRY_MAX_SECONDS="2"))
        conn = await asyncpg.connect(database_url)
        try:
            # Each pointer fails (after botocore's own 3 attempts) and is handed back with the
            # daemon's backoff; the inline neighbour is not held up.
            await wait_for(conn, "SELECT count(*) FROM entities WHERE entity_id = 'e-inline'", 1,
                           "the inline neighbour", d)
            deadline = asyncio.get_running_loop().time() + 30
            while d.metric("sqs_ingest_s3_errors_total", kind="throttled") < 3:
                assert asyncio.get_running_loop().time() < deadline, d.logs()
                await asyncio.sleep(0.2)
            assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
            assert d.ready() and not d.exited()
            s3.down = False
            await wait_for(conn, "SELECT count(*) FROM entities", 4, "all after the outage", d)
            rows = {r["entity_id"]: json.loads(r["data"]) for r in await conn.fetch(
                "SELECT entity_id, data FROM entities WHERE entity_id LIKE 'e-out-%'")}
            assert rows == sent
            assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
        finally:
            await conn.close()
        assert d.metric("sqs_ingest_s3_fetches_total", outcome="error") >= 3
        assert d.metric("sqs_ingest_s3_fetches_total", outcome="fetched") == 3
        # Every GetObject that reached S3's endpoint, refused or served, counted once.
        assert d.metric("sqs_ingest_aws_requests_total", service="s3",
                        operation="GetObject") == sum(s3.by_action.values()) > s3.refused >= 9
        assert d.stop() == 0

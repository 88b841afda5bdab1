"""What a sender cannot make the daemon do with S3 (issue 20), on LocalStack (SQS, S3) in
host mode with the real daemon process and PostgreSQL, S3 reached through a small proxy
that records every request and refuses reads as a bucket policy or a disabled KMS key
would (403 AccessDenied):

- a pointer to a bucket outside ``INGEST_S3_BUCKETS`` is dead-lettered on its first
  receive, byte for byte, and its object — which exists — is never requested;
- an object S3 keeps refusing is dead-lettered as ``payload_unreadable`` once
  ``INGEST_S3_UNREADABLE_AFTER`` has passed since its first refusal (through fresh copies
  near maxReceiveCount) and not before, nothing reaches the queue's own DLQ, inline
  messages flow meanwhile, and ``dlq replay`` applies it once access is fixed;
- an outage where S3 refuses every read, shorter than the bound, dead-letters nothing and
  its pointers complete once S3 answers again.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
from aiohttp import web

from tests.acceptance.harness import REPO, Daemon, daemon_env
from tests.acceptance.test_extended_clients import (
    CURRENT,
    HANDLERS,
    Producers,
    make_queue,
    upsert,
    wait_for,
)
from tests.faultproxy import FaultProxy
from tests.servers import wait_until


class S3Gate(FaultProxy):
    """S3 in front of LocalStack: records each request's path; answers 403 AccessDenied to
    the reads of keys containing one of ``refuse`` (every read while ``refuse_all``)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.paths: list[str] = []
        self.refuse: set[str] = set()
        self.refuse_all = False
        self.refused = 0

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(f"{request.method} {request.path}")
        if request.method == "GET" and (self.refuse_all or any(
                k in request.path for k in self.refuse)):
            self.refused += 1
            return web.Response(status=403, content_type="application/xml", text=(
                "<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                "<Message>injected: Access Denied</Message></Error>"))
        return await super()._serve(request)


def pointer(bucket: str, key: str) -> str:
    return json.dumps([CURRENT, {"s3BucketName": bucket, "s3Key": key}])


async def test_a_pointer_to_a_bucket_outside_the_allow_list_is_never_read(
    database_url: str, localstack: str, spawn: Callable[..., Daemon],
) -> None:
    tag = uuid.uuid4().hex[:10]
    p = Producers(localstack, f"allowed-{tag}")
    other = f"other-{tag}"
    p.s3.create_bucket(Bucket=other)
    url, _ = make_queue(p.plain_sqs)
    body, _ = upsert("r-other", "e-other", 2_000, 1)
    p.s3.put_object(Bucket=other, Key="k-other", Body=body.encode())  # exists, readable
    body, kept = upsert("r-ok", "e-ok", 2_000, 2)
    p.s3.put_object(Bucket=p.bucket, Key="k-ok", Body=body.encode())
    refused = pointer(other, "k-other")
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=refused)
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=pointer(p.bucket, "k-ok"))
    with S3Gate(localstack) as s3:
        d = spawn(daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                             INGEST_S3_ENDPOINT_URL=s3.url, INGEST_S3_BUCKETS=p.bucket))
        conn = await asyncpg.connect(database_url)
        try:
            await wait_for(conn, "SELECT count(*) FROM dead_letters", 1, "the dead letter", d)
            await wait_for(conn, "SELECT count(*) FROM entities", 1, "the allowed one", d)
            rows = await conn.fetch("SELECT reason, body, receive_count, error FROM dead_letters")
            assert [(r["reason"], r["body"], r["receive_count"]) for r in rows] == [
                ("payload_bucket_not_allowed", refused, 1)]  # byte for byte, first receive
            assert "INGEST_S3_BUCKETS" in rows[0]["error"]
            assert json.loads(await conn.fetchval(
                "SELECT data FROM entities WHERE entity_id = 'e-ok'")) == kept
            assert await conn.fetchval(
                "SELECT count(*) FROM entities WHERE entity_id = 'e-other'") == 0
        finally:
            await conn.close()
        assert d.stop() == 0
    assert [x for x in s3.paths if other in x] == [], s3.paths  # never requested
    assert any(f"/{p.bucket}/k-ok" in x for x in s3.paths), s3.paths




def queue_with_dlq(sqs: Any, max_receive_count: int) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    dlq = sqs.create_queue(QueueName=f"dlq-{tag}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"]
    src = sqs.create_queue(QueueName=f"src-{tag}", Attributes={
        "VisibilityTimeout": "10", "RedrivePolicy": json.dumps(
            {"deadLetterTargetArn": arn, "maxReceiveCount": max_receive_count})})["QueueUrl"]
    return str(src), str(dlq)


def depth(sqs: Any, url: str) -> int:
    a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return (int(a["ApproximateNumberOfMessages"]) + int(a["ApproximateNumberOfMessagesNotVisible"])
            + int(a.get("ApproximateNumberOfMessagesDelayed", "0")))


async def test_an_object_s3_keeps_refusing_is_dead_lettered_after_the_bound_then_replayed(
    database_url: str, localstack: str, spawn: Callable[..., Daemon],
) -> None:
    tag = uuid.uuid4().hex[:10]
    p = Producers(localstack, f"payloads-{tag}")
    url, dlq = queue_with_dlq(p.plain_sqs, 2)
    denied_body, denied = upsert("r-denied", "e-denied", 2_000, 1)
    p.s3.put_object(Bucket=p.bucket, Key="k-denied", Body=denied_body.encode())
    refused = pointer(p.bucket, "k-denied")
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=refused)
    bound = 6
    with S3Gate(localstack) as s3:
        s3.refuse.add("k-denied")
        env = daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                         INGEST_S3_ENDPOINT_URL=s3.url, INGEST_S3_BUCKETS=p.bucket,
                         INGEST_S3_UNREADABLE_AFTER=str(bound),
                         INGEST_RETRY_BASE_SECONDS="1", INGEST_RETRY_MAX_SECONDS="1")
        d = spawn(env)
        conn = await asyncpg.connect(database_url)
        try:
            # Inline messages keep flowing while the pointer is refused.
            for i in range(3):
                p.plain_sqs.send_message(QueueUrl=url,
                                         MessageBody=upsert(f"r-in-{i}", f"e-in-{i}", 200, i)[0])
            await wait_for(conn, "SELECT count(*) FROM entities", 3, "the inline ones", d)
            await wait_for(conn, "SELECT count(*) FROM dead_letters", 1, "the dead letter", d,
                           timeout=60)
            row = await conn.fetchrow(
                "SELECT d.reason, d.body, d.error, "
                "       extract(epoch FROM d.received_at - r.first_refused_at) AS after, "
                "       r.refusals "
                "  FROM dead_letters d, payload_refusals r WHERE r.pointer = $1",
                f"s3://{p.bucket}/k-denied")
            assert (row["reason"], row["body"]) == ("payload_unreadable", refused)
            assert row["after"] >= bound and row["refusals"] >= 3, dict(row)  # not before
            assert "INGEST_S3_UNREADABLE_AFTER" in row["error"]
            # Refused across receives near maxReceiveCount (2): carried by fresh copies.
            assert d.metric("sqs_ingest_requeued_total") >= 1, d.logs()
            # Counted after the letter's commit, which the wait above saw: wait for it too.
            wait_until(lambda: d.metric("sqs_ingest_dead_letters_total",
                                        reason="payload_unreadable") >= 1, 30,
                       "the dead letter counted")
            assert d.metric("sqs_ingest_dead_letters_total", reason="payload_unreadable") == 1
            assert await conn.fetchval(
                "SELECT count(*) FROM entities WHERE entity_id = 'e-denied'") == 0
            deadline = asyncio.get_running_loop().time() + 30
            while depth(p.plain_sqs, url):
                assert asyncio.get_running_loop().time() < deadline, d.logs()
                await asyncio.sleep(0.2)
            assert depth(p.plain_sqs, dlq) == 0  # never the queue's own DLQ

            # Access fixed: `dlq replay` sends the pointer body again and it is applied.
            s3.refuse.clear()
            cli = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
                   **{k: v for k, v in env.items() if k.startswith(("INGEST_", "AWS_"))},
                   "PYTHONPATH": str(REPO)}
            res = subprocess.run([sys.executable, "-m", "service", "dlq", "replay", "--all"],
                                 env=cli, capture_output=True, text=True, timeout=60)
            assert res.returncode == 0, res.stdout + res.stderr
            await wait_for(conn, "SELECT count(*) FROM entities WHERE entity_id = 'e-denied'",
                           1, "the replayed one", d)
            assert json.loads(await conn.fetchval(
                "SELECT data FROM entities WHERE entity_id = 'e-denied'")) == denied
        finally:
            await conn.close()
        assert d.stop() == 0


async def test_every_read_refused_for_less_than_the_bound_dead_letters_nothing(
    database_url: str, localstack: str, spawn: Callable[..., Daemon],
) -> None:
    tag = uuid.uuid4().hex[:10]
    p = Producers(localstack, f"payloads-{tag}")
    url, dlq = queue_with_dlq(p.plain_sqs, 2)
    sent = {}
    for i in range(3):
        body, sent[f"e-ptr-{i}"] = upsert(f"r-ptr-{i}", f"e-ptr-{i}", 2_000, 10 + i)
        p.s3.put_object(Bucket=p.bucket, Key=f"k-{i}", Body=body.encode())
        p.plain_sqs.send_message(QueueUrl=url, MessageBody=pointer(p.bucket, f"k-{i}"))
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=upsert("r-in", "e-in", 200, 9)[0])
    with S3Gate(localstack) as s3:
        s3.refuse_all = True
        d = spawn(daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                             INGEST_S3_ENDPOINT_URL=s3.url, INGEST_S3_BUCKETS=p.bucket,
                             INGEST_S3_UNREADABLE_AFTER="600",
                             INGEST_RETRY_BASE_SECONDS="1", INGEST_RETRY_MAX_SECONDS="1"))
        conn = await asyncpg.connect(database_url)
        try:
            await wait_for(conn, "SELECT count(*) FROM entities", 1, "the inline one", d)
            # Every pointer refused on several receives, past maxReceiveCount (fresh copies).
            await wait_for(conn, "SELECT count(*) FROM payload_refusals WHERE refusals >= 3",
                           3, "three pointers refused three times", d, timeout=60)
            assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
            s3.refuse_all = False
            await wait_for(conn, "SELECT count(*) FROM entities", 4, "all after the outage", d,
                           timeout=60)
            rows = {r["entity_id"]: json.loads(r["data"]) for r in await conn.fetch(
                "SELECT entity_id, data FROM entities WHERE entity_id LIKE 'e-ptr-%'")}
            assert rows == sent
            assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
        finally:
            await conn.close()
        assert d.metric("sqs_ingest_s3_errors_total", kind="access_denied") >= 9
        assert d.stop() == 0
    assert depth(p.plain_sqs, dlq) == 0

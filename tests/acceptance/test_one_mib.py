"""1 MiB messages end to end (issue 20), on LocalStack (host mode) with the real daemon and
PostgreSQL: SQS takes messages up to 1 MiB (a queue's MaximumMessageSize). An inline
body of exactly 1 MiB is received and applied; its twin (same request, same receive) is
deferred near the queue's maxReceiveCount and goes back as a fresh copy of 1 MiB — one
SendMessageBatch entry alone, over the 256 KiB a batch of copies is otherwise cut at — and
is then acked as a duplicate; a result of ~1,000,000 bytes is published whole to an SQS
results queue whose MaximumMessageSize allows it (before: cut to result null,
result_omitted, at the 256 KiB every destination accepts)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import boto3

from tests.acceptance.harness import Daemon, counted, daemon_env
from tests.acceptance.test_extended_clients import HANDLERS, wait_for

MIB = 1024 * 1024
REGION = "us-east-1"


def exactly(size: int, rid: str) -> tuple[str, dict[str, Any]]:
    """An entity.upsert body of exactly ``size`` bytes (ASCII), and its data."""
    def body(pad: int) -> tuple[str, dict[str, Any]]:
        data = {"pad": "x" * pad}
        return json.dumps({"request_id": rid, "type": "entity.upsert", "payload": {
            "entity_id": rid, "version": 1, "data": data}}), data

    base = len(body(0)[0])
    out = body(size - base)
    assert len(out[0].encode()) == size
    return out


def depth(sqs: Any, url: str) -> int:
    a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return (int(a["ApproximateNumberOfMessages"]) + int(a["ApproximateNumberOfMessagesNotVisible"])
            + int(a.get("ApproximateNumberOfMessagesDelayed", "0")))


async def test_one_mib_body_applied_copied_and_its_result_published_whole(
    database_url: str, localstack: str, spawn: Callable[..., Daemon],
) -> None:
    sqs = boto3.client("sqs", endpoint_url=localstack, region_name=REGION)
    tag = uuid.uuid4().hex[:10]
    big = {"MaximumMessageSize": str(MIB)}
    dlq = sqs.create_queue(QueueName=f"dlq-{tag}", Attributes=big)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"]
    url = sqs.create_queue(QueueName=f"src-{tag}", Attributes={
        **big, "VisibilityTimeout": "30",
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": arn, "maxReceiveCount": 3})})[
        "QueueUrl"]
    results = sqs.create_queue(QueueName=f"results-{tag}", Attributes=big)["QueueUrl"]
    body, data = exactly(MIB, f"big-{tag}")
    note = "n" * 1_000_000
    echo = json.dumps({"request_id": f"echo-{tag}", "type": "attributes.echo",
                       "payload": {"note": note}})
    sqs.send_message(QueueUrl=url, MessageBody=body)
    sqs.send_message(QueueUrl=url, MessageBody=body)  # its twin: deferred, then a copy
    sqs.send_message(QueueUrl=url, MessageBody=echo)
    d = spawn(daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                         INGEST_RESULTS_QUEUE_URL=results))
    conn = await asyncpg.connect(database_url)
    try:
        await wait_for(conn, "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'",
                       2, "both requests", d, timeout=60)
        assert json.loads(await conn.fetchval(
            "SELECT data FROM entities WHERE entity_id = $1", f"big-{tag}")) == data
        deadline = asyncio.get_running_loop().time() + 60
        while depth(sqs, url):
            assert asyncio.get_running_loop().time() < deadline, d.logs()
            await asyncio.sleep(0.3)
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
    finally:
        await conn.close()
    assert d.metric("sqs_ingest_requeued_total") >= 1, d.logs()  # the 1 MiB fresh copy
    counted(d, {"duplicate": 1})  # the twin; counted after its delete, which the wait saw
    assert depth(sqs, dlq) == 0
    got: dict[str, Any] = {}
    deadline = asyncio.get_running_loop().time() + 60
    while len(got) < 2:
        assert asyncio.get_running_loop().time() < deadline, (list(got), d.logs())
        for m in sqs.receive_message(QueueUrl=results, MaxNumberOfMessages=10,
                                     WaitTimeSeconds=1).get("Messages", []):
            doc = json.loads(m["Body"])
            got[doc["request_id"]] = doc
    r = got[f"echo-{tag}"]
    assert "result_omitted" not in r and r["result"]["note"] == note  # whole
    assert d.stop() == 0

"""Results of any size leave: a batch call is refused whole (BatchRequestTooLong) when its
entries add up to more than the destination's batch limit (256 KiB by default on SQS queues
and SNS topics), and a single message over the message limit is refused on its own. Real
PostgreSQL outbox rows, the daemon's Publisher and sinks, LocalStack's SQS and SNS."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import boto3
import pytest
from aiobotocore.session import get_session

from service.adapters.sinks import SnsSink, SqsSink
from service.adapters.store import Store, create_pool
from service.runtime.results import Publisher


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_url, 2)
    yield p
    await p.close()


async def plant(pool: asyncpg.Pool, sizes: list[int]) -> None:
    """One COMPLETED outbox row per size, its result a string of that many bytes."""
    await pool.executemany(
        "INSERT INTO outbox (request_id, request_type, status, result)"
        " VALUES ($1, 'note', 'COMPLETED', $2::jsonb)",
        [(f"big-{i}", {"blob": "x" * n}) for i, n in enumerate(sizes)])


async def drain(pool: asyncpg.Pool, sink: Any) -> int:
    pub = Publisher(Store(pool, "w-pub", results=True), sink)
    for _ in range(20):
        claimed, _sent = await pub.publish_once()
        if claimed == 0:
            break
    return int(await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL"))


def received(sqs: Any, url: str, want: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _ in range(30):
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                  MessageAttributeNames=["All"]).get("Messages", [])
        for m in got:
            out.append(json.loads(m["Body"]))
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
        if len(out) >= want and not got:
            break
    return out


@pytest.fixture
def sqs(localstack: str) -> Any:
    return boto3.client("sqs", endpoint_url=localstack, region_name="us-east-1")


async def test_ten_results_of_120_kb_go_out_in_calls_under_the_batch_limit(
    pool: asyncpg.Pool, localstack: str, sqs: Any
) -> None:
    # 10 x 120 KB = 1.2 MB: one SendMessageBatch of ten would be refused as a whole (over
    # 1 MiB, the largest batch SQS takes; 256 KiB on queues that keep the old limit).
    await plant(pool, [120_000] * 10)
    url = sqs.create_queue(QueueName=f"res-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    async with get_session().create_client("sqs", region_name="us-east-1",
                                           endpoint_url=localstack) as client:
        assert await drain(pool, SqsSink(client, url)) == 0
    docs = received(sqs, url, 10)
    assert sorted(d["request_id"] for d in docs) == [f"big-{i}" for i in range(10)]
    assert all(len(d["result"]["blob"]) == 120_000 for d in docs)


async def test_a_result_over_the_message_limit_leaves_without_its_result(
    pool: asyncpg.Pool, localstack: str, sqs: Any
) -> None:
    # 300 KB: over SNS's (and a default SQS queue's) 256 KiB message limit.
    await plant(pool, [300_000, 10])
    topic_sns = boto3.client("sns", endpoint_url=localstack, region_name="us-east-1")
    topic = topic_sns.create_topic(Name=f"res-{uuid.uuid4().hex[:8]}")["TopicArn"]
    url = sqs.create_queue(QueueName=f"sub-{uuid.uuid4().hex[:8]}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    topic_sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn,
                        Attributes={"RawMessageDelivery": "true"})
    async with get_session().create_client("sns", region_name="us-east-1",
                                           endpoint_url=localstack) as client:
        assert await drain(pool, SnsSink(client, topic)) == 0
    docs = {d["request_id"]: d for d in received(sqs, url, 2)}
    assert set(docs) == {"big-0", "big-1"}
    assert docs["big-1"]["result"] == {"blob": "x" * 10}
    big = docs["big-0"]
    assert big["status"] == "COMPLETED" and big["result"] is None
    assert big["result_omitted"] == "too_large"

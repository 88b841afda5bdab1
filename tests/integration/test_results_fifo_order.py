"""FIFO results leave in their group's order, on moto_server's FIFO queues and PostgreSQL:
after an entry the destination answered Failed (injected: moto never answers so), and for a
poison follower dead-lettered in the batch that completes its head."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import boto3
from pydantic import BaseModel

from service.adapters.sinks import SqsSink
from service.adapters.sqs import SqsQueue, sqs_client
from service.adapters.store import Store, create_pool
from service.handlers import Registry, current_request_id
from service.runtime.results import Publisher
from service.runtime.worker import Worker
from tests.integration.conftest import eventually, make_settings


def fifo_queue(sqs: Any) -> str:
    return str(sqs.create_queue(
        QueueName=f"q-{uuid.uuid4().hex[:12]}.fifo",
        Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true",
                    "VisibilityTimeout": "30"})["QueueUrl"])


class FailingOnce:
    """The aiobotocore SQS client, but the first SendMessageBatch answers Failed for the
    entry of ``request_id`` (the others are sent), as SQS may for any entry."""

    def __init__(self, client: Any, request_id: str) -> None:
        self._client = client
        self.request_id = request_id
        self.failed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def send_message_batch(self, QueueUrl: str, Entries: list[dict[str, Any]]) -> Any:
        def rid(e: dict[str, Any]) -> str:
            return str(e["MessageAttributes"]["request_id"]["StringValue"])

        bad = [] if self.failed else [e for e in Entries if rid(e) == self.request_id]
        if not bad:
            return await self._client.send_message_batch(QueueUrl=QueueUrl, Entries=Entries)
        self.failed = True
        resp = dict(await self._client.send_message_batch(
            QueueUrl=QueueUrl, Entries=[e for e in Entries if e not in bad]))
        resp["Failed"] = [{"Id": e["Id"], "SenderFault": False, "Code": "InternalError",
                           "Message": "injected"} for e in bad]
        return resp


def results_in_order(sqs: Any, url: str, n: int) -> list[tuple[str, str]]:
    """The first ``n`` results on the FIFO queue, in its order (each deleted once read)."""
    out: list[tuple[str, str]] = []
    for _ in range(10 * n):
        if len(out) >= n:
            break
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
        for m in got.get("Messages", []):
            doc = json.loads(m["Body"])
            out.append((doc["request_id"], doc["status"]))
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return out


async def test_after_a_failed_entry_the_groups_later_results_wait(
        sqs_endpoint: str, database_url: str) -> None:
    """Twelve results of one group leave in two calls; the destination answers Failed for
    the tenth (the first call's last entry): the second call's two wait behind it, and the
    results queue holds all twelve in order."""
    sqs = boto3.client("sqs", endpoint_url=sqs_endpoint, region_name="us-east-1")
    url = fifo_queue(sqs)
    pool = await create_pool(database_url, 2)
    try:
        await pool.execute(
            "INSERT INTO outbox (request_id, request_type, status, result, group_id)"
            " SELECT 'r' || lpad(i::text, 2, '0'), 'note', 'COMPLETED', '{}'::jsonb, 'g'"
            " FROM generate_series(1, 12) i ORDER BY i")
        store = Store(pool, "w-a", results=True)
        async with sqs_client("us-east-1", sqs_endpoint) as client:
            failing = FailingOnce(client, "r10")
            publisher = Publisher(store, SqsSink(failing, url))
            first = await publisher.publish_once()
            assert failing.failed
            assert first == (12, 9)  # r01..r09; r10 failed, r11 and r12 held back
            assert await publisher.publish_once() == (3, 3)
    finally:
        await pool.close()
    assert results_in_order(sqs, url, 12) == [(f"r{i:02d}", "COMPLETED") for i in range(1, 13)]


class Step(BaseModel):
    n: int


POISON = {"n": "not a number"}  # fails validation: dead-lettered, a FAILED result


async def results_of_one_group(sqs_endpoint: str, database_url: str, db: asyncpg.Connection,
                               messages: list[tuple[str, dict[str, Any]]],
                               fail_once: str | None = None) -> list[tuple[str, str]]:
    """Send ``messages`` (request_id, payload) to one group of a FIFO queue, run the worker
    with a publisher to a FIFO results queue until every result is published (the handler
    of ``fail_once`` fails on its first call); the results in the queue's order."""
    sqs = boto3.client("sqs", endpoint_url=sqs_endpoint, region_name="us-east-1")
    source, results = fifo_queue(sqs), fifo_queue(sqs)
    reg = Registry()
    failed: list[str] = []

    async def step(p: Step, conn: asyncpg.Connection) -> None:
        if current_request_id() == fail_once and not failed:
            failed.append(fail_once)
            raise RuntimeError("transient, once")

    reg.register("step", Step, step)
    for rid, payload in messages:
        sqs.send_message(QueueUrl=source, MessageGroupId="g", MessageBody=json.dumps(
            {"request_id": rid, "type": "step", "payload": payload}))
    s = make_settings(source, database_url, sqs_endpoint, results_queue_url=results)
    pool = await create_pool(s.database_dsn, 4)
    try:
        async with sqs_client(s.aws_region, s.sqs_endpoint_url) as client:
            store = Store(pool, results=True)
            await store.register_worker(s.effective_worker_name)
            worker = Worker(s, SqsQueue(client, source), store, reg, visibility_timeout=30,
                            publisher=Publisher(store, SqsSink(client, results)))
            task = asyncio.create_task(worker.run())
            try:
                async def published() -> bool:
                    return await db.fetchval(
                        "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL"
                    ) == len(messages)
                await eventually(published, "every result published")
            finally:
                worker.request_stop()
                assert await asyncio.wait_for(task, 30) == 0
    finally:
        await pool.close()
    assert failed == ([fail_once] if fail_once else [])
    return results_in_order(sqs, results, len(messages))


async def test_a_poison_followers_result_leaves_after_its_heads(
        sqs_endpoint: str, database_url: str, db: asyncpg.Connection) -> None:
    """A head that completes and a poison follower dead-lettered in the same batch: the
    head's COMPLETED leaves first, then the follower's FAILED."""
    got = await results_of_one_group(sqs_endpoint, database_url, db,
                                     [("head", {"n": 1}), ("follower", POISON)])
    assert got == [("head", "COMPLETED"), ("follower", "FAILED")]


async def test_a_poison_message_between_two_heads_keeps_its_place(
        sqs_endpoint: str, database_url: str, db: asyncpg.Connection) -> None:
    """Valid, poison, valid in one batch: the results leave in that order (the second valid
    one waits for the next receive rather than commit before the poison's letter)."""
    got = await results_of_one_group(
        sqs_endpoint, database_url, db,
        [("first", {"n": 1}), ("poison", POISON), ("second", {"n": 2})])
    assert got == [("first", "COMPLETED"), ("poison", "FAILED"), ("second", "COMPLETED")]


async def test_a_poison_follower_waits_for_its_failed_head(
        sqs_endpoint: str, database_url: str, db: asyncpg.Connection) -> None:
    """The head's handler fails once (handed back): its poison follower is not
    dead-lettered before it, so the head's COMPLETED still leaves first."""
    got = await results_of_one_group(sqs_endpoint, database_url, db,
                                     [("head", {"n": 1}), ("follower", POISON)],
                                     fail_once="head")
    assert got == [("head", "COMPLETED"), ("follower", "FAILED")]

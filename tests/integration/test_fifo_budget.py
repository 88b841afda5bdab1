"""FIFO through the memory budget's later round, on moto_server (SQS and S3) and PostgreSQL:
a batch whose payloads do not all fit INGEST_MAX_INFLIGHT_BYTES is finished in rounds, and
a later round keeps its group's order and stays hidden like the first."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import asyncpg
import boto3
from aiobotocore.session import get_session
from pydantic import BaseModel

from service.adapters.payloads import S3Payloads, s3_client
from service.adapters.sqs import SqsQueue, sqs_client
from service.adapters.store import Store, create_pool
from service.core.messages import Received
from service.handlers import Registry, current_request_id
from service.runtime.worker import Worker
from service.settings import Settings
from tests.integration.conftest import eventually, make_settings

CURRENT = "software.amazon.payloadoffloading.PayloadS3Pointer"
PAD = "x" * 2_900  # a payload of ~3,000 bytes: a budget of 4,096 holds one


class Step(BaseModel):
    n: int
    pad: str = ""


class Receives(SqsQueue):
    """The real queue, recording the visibility changes (message id, seconds)."""

    def __init__(self, client: Any, url: str) -> None:
        super().__init__(client, url)
        self.changes: list[tuple[str, int]] = []

    async def change_visibility_batch(self, changes: Sequence[tuple[Received, int]]
                                      ) -> list[str]:
        self.changes += [(m.message_id, seconds) for m, seconds in changes]
        return await super().change_visibility_batch(changes)


def offload(sqs: Any, s3: Any, url: str, bucket: str, rid: str, n: int) -> str:
    """What an extended client does with a large body: the object in S3, the pointer on the
    queue (its JSON form). Returns the message id."""
    s3.put_object(Bucket=bucket, Key=rid, Body=json.dumps(
        {"request_id": rid, "type": "step", "payload": {"n": n, "pad": PAD}}).encode())
    pointer = json.dumps([CURRENT, {"s3BucketName": bucket, "s3Key": rid}])
    return str(sqs.send_message(QueueUrl=url, MessageBody=pointer, MessageGroupId="g")
               ["MessageId"])


@contextlib.asynccontextmanager
async def worker_with_s3(s: Settings, registry: Registry, vt: int
                         ) -> AsyncIterator[tuple[Worker, Receives]]:
    pool = await create_pool(s.database_dsn, 4)
    try:
        async with sqs_client(s.aws_region, s.sqs_endpoint_url) as client, s3_client(
                get_session(), s.aws_region, s.sqs_endpoint_url) as s3:
            store = Store(pool)
            await store.register_worker(s.effective_worker_name)
            queue = Receives(client, s.queue_url)
            worker = Worker(s, queue, store, registry, visibility_timeout=vt,
                            payloads=S3Payloads(s3, s.max_payload_bytes, allowed=s.s3_buckets))
            task = asyncio.create_task(worker.run())
            try:
                yield worker, queue
            finally:
                if not task.done():
                    worker.request_stop()
                assert await asyncio.wait_for(task, 30) == 0
    finally:
        await pool.close()


def fifo_queue(sqs: Any, vt: int) -> str:
    return str(sqs.create_queue(
        QueueName=f"q-{uuid.uuid4().hex[:12]}.fifo",
        Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true",
                    "VisibilityTimeout": str(vt)})["QueueUrl"])


def setup(sqs_endpoint: str, vt: int) -> tuple[Any, str, Callable[[str, int], str]]:
    sqs = boto3.client("sqs", endpoint_url=sqs_endpoint, region_name="us-east-1")
    s3 = boto3.client("s3", endpoint_url=sqs_endpoint, region_name="us-east-1")
    bucket = f"payloads-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    url = fifo_queue(sqs, vt)
    return bucket, url, lambda rid, n: offload(sqs, s3, url, bucket, rid, n)


def budget_settings(url: str, database_url: str, endpoint: str, bucket: str) -> Settings:
    return make_settings(url, database_url, endpoint, s3_buckets=bucket,
                         max_payload_bytes=4096, max_inflight_bytes=4096)


async def completed(db: asyncpg.Connection) -> list[str]:
    return [r["request_id"] for r in await db.fetch(
        "SELECT request_id FROM modifications WHERE status = 'COMPLETED' ORDER BY completed_at")]


async def test_a_follower_in_a_later_round_waits_for_its_failed_head(
        sqs_endpoint: str, database_url: str, db: asyncpg.Connection) -> None:
    """One group, head and follower both S3 pointers, room for one payload, the head's
    handler failing once: the follower is never applied before the head."""
    bucket, url, send = setup(sqs_endpoint, 30)
    await db.execute("CREATE TABLE steps (seq bigserial PRIMARY KEY, rid text)")
    failed: list[str] = []
    reg = Registry()

    async def step(p: Step, conn: asyncpg.Connection) -> None:
        rid = current_request_id()
        if rid == "head" and not failed:
            failed.append(rid)
            raise RuntimeError("transient, once")
        # Inside the completing transaction: rolled back with it.
        await conn.execute("INSERT INTO steps (rid) VALUES ($1)", rid)

    reg.register("step", Step, step)
    send("head", 0)
    send("follower", 1)
    s = budget_settings(url, database_url, sqs_endpoint, bucket)
    async with worker_with_s3(s, reg, 30) as (worker, _):
        async def both() -> bool:
            return len(await completed(db)) == 2
        await eventually(both, "both completed")
        assert worker.budget.peak <= 4096
    assert failed == ["head"]
    assert [r["rid"] for r in await db.fetch("SELECT rid FROM steps ORDER BY seq")] == [
        "head", "follower"]
    assert await completed(db) == ["head", "follower"]


async def test_a_later_round_slower_than_the_visibility_timeout_stays_hidden(
        sqs_endpoint: str, database_url: str, db: asyncpg.Connection) -> None:
    """The later round's handler outlasts the visibility timeout: the heartbeat keeps its
    message hidden, so another consumer's receive does not get it while it runs."""
    vt = 2
    bucket, url, send = setup(sqs_endpoint, vt)
    sqs = boto3.client("sqs", endpoint_url=sqs_endpoint, region_name="us-east-1")
    reg = Registry()
    queues: list[Receives] = []
    stolen: list[str] = []

    async def step(p: Step, conn: asyncpg.Connection) -> None:
        if current_request_id() != "follower":
            return
        # Run until the heartbeat has hidden the follower twice, or for longer than the
        # visibility timeout (without a heartbeat it is visible again by then).
        deadline = time.monotonic() + 1.5 * vt
        while time.monotonic() < deadline and sum(
                1 for mid, _ in queues[0].changes if mid == follower) < 2:
            await asyncio.sleep(0.05)
        got = await asyncio.to_thread(sqs.receive_message, QueueUrl=url, WaitTimeSeconds=0,
                                      MaxNumberOfMessages=10, VisibilityTimeout=0)
        stolen.extend(m["MessageId"] for m in got.get("Messages", []))

    reg.register("step", Step, step)
    send("head", 0)
    follower = send("follower", 1)
    s = budget_settings(url, database_url, sqs_endpoint, bucket)
    async with worker_with_s3(s, reg, vt) as (_, queue):
        queues.append(queue)

        async def both() -> bool:
            return len(await completed(db)) == 2
        await eventually(both, "both completed")
    assert stolen == []  # hidden while its handler ran
    assert await completed(db) == ["head", "follower"]

"""A batch gives back only the claims it made itself: two batches of one worker, the second
holding a redelivery of the first one's message (same SQS MessageId), on the real
PostgreSQL store and a real SQS emulator (moto). The interleaving is forced: the first
batch waits between its claim and its completing transaction until the second is over."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from service.adapters.sqs import SqsQueue, sqs_client
from service.adapters.store import Store, create_pool
from service.core.messages import Message, Received
from service.core.retry import ReceiveLimit, RetryPolicy
from service.core.seams import ApplyResult, Batching, HandlerCall
from service.handlers import Registry, current_request_id
from service.runtime.batch import BatchProcessor
from service.runtime.dbhealth import DatabaseHealth


class P(BaseModel):
    pass


async def applied(_p: P, conn: Any) -> dict[str, Any]:
    await conn.execute("INSERT INTO fx VALUES ($1)", current_request_id())
    return {"ok": True}


class PausingStore(Store):
    """``apply`` of the batch holding ``first`` waits for ``go``; the batch holding ``other``
    fails there (``mode == "fails"``) or hangs there until cancelled (``"cancelled"``)."""

    def __init__(self, pool: asyncpg.Pool, mode: str) -> None:
        super().__init__(pool, "one-worker")
        self.mode = mode
        self.parked = asyncio.Event()  # the first batch is between its claim and its commit
        self.go = asyncio.Event()
        self.second_applying = asyncio.Event()

    async def apply(self, messages: Sequence[Message], call: HandlerCall, fifo: bool = False,
                    batch: Batching | None = None, entity_rows: Any = None,
                    time_limit: float | None = None) -> ApplyResult:
        ids = {m.request_id for m in messages}
        if "first" in ids:
            self.parked.set()
            await self.go.wait()
        elif "other" in ids:
            self.second_applying.set()
            if self.mode == "fails":
                raise RuntimeError("the second batch fails")
            await asyncio.Event().wait()  # until cancelled
        return await super().apply(messages, call, fifo, batch, entity_rows, time_limit)


@pytest.fixture
async def fx(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE fx (rid text)")
    return db


@pytest.fixture
async def queue(sqs_endpoint: str, queue_url: str) -> AsyncIterator[SqsQueue]:
    async with sqs_client("us-east-1", sqs_endpoint) as client:
        yield SqsQueue(client, queue_url)


async def receive(queue: SqsQueue, want: set[str]) -> list[Received]:
    """Receive until every message whose request_id is in ``want`` is in hand."""
    got: list[Received] = []
    for _ in range(50):
        got += await queue.receive(10, 1, 30)
        if {json.loads(m.body)["request_id"] for m in got} >= want:
            return got
    raise AssertionError(f"never received {want}")


@pytest.mark.parametrize("mode", ["fails", "cancelled"])
async def test_a_batch_that_met_only_contention_never_releases_the_claim_of_another(
    database_url: str, fx: asyncpg.Connection, queue: SqsQueue, mode: str
) -> None:
    reg = Registry()
    reg.register("t", P, applied)
    pool = await create_pool(database_url, 4)
    try:
        store = PausingStore(pool, mode)
        await store.register_worker("one")
        health = DatabaseHealth(store, asyncio.Event(), lambda: asyncio.sleep(0))
        proc = BatchProcessor(queue, store, reg, RetryPolicy(max_failures=3), health,
                              fifo=False, visibility_timeout=30, handler_timeout=60,
                              fatal=lambda *a, **k: None, limit=ReceiveLimit(3))
        await queue.send(json.dumps({"request_id": "first", "type": "t", "payload": {}}))
        batch1 = await receive(queue, {"first"})
        task1 = asyncio.create_task(proc.run(batch1))
        await asyncio.wait_for(store.parked.wait(), 30)  # claimed, not yet fenced

        # The same SQS message again (same MessageId: what SQS redelivers), beside another.
        await queue.change_visibility_batch([(batch1[0], 0)])
        await queue.send(json.dumps({"request_id": "other", "type": "t", "payload": {}}))
        batch2 = await receive(queue, {"first", "other"})
        assert batch1[0].message_id in {m.message_id for m in batch2}
        task2 = asyncio.create_task(proc.run(batch2))
        await asyncio.wait_for(store.second_applying.wait(), 30)
        if mode == "cancelled":
            task2.cancel()
        await asyncio.gather(task2, return_exceptions=True)
        # The second batch met "first" claimed (by this very worker) and gave it back to
        # the queue; the claim is the first batch's, and stays.
        row = await fx.fetchrow("SELECT status, owner FROM modifications"
                                " WHERE request_id = 'first'")
        assert row is not None and tuple(row) == ("IN_PROGRESS", "one-worker")

        store.go.set()
        await asyncio.wait_for(task1, 30)
        assert await fx.fetchval("SELECT status FROM modifications"
                                 " WHERE request_id = 'first'") == "COMPLETED"
        assert await fx.fetchval("SELECT count(*) FROM fx WHERE rid = 'first'") == 1
        health.cancel()
    finally:
        await pool.close()

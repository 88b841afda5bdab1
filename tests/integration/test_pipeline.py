"""The worker in-process against real PostgreSQL and the SQS emulator."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
from pydantic import BaseModel

from service.handlers import Registry
from tests.integration.conftest import eventually, make_settings, running_worker


def upsert(rid: str, eid: str, version: int) -> str:
    return json.dumps({"request_id": rid, "type": "entity.upsert",
                       "payload": {"entity_id": eid, "version": version, "data": {"v": version}}})


def depth(sqs: Any, url: str) -> int:
    a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return int(a["ApproximateNumberOfMessages"]) + int(a["ApproximateNumberOfMessagesNotVisible"])


async def test_pipeline_end_to_end(sqs_client: Any, sqs_endpoint: str, queue_url: str,
                                   database_url: str, db: asyncpg.Connection) -> None:
    bodies = [upsert(f"r{i}", f"e{i % 3}", i) for i in range(30)]
    bodies += [bodies[0], bodies[5], json.dumps({"Type": "Notification", "Message": bodies[7]})]
    bodies += ["not json"]
    for b in bodies:
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=b)
    s = make_settings(queue_url, database_url, sqs_endpoint)
    async with running_worker(s):
        async def drained() -> bool:
            return depth(sqs_client, queue_url) == 0
        await eventually(drained, "queue drained")
        # r1 reused with another payload, sent after r1 completed: on a standard queue two
        # copies in flight at once have no order, and whichever is claimed first wins.
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=upsert("r1", "e1", 999))
        await eventually(drained, "the reused key drained")
    assert await db.fetchval("SELECT count(*) FROM modifications WHERE status='COMPLETED'") == 30
    assert await db.fetchval("SELECT count(*) FROM modifications") == 30
    rows = await db.fetch("SELECT entity_id, version FROM entities ORDER BY 1")
    assert [(r["entity_id"], r["version"]) for r in rows] == [("e0", 27), ("e1", 28), ("e2", 29)]
    dl = {r["body"]: r["reason"] for r in await db.fetch("SELECT body, reason FROM dead_letters")}
    assert dl == {"not json": "invalid_json", upsert("r1", "e1", 999): "idempotency_key_reused"}


class Step(BaseModel):
    n: int


async def test_fifo_order_within_a_group(sqs_client: Any, sqs_endpoint: str, fifo_queue_url: str,
                                         database_url: str, db: asyncpg.Connection) -> None:
    await db.execute("CREATE TABLE steps (seq bigserial PRIMARY KEY, grp text, n int)")
    failed_once: set[int] = set()
    reg = Registry()

    async def step(p: Step, conn: asyncpg.Connection) -> None:
        from service.handlers import current_request_id

        group = current_request_id().split("-")[0]
        if p.n == 3 and group == "A" and 3 not in failed_once:
            failed_once.add(3)
            raise RuntimeError("transient, once")
        # Recorded inside the completing transaction: rolled back with it.
        await conn.execute("INSERT INTO steps (grp, n) VALUES ($1, $2)", group, p.n)

    reg.register("step", Step, step)
    for n in range(6):
        for g in ("A", "B"):
            sqs_client.send_message(
                QueueUrl=fifo_queue_url, MessageGroupId=g,
                MessageBody=json.dumps({"request_id": f"{g}-{n}", "type": "step",
                                        "payload": {"n": n}}))
    s = make_settings(fifo_queue_url, database_url, sqs_endpoint, retry_base_seconds=1)
    async with running_worker(s, reg):
        async def done() -> bool:
            return await db.fetchval(
                "SELECT count(*) FROM modifications WHERE status='COMPLETED'") == 12
        await eventually(done, "12 completed")
    applied = [(r["grp"], r["n"]) for r in await db.fetch("SELECT grp, n FROM steps ORDER BY seq")]
    for g in ("A", "B"):
        assert [n for grp, n in applied if grp == g] == list(range(6)), applied
    assert failed_once == {3}

"""Dead letters are inserted in ``sqs_message_id`` order (the conflict key), whatever order
a batch lists them in: two replicas dead-lettering the same redelivered messages — each
batch in its own receive order — take the unique-index entries in one order, so neither
waits on the other while holding what the other waits for (a deadlock, SQLSTATE 40P01)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from service.adapters.sql import queries
from service.adapters.store import DeadLetter, Store, _dead_letter_args, create_pool

Q = queries()


def letter(mid: str) -> DeadLetter:
    return DeadLetter(mid, f"body of {mid}", "invalid_json", "not json", f"r-{mid}",
                      "entity.upsert", 1)


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_url, 2)
    yield p
    await p.close()


async def waiting_on_a_lock(watch: asyncpg.Connection, other_pid: int) -> None:
    """Until a dead-letter statement of the store waits on a lock (the other's row)."""
    for _ in range(1000):
        if await watch.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> $1 AND wait_event_type = 'Lock'"
            " AND query LIKE '%INSERT INTO dead_letters%'", other_pid):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the store's dead-letter statement never waited on the other")


@pytest.mark.parametrize("results", [False, True])
async def test_two_replicas_dead_lettering_the_same_messages_never_deadlock(
    pool: asyncpg.Pool, database_url: str, results: bool,
) -> None:
    store = Store(pool, "replica-a", results=results)
    other = await asyncpg.connect(database_url)  # replica b, in the middle of its batch
    watch = await asyncpg.connect(database_url)
    query = Q["dead_letter_with_result" if results else "dead_letter"]
    try:
        tx = other.transaction()
        await tx.start()
        # b has inserted m-1 of its two letters (in order: m-1, then m-2) and not committed.
        await other.execute(query, *_dead_letter_args([letter("m-1")]))
        # a's batch lists the same two the other way round.
        a = asyncio.create_task(store.dead_letter([letter("m-2"), letter("m-1")]))
        await waiting_on_a_lock(watch, other.get_server_pid())
        # b goes on: unsorted, a would now hold m-2 while waiting for m-1 — a cycle.
        await asyncio.wait_for(
            other.execute(query, *_dead_letter_args([letter("m-2")])), 30)
        await tx.commit()
        await asyncio.wait_for(a, 30)  # nothing to insert left: both are b's
    finally:
        await other.close()
        await watch.close()
    async with pool.acquire() as conn:
        rows = await conn.fetch("SELECT sqs_message_id, body FROM dead_letters ORDER BY 1")
    assert [(r["sqs_message_id"], r["body"]) for r in rows] == [
        ("m-1", "body of m-1"), ("m-2", "body of m-2")]


async def test_results_of_one_call_keep_the_callers_order(pool: asyncpg.Pool) -> None:
    """Sorted for the locks, not for the results: the FAILED results of one call get their
    outbox ids in the order the batch gave them (a FIFO group's order)."""
    store = Store(pool, "replica-a", results=True)
    await store.dead_letter([letter("m-9"), letter("m-1"), letter("m-5")])
    async with pool.acquire() as conn:
        ids = [r["request_id"] for r in await conn.fetch("SELECT request_id FROM outbox "
                                                         "ORDER BY id")]
    assert ids == ["r-m-9", "r-m-1", "r-m-5"]

"""The outbox claim between two sessions, deterministically: while one publisher holds rows
(its send in flight), another claims none of them — SKIP LOCKED. The same claim without the
row lock sends every row twice: the strict xfail proves the test catches that."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from service.seams import OutboxRow
from service.store import Q, Store, create_pool


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_url, 4)
    try:
        await p.execute(
            "INSERT INTO outbox (request_id, request_type, status, result)"
            " SELECT 'r' || i, 'note', 'COMPLETED', '{}'::jsonb FROM generate_series(1, 5) i")
        yield p
    finally:
        await p.close()


async def two_publishers(pool: asyncpg.Pool) -> tuple[list[str], list[str]]:
    a, b = Store(pool, "w-a", results=True), Store(pool, "w-b", results=True)
    holding, release = asyncio.Event(), asyncio.Event()
    by_a: list[str] = []
    by_b: list[str] = []

    async def send_a(rows: list[OutboxRow]) -> set[int]:
        by_a.extend(r.request_id for r in rows)
        holding.set()
        await release.wait()  # session A is inside its transaction, rows claimed
        return {r.id for r in rows}

    async def send_b(rows: list[OutboxRow]) -> set[int]:
        by_b.extend(r.request_id for r in rows)
        return {r.id for r in rows}

    first = asyncio.create_task(a.publish_outbox(send_a, 10, fifo=False))
    await asyncio.wait_for(holding.wait(), 10)
    await asyncio.wait_for(b.publish_outbox(send_b, 10, fifo=False), 10)
    release.set()
    await asyncio.wait_for(first, 10)
    return by_a, by_b


async def test_a_held_row_is_skipped_by_the_other_publisher(pool: asyncpg.Pool) -> None:
    by_a, by_b = await two_publishers(pool)
    assert (sorted(by_a), by_b) == ([f"r{i}" for i in range(1, 6)], [])
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="without FOR UPDATE SKIP LOCKED both sessions send every row")
async def test_the_unlocked_claim_sends_twice(
    pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    unlocked = Q["outbox_claim"].replace("FOR UPDATE SKIP LOCKED", "")
    assert unlocked != Q["outbox_claim"]
    monkeypatch.setitem(Q, "outbox_claim", unlocked)
    await test_a_held_row_is_skipped_by_the_other_publisher(pool)

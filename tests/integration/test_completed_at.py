"""``completed_at`` is when the outcome was written, after the handlers ran — not when the
completing transaction began. Retention prunes a request ``INGEST_RETENTION_DAYS`` after
``completed_at``; a copy of the message sent while the handler ran (a contended duplicate
near the queue's receive limit is re-sent as a fresh copy) can live in SQS for
``MessageRetentionPeriod`` from its own send time, so the clock must not start earlier."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import asyncpg
import pytest

from service.adapters.store import Store, create_pool
from tests.integration.test_store import msg


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_url, 2)
    yield p
    await p.close()


@pytest.mark.parametrize("results", [False, True])
async def test_completed_at_is_taken_after_the_handler(
    pool: asyncpg.Pool, db: asyncpg.Connection, results: bool
) -> None:
    store = Store(pool, "w-clock", results=results)
    await store.register_worker("w-clock")
    seen: dict[str, datetime] = {}

    async def handler(m: Any, conn: asyncpg.Connection) -> dict[str, Any]:
        # Time passes inside the transaction while the handler works.
        await conn.execute("SELECT pg_sleep(0.05)")
        seen[m.request_id] = await conn.fetchval("SELECT clock_timestamp()")
        return {}

    m = msg("clock-1")
    assert (await store.claim([m]))["clock-1"].claimed
    res = await store.apply([m], handler)
    assert [x.request_id for x, _ in res.completed] == ["clock-1"]
    completed_at = await db.fetchval(
        "SELECT completed_at FROM modifications WHERE request_id = 'clock-1'")
    assert completed_at >= seen["clock-1"]
    if results:
        assert await db.fetchval(
            "SELECT completed_at FROM outbox WHERE request_id = 'clock-1'") == completed_at

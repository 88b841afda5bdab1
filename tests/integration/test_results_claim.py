"""The outbox claim between two sessions, deterministically: while one publisher holds rows
(its send in flight), another claims none of them — SKIP LOCKED. The same claim without the
row lock sends every row twice: the strict xfail proves the test catches that. With the row
lock but without SKIP LOCKED the second claim waits for the first publisher's transaction:
the second publisher's connections carry a ``lock_timeout``, so that fails within it, named
(tests/sql_mutants.py's ``outbox_claim_no_skip_locked``), and the first publisher is let go
whatever happened, so nothing is left holding rows when the pool closes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from service.adapters.store import Q, Store, create_pool
from service.core.seams import OutboxRow, Sent
from tests.contract.test_store_contract import PUBLISHER_LOCK_TIMEOUT_MS, beside_a_holder


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


@pytest.fixture
async def publisher_pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    """The second publisher's connections: a claim that waits for a row lock fails."""
    p = await create_pool(f"{database_url}?lock_timeout={PUBLISHER_LOCK_TIMEOUT_MS}", 2)
    try:
        yield p
    finally:
        await p.close()


async def two_publishers(
    pool: asyncpg.Pool, publisher_pool: asyncpg.Pool
) -> tuple[list[str], list[str]]:
    a = Store(pool, "w-a", results=True)
    b = Store(pool, "w-b", results=True, outbox_pool=publisher_pool)
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
    try:
        await asyncio.wait_for(holding.wait(), 10)
        await beside_a_holder(b.publish_outbox(send_b, 10, fifo=False), 10)
    finally:  # whatever failed above, A ends its transaction: no row stays held
        release.set()
        await asyncio.wait_for(first, 10)
    return by_a, by_b


async def test_a_held_row_is_skipped_by_the_other_publisher(
    pool: asyncpg.Pool, publisher_pool: asyncpg.Pool
) -> None:
    by_a, by_b = await two_publishers(pool, publisher_pool)
    assert (sorted(by_a), by_b) == ([f"r{i}" for i in range(1, 6)], [])
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="without FOR UPDATE SKIP LOCKED both sessions send every row")
async def test_the_unlocked_claim_sends_twice(
    pool: asyncpg.Pool, publisher_pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    unlocked = Q["outbox_claim"].replace("FOR UPDATE SKIP LOCKED", "")
    assert unlocked != Q["outbox_claim"]
    monkeypatch.setitem(Q, "outbox_claim", unlocked)
    await test_a_held_row_is_skipped_by_the_other_publisher(pool, publisher_pool)


# A FIFO destination's results leave in the order the batch completed them: the order of
# the outbox ids, which complete_with_result assigns with `ORDER BY g.n` (the batch's
# position). Without it the ids follow whatever order the join returns its rows in: the
# batch's order under the hash join PostgreSQL picks for this batch today (it probes with the
# batch's ids), request_id order under a merge join — a plan choice, not a promise. Each
# join is forced here (planner settings in the DSN), and EXPLAIN shows it was the one used.
PLANS = {
    "hash_join": ({"enable_nestloop": "off", "enable_mergejoin": "off"}, "Hash Join"),
    "merge_join": ({"enable_nestloop": "off", "enable_hashjoin": "off"}, "Merge Join"),
    "nested_loop": ({"enable_hashjoin": "off", "enable_mergejoin": "off"}, "Nested Loop"),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
async def test_a_groups_results_leave_in_batch_order_whatever_the_join(
    database_url: str, plan: str
) -> None:
    from tests.contract.test_store_contract import msg, ok

    settings, node = PLANS[plan]
    dsn = database_url + ("?" + "&".join(f"{k}={v}" for k, v in settings.items())
                          if settings else "")
    pool = await create_pool(dsn, 2)
    try:
        # Batch order is neither request_id order nor claim (heap) order: z…a, claimed a…z.
        batch = [msg(f"r{c}", group="g" if i % 3 else "h") for i, c in
                 enumerate("zyxwvutsrq")]
        store = Store(pool, "w-a", results=True)
        await store.register_worker("w-a")
        await store.claim(sorted(batch, key=lambda m: m.request_id))
        async with pool.acquire() as conn:
            explained = "\n".join(r[0] for r in await conn.fetch(
                "EXPLAIN " + Q["complete_with_result"], [m.request_id for m in batch],
                ["{}"] * len(batch), "w-a", [m.raw.group_id for m in batch]))
        assert node in explained, explained
        res = await store.apply(batch, ok, fifo=True)
        assert [m.request_id for m, _ in res.completed] == [m.request_id for m in batch]
        sent: list[str] = []

        async def send(rows: list[OutboxRow]) -> set[int]:
            sent.extend(r.request_id for r in rows)
            return {r.id for r in rows}

        assert await store.publish_outbox(send, 100, fifo=True) == (10, 10)
        assert sent == [m.request_id for m in batch]
    finally:
        await pool.close()


async def test_a_row_refused_for_good_is_marked_and_never_claimed_again(
    pool: asyncpg.Pool,
) -> None:
    """The destination accepts r1 and refuses r2 for good (a ``Sent`` saying so): r1 is
    published, r2 marked refused with what the destination said and counted as settled, and
    the next claim takes neither — the rows behind r2 are not held by it (on PostgreSQL, the
    store-side half of tests/integration/test_results_refused.py)."""
    store = Store(pool, "w-a", results=True)
    ids = {r["request_id"]: r["id"] for r in await pool.fetch("SELECT id, request_id FROM outbox")}
    claimed: list[list[str]] = []

    async def send(rows: list[OutboxRow]) -> set[int]:
        claimed.append(sorted(r.request_id for r in rows))
        return Sent({ids["r1"]} & {r.id for r in rows},
                    refused={ids["r2"]: "InvalidMessageContents: bad"} if any(
                        r.id == ids["r2"] for r in rows) else None)

    assert await store.publish_outbox(send, 2, False) == (2, 2)
    rows = {r["request_id"]: (r["published_at"] is not None, r["refused_at"] is not None,
                              r["refused_reason"])
            for r in await pool.fetch("SELECT * FROM outbox WHERE request_id IN ('r1', 'r2')")}
    assert rows == {"r1": (True, False, None),
                    "r2": (False, True, "InvalidMessageContents: bad")}
    assert await store.publish_outbox(send, 10, False) == (3, 0)
    assert claimed == [["r1", "r2"], ["r3", "r4", "r5"]]

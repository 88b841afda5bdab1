"""The PostgreSQL round trips one batch of the built-in path costs, counted on the wire
(tests/pgwire.py): a count, not a time, so a change that adds a round trip to every batch is
red here and not only in a benchmark. Steady state: the statements are prepared by a first
batch on the same connection (a pool of one), then a second batch of ten distinct entities is
counted alone."""

from __future__ import annotations

import asyncio
import json

from service.adapters.store import Store, create_pool
from service.core.retry import ReceiveLimit, RetryPolicy
from service.handlers import default_registry, load_reference_handlers
from service.runtime.batch import BatchProcessor
from service.runtime.dbhealth import DatabaseHealth
from service.testing import FakeQueue
from service.testing.kit import create_template, postgres_server
from tests.pgwire import PgWireCounter

#: claim · BEGIN · fence · the commit guard (a handler's own COMMIT commits nothing) · the
#: entities' upsert · complete · COMMIT · the session reset
BUILT_IN_BATCH_ROUND_TRIPS = 8
BUILT_IN_BATCH_TRANSACTIONS = 3  # the claim, the completing transaction, the reset


def body(run: str, i: int) -> str:
    return json.dumps({"request_id": f"{run}-{i}", "type": "entity.upsert",
                       "payload": {"entity_id": f"e-{run}-{i}", "version": 1, "data": {}}})


async def _count(dsn: str, wire: PgWireCounter) -> tuple[int, int]:
    load_reference_handlers()
    pool = await create_pool(dsn, 1)
    try:
        store = Store(pool, "rt-worker")
        await store.register_worker("rt")
        queue = FakeQueue()

        async def _noop() -> None:
            return None

        fatal: list[object] = []
        processor = BatchProcessor(
            queue, store, default_registry, RetryPolicy(),
            DatabaseHealth(store, asyncio.Event(), _noop), fifo=False,
            visibility_timeout=30, handler_timeout=60, fatal=lambda *a, **k: fatal.append(a),
            limit=ReceiveLimit(RetryPolicy().max_failures))
        counts = []
        for run in ("warm", "counted"):
            for i in range(10):
                queue.send(body(run, i))
            batch = await queue.receive(10, 0, 30)
            before = wire.counts()
            await processor.run(batch)
            counts.append(wire.counts().minus(before))
        assert not fatal
        assert counts[1].connections == 0  # the pool's one connection, reused
        done = await pool.fetchval("SELECT count(*) FROM modifications WHERE status = 'COMPLETED'")
        assert done == 20
        return counts[1].round_trips, counts[1].transactions
    finally:
        await pool.close()


def test_a_batch_of_the_built_in_path_costs_its_counted_round_trips() -> None:
    with postgres_server() as pg:
        asyncio.run(create_template(pg, "round_trips"))
        with PgWireCounter("127.0.0.1", pg.port, pg.user) as wire:
            trips, transactions = asyncio.run(_count(wire.dsn("round_trips"), wire))
    assert (trips, transactions) == (BUILT_IN_BATCH_ROUND_TRIPS, BUILT_IN_BATCH_TRANSACTIONS)

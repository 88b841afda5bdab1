"""The PostgreSQL round trips one batch costs, counted on the wire (tests/pgwire.py): a count,
not a time, so a change that adds a round trip to every batch is red here and not only in a
benchmark. Steady state: the statements are prepared by a first batch on the same connection
(a pool of one), then a second batch of ten is counted alone.

A batch the reference handlers carry alone (standard queue, no entity twice) costs the claim
and one fused statement; any other batch — a handler of the user's, an entity written twice —
the claim and the completing transaction of ``Store.apply``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from service.adapters.store import Store, create_pool
from service.core.retry import ReceiveLimit, RetryPolicy
from service.handlers import Registry, default_registry, load_reference_handlers
from service.runtime.batch import BatchProcessor
from service.runtime.dbhealth import DatabaseHealth
from service.testing import FakeQueue
from service.testing.kit import create_template, postgres_server
from tests.pgwire import PgWireCounter

#: claim · the fused statement (fence, the entities' upsert, complete: one implicit
#: transaction, no commit guard, no session reset)
FUSED_BATCH_ROUND_TRIPS = 2
FUSED_BATCH_TRANSACTIONS = 2  # the claim, the fused statement
#: claim · BEGIN · fence · the commit guard (a handler's own COMMIT commits nothing) · the
#: entities' upsert · complete · COMMIT · the session reset
BUILT_IN_BATCH_ROUND_TRIPS = 8
BUILT_IN_BATCH_TRANSACTIONS = 3  # the claim, the completing transaction, the reset
#: a connection's first batch: one round trip more per statement asyncpg prepares on it
FUSED_BATCH_PREPARES = 2  # the claim, the fused statement
BUILT_IN_BATCH_PREPARES = 4  # the claim, the fence, the upsert, complete (the guard: a simple query)


def body(run: str, i: int, entity: str | None = None, type_: str = "entity.upsert") -> str:
    return json.dumps({"request_id": f"{run}-{i}", "type": type_,
                       "payload": {"entity_id": entity or f"e-{run}-{i}", "version": 1,
                                   "data": {}}})


def distinct(run: str, i: int) -> str:
    return body(run, i)


def repeated(run: str, i: int) -> str:
    """The last two messages of the batch write the same entity."""
    return body(run, i, f"e-{run}-8" if i == 9 else None)


def one_of_the_users(run: str, i: int) -> str:
    """One message of the batch is of a type the user's handler carries."""
    return body(run, i, type_="rt.note" if i == 0 else "entity.upsert")


class Note:
    """A user's handler (``rt.note``): the same payload, its own statement."""

    @staticmethod
    async def fn(p: Any, conn: Any) -> dict[str, Any]:
        await conn.execute("SELECT $1::text", p.entity_id)
        return {"noted": True}


def registry(entity_rows: bool, note: bool) -> Registry:
    """The reference handlers — as the reference registers them (``entity_rows``), or as a
    user could register the very same functions — and, with ``note``, a handler of the
    user's."""
    load_reference_handlers()
    r = Registry()
    for t in ("entity.upsert", "entity.delete"):
        spec = default_registry.get(t)
        assert spec is not None and spec.batch_fn is not None and spec.entity_row is not None
        r.register(t, spec.model, spec.fn)
        r.register_batch(t, spec.batch_fn)
        if entity_rows:
            r.register_entity_row(t, spec.entity_row)
        if note and t == "entity.upsert":
            r.register("rt.note", spec.model, Note.fn)
    return r


async def _count(dsn: str, wire: PgWireCounter, reg: Registry,
                 bodies: Callable[[str, int], str], first_use: list[int]) -> tuple[int, int]:
    pool = await create_pool(dsn, 1)
    try:
        store = Store(pool, "rt-worker")
        await store.register_worker("rt")
        queue = FakeQueue()

        async def _noop() -> None:
            return None

        fatal: list[object] = []
        processor = BatchProcessor(
            queue, store, reg, RetryPolicy(),
            DatabaseHealth(store, asyncio.Event(), _noop), fifo=False,
            visibility_timeout=30, handler_timeout=60, fatal=lambda *a, **k: fatal.append(a),
            limit=ReceiveLimit(RetryPolicy().max_failures))
        counts = []
        for run in ("warm", "counted"):
            for i in range(10):
                queue.send(bodies(run, i))
            batch = await queue.receive(10, 0, 30)
            before = wire.counts()
            await processor.run(batch)
            counts.append(wire.counts().minus(before))
        assert not fatal
        assert [c.connections for c in counts] == [0, 0]  # the pool's one connection, reused
        done = await pool.fetchval("SELECT count(*) FROM modifications WHERE status = 'COMPLETED'")
        assert done == 20
        first_use[:] = [counts[0].round_trips - counts[1].round_trips]
        return counts[1].round_trips, counts[1].transactions
    finally:
        await pool.close()


def count(name: str, reg: Registry, bodies: Callable[[str, int], str],
          first_use: list[int] | None = None) -> tuple[int, int]:
    """The counted batch's (round trips, transactions); ``first_use`` gets how many round
    trips more the warm-up batch cost — the first use of each statement on the connection."""
    with postgres_server() as pg:
        asyncio.run(create_template(pg, name))
        with PgWireCounter("127.0.0.1", pg.port, pg.user) as wire:
            return asyncio.run(_count(wire.dsn(name), wire, reg, bodies,
                                      [] if first_use is None else first_use))


def test_a_batch_of_the_reference_handlers_alone_costs_the_claim_and_one_statement() -> None:
    """Warm, two round trips; on a connection's first batch, one more for each statement's
    prepare — no catalog look-up of the parameters' array types (all text[]:
    service/adapters/sql/queries.sql)."""
    first_use: list[int] = []
    assert count("round_trips", registry(entity_rows=True, note=False), distinct,
                 first_use) == (FUSED_BATCH_ROUND_TRIPS, FUSED_BATCH_TRANSACTIONS)
    assert first_use == [FUSED_BATCH_PREPARES]


def test_the_same_handlers_registered_as_a_users_cost_the_completing_transaction() -> None:
    first_use: list[int] = []
    assert count("round_trips_user", registry(entity_rows=False, note=False), distinct,
                 first_use) == (BUILT_IN_BATCH_ROUND_TRIPS, BUILT_IN_BATCH_TRANSACTIONS)
    assert first_use == [BUILT_IN_BATCH_PREPARES]


@pytest.mark.parametrize("bodies", [repeated, one_of_the_users], ids=lambda f: f.__name__)
def test_a_batch_the_fused_statement_does_not_carry_takes_the_completing_transaction(
    bodies: Callable[[str, int], str],
) -> None:
    """An entity written twice: the batch form's second round; a user's message: its own
    statement — one round trip more than the general path's eight, in its three
    transactions."""
    assert count("round_trips_" + bodies.__name__, registry(entity_rows=True, note=True),
                 bodies) == (BUILT_IN_BATCH_ROUND_TRIPS + 1, BUILT_IN_BATCH_TRANSACTIONS)

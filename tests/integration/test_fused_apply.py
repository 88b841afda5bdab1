"""The fused statement of the reference handlers (``service.adapters.store.apply_entities``,
what ``Store.apply`` runs first when given ``entity_rows``) against a real PostgreSQL: the
same effect and results as the completing transaction (the attempt loop with the handlers'
batch form), and the fence: a claim taken over before the statement, or while it waits for
the claim's row lock, is neither written nor completed. Which batches take it, and what its
errors become."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from service.adapters import completion
from service.adapters import store as store_module
from service.adapters.store import Store, create_pool
from service.core.messages import Message, Received, parse
from service.core.registry import EntityRow
from service.handlers import default_registry, load_reference_handlers
from service.handlers.invoke import Invoker
from tests.conftest import fresh_database
from tests.servers import Postgres


def message(rid: str, type_: str, payload: dict[str, Any], failures: int = 0,
            group: str | None = None) -> Message:
    load_reference_handlers()
    m = parse(Received("m-" + rid, "rh", json.dumps(
        {"request_id": rid, "type": type_, "payload": payload}), 1, None, group),
        default_registry)
    assert isinstance(m, Message)
    m.failures = failures
    return m


def rows(messages: list[Message]) -> list[EntityRow]:
    out = []
    for m in messages:
        spec = default_registry.get(m.type)
        assert spec is not None and spec.entity_row is not None
        out.append(spec.entity_row(m.payload))
    return out


async def fused_statement(store: Store, todo: list[Message],
                          entity_rows: list[EntityRow]) -> Any:
    return await store_module.apply_entities(store.pool, store.worker_id, store.results, todo,
                                             entity_rows, None)


def processor_for(store: Store, queue: Any, fatal: list[Any], registry: Any = default_registry,
                  *, fifo: bool = False, handler_timeout: float = 60) -> Any:
    """A BatchProcessor over ``store`` and ``queue`` with the worker's defaults; its fatal
    calls go to ``fatal``."""
    from service.core.retry import ReceiveLimit, RetryPolicy
    from service.runtime.batch import BatchProcessor
    from service.runtime.dbhealth import DatabaseHealth

    async def _noop() -> None:
        return None

    return BatchProcessor(
        queue, store, registry, RetryPolicy(), DatabaseHealth(store, asyncio.Event(), _noop),
        fifo=fifo, visibility_timeout=30, handler_timeout=handler_timeout,
        fatal=lambda *a, **k: fatal.append(a), limit=ReceiveLimit(RetryPolicy().max_failures))


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How batches were applied: ``fused`` statements run, of which ``fell_back``, and runs
    of the completing transaction's attempt loop (``general``)."""
    counts = {"fused": 0, "fell_back": 0, "general": 0}
    one_statement, attempts = store_module.apply_entities, completion.complete

    async def counted_statement(*args: Any) -> Any:
        counts["fused"] += 1
        res = await one_statement(*args)
        counts["fell_back"] += res is None
        return res

    async def counted_attempts(*args: Any, **kwargs: Any) -> Any:
        counts["general"] += 1
        return await attempts(*args, **kwargs)

    monkeypatch.setattr(store_module, "apply_entities", counted_statement)
    monkeypatch.setattr(completion, "complete", counted_attempts)
    return counts


def batch() -> list[Message]:
    """Every rule of the reference handlers against the entities of ``seed``: newer, equal
    and older versions, a delete that lands, one that does not, a new entity, a tombstone of
    one never seen, and a request that failed before (its retry count goes)."""
    return [
        message("newer", "entity.upsert", {"entity_id": "e1", "version": 6, "data": {"a": 1}}),
        message("tie", "entity.upsert", {"entity_id": "e2", "version": 5, "data": {"b": 2}}),
        message("older", "entity.delete", {"entity_id": "e3", "version": 4}),
        message("delete", "entity.delete", {"entity_id": "e4", "version": 9}),
        message("new", "entity.upsert",
                {"entity_id": "e5", "version": 1, "data": {"c": [1, "x", None]}}, failures=1),
        # a standard queue's message group (a fair queue): kept on its result
        message("tombstone", "entity.delete", {"entity_id": "e6", "version": 1}, group="t"),
    ]


async def seed(conn: asyncpg.Connection) -> None:
    await conn.execute(
        "INSERT INTO entities (entity_id, version, deleted, data, request_id) VALUES"
        " ('e1', 5, false, '{\"old\": 1}', 'seed'), ('e2', 5, false, '{\"old\": 2}', 'seed'),"
        " ('e3', 5, false, '{\"old\": 3}', 'seed'), ('e4', 5, false, '{\"old\": 4}', 'seed')")
    await conn.execute("INSERT INTO retry_attempts (request_id, failures, last_error)"
                       " VALUES ('new', 1, 'boom'), ('unrelated', 1, 'boom')")


async def tables(conn: asyncpg.Connection) -> dict[str, list[Any]]:
    return {
        "entities": [tuple(r) for r in await conn.fetch(
            "SELECT entity_id, version, deleted, data::text, request_id FROM entities"
            " ORDER BY entity_id")],
        "modifications": [tuple(r) for r in await conn.fetch(
            "SELECT request_id, status, owner, result::text, completed_at IS NOT NULL"
            " FROM modifications ORDER BY request_id")],
        "outbox": [tuple(r) for r in await conn.fetch(
            "SELECT request_id, request_type, status, result::text, reason, group_id,"
            " completed_at = (SELECT completed_at FROM modifications m"
            "                  WHERE m.request_id = o.request_id)"
            " FROM outbox o ORDER BY id")],
        "retry_attempts": [tuple(r) for r in await conn.fetch(
            "SELECT request_id, failures FROM retry_attempts ORDER BY request_id")],
    }


async def applied(dsn: str, fused: bool) -> tuple[list[Any], dict[str, list[Any]]]:
    pool = await create_pool(dsn, 2)
    try:
        store = Store(pool, "w-a", results=True)
        await store.register_worker("w-a")
        async with pool.acquire() as conn:
            await seed(conn)
        todo = batch()
        await store.claim(todo)
        res = await store.apply(todo, Invoker(default_registry).one,
                                batch=Invoker(default_registry).batching,
                                entity_rows=rows(todo) if fused else None)
        assert store.outbox_written.is_set()  # the publisher wakes up
        summary = [[(m.request_id, r) for m, r in res.completed],
                   [m.request_id for m in res.lost], res.failed, res.blocked]
        async with pool.acquire() as conn:
            return summary, await tables(conn)
    finally:
        pool.terminate()


@pytest.fixture
async def two_databases(pg_server: Postgres) -> AsyncIterator[tuple[str, str]]:
    async with fresh_database(pg_server) as a, fresh_database(pg_server) as b:
        yield a, b


async def test_the_fused_statement_has_the_completing_transactions_effect(
    two_databases: tuple[str, str], paths: dict[str, int],
) -> None:
    general = await applied(two_databases[0], fused=False)
    assert paths == {"fused": 0, "fell_back": 0, "general": 1}
    fused = await applied(two_databases[1], fused=True)
    assert paths == {"fused": 1, "fell_back": 0, "general": 1}
    assert fused == general
    # and what both did, read once
    completed, lost, _, _ = fused[0]
    assert completed == [("newer", {"applied": True}), ("tie", {"applied": False}),
                         ("older", {"applied": False}), ("delete", {"applied": True}),
                         ("new", {"applied": True}), ("tombstone", {"applied": True})]
    assert lost == []
    assert [r[0] for r in fused[1]["outbox"]] == [m.request_id for m in batch()]
    assert fused[1]["retry_attempts"] == [("unrelated", 1)]


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[Store]:
    pool = await create_pool(database_url, 2)
    s = Store(pool, "w-a")
    await s.register_worker("w-a")
    yield s
    await pool.close()


def three() -> list[Message]:
    return [message(r, "entity.upsert", {"entity_id": "e-" + r, "version": 1, "data": {}})
            for r in ("r1", "r2", "r3")]


TAKE_OVER = ("UPDATE modifications SET owner = 'w-b', claim_token = $2"
             " WHERE request_id = $1 AND status = 'IN_PROGRESS'")


async def outcome(db: asyncpg.Connection) -> tuple[list[Any], list[Any]]:
    entities = [r["request_id"] for r in await db.fetch(
        "SELECT request_id FROM entities ORDER BY request_id")]
    mods = [tuple(r) for r in await db.fetch(
        "SELECT request_id, status, owner FROM modifications ORDER BY request_id")]
    return entities, mods


async def test_a_claim_taken_over_before_the_statement_is_neither_written_nor_completed(
    store: Store, db: asyncpg.Connection,
) -> None:
    todo = three()
    await store.claim(todo)
    await db.execute(TAKE_OVER, "r2", uuid.uuid4())  # another worker's, committed
    res = await fused_statement(store, todo, rows(todo))
    assert res is not None
    assert [m.request_id for m, _ in res.completed] == ["r1", "r3"]
    assert [m.request_id for m in res.lost] == ["r2"]
    assert await outcome(db) == (
        ["r1", "r3"],
        [("r1", "COMPLETED", "w-a"), ("r2", "IN_PROGRESS", "w-b"), ("r3", "COMPLETED", "w-a")])


async def test_a_claim_of_another_batch_of_this_worker_is_not_completed(
    store: Store, db: asyncpg.Connection,
) -> None:
    """The fence is on the claim token too: a claim this worker released and made again
    for another batch (a redelivery) is that batch's to complete."""
    todo = three()
    await store.claim(todo)
    await store.release([todo[1]])
    again = three()[1]
    assert (await store.claim([again]))["r2"].claimed  # a new token
    res = await fused_statement(store, todo, rows(todo))
    assert res is not None and [m.request_id for m in res.lost] == ["r2"]
    assert await outcome(db) == (
        ["r1", "r3"],
        [("r1", "COMPLETED", "w-a"), ("r2", "IN_PROGRESS", "w-a"), ("r3", "COMPLETED", "w-a")])


async def waiting_for_a_lock(db: asyncpg.Connection, holder: asyncpg.Connection,
                             fused: asyncio.Task[Any]) -> int:
    """The backend pid of the fused statement once it waits for a row lock ``holder`` holds
    (bounded; the statement must not finish meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not (pid := await db.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND datname = current_database() AND pid <> $1", holder.get_server_pid())):
        assert loop.time() < deadline, "the fused statement never waited for r2's lock"
        assert not fused.done(), "the fused statement did not wait for r2's lock"
        await asyncio.sleep(0.05)
    return int(pid)


async def test_a_claim_taken_over_while_the_statement_waits_for_its_lock_is_not_applied(
    store: Store, db: asyncpg.Connection, database_url: str,
) -> None:
    """Two sessions, in a fixed order: B holds r2's row; the fused statement fences r1 and
    waits for r2; B takes the claim over and commits; the statement rechecks r2 as B left it
    — not ours — and goes on without it. Nothing of r2 applied, nothing twice."""
    todo = three()
    await store.claim(todo)
    other = await asyncpg.connect(database_url)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT 1 FROM modifications WHERE request_id = 'r2' FOR UPDATE")
        fused = asyncio.create_task(fused_statement(store, todo, rows(todo)))
        await waiting_for_a_lock(db, other, fused)
        await other.execute(TAKE_OVER, "r2", uuid.uuid4())
        await tx.commit()
        res = await asyncio.wait_for(fused, 30)
    finally:
        await other.close()
    assert res is not None
    assert [m.request_id for m in res.lost] == ["r2"]
    assert await outcome(db) == (
        ["r1", "r3"],
        [("r1", "COMPLETED", "w-a"), ("r2", "IN_PROGRESS", "w-b"), ("r3", "COMPLETED", "w-a")])


async def test_a_failing_statement_commits_nothing_and_says_so(
    store: Store, db: asyncpg.Connection,
) -> None:
    """An entity twice (a caller's mistake here: ON CONFLICT cannot touch a row twice): the
    statement fails, nothing of it commits, and None sends the caller to ``apply``."""
    todo = three()
    await store.claim(todo)
    twice = rows(todo)
    twice[2] = (twice[1][0], *twice[2][1:])
    assert await fused_statement(store, todo, twice) is None
    assert await outcome(db) == (
        [], [("r1", "IN_PROGRESS", "w-a"), ("r2", "IN_PROGRESS", "w-a"),
             ("r3", "IN_PROGRESS", "w-a")])


class ReadOnlyApply(Store):
    """Claims on a writable pool, applies on ``read_only`` (every transaction read-only, as
    on a standby after a failover): the fused statement meets 25006 after a claim that
    committed."""

    def __init__(self, writable: asyncpg.Pool, read_only: asyncpg.Pool) -> None:
        super().__init__(read_only, "w-a")
        self.writable = Store(writable, "w-a")

    async def claim(self, messages: Any) -> Any:
        return await self.writable.claim(messages)


async def test_a_busy_database_met_by_the_fused_statement_defers_the_batch_as_before(
    database_url: str, db: asyncpg.Connection, paths: dict[str, int],
) -> None:
    """25006 in the fused statement: it falls back, and the completing transaction meets the
    same refusal at its fence — DatabaseBusy, as on the general path: the batch handed back,
    receiving paused, no failure counted, nothing dead-lettered."""
    from service.core.retry import ReceiveLimit, RetryPolicy
    from service.errors import DatabaseBusy
    from service.runtime.batch import BatchProcessor
    from service.runtime.dbhealth import DatabaseHealth
    from service.testing import FakeQueue

    writable = await create_pool(database_url, 1)
    # asyncpg passes a DSN's unknown parameters on as server settings
    sep = "&" if "?" in database_url else "?"
    read_only = await create_pool(f"{database_url}{sep}default_transaction_read_only=on", 1)
    try:
        store = ReadOnlyApply(writable, read_only)
        await store.writable.register_worker("w-a")
        queue = FakeQueue()
        for m in three():
            queue.send(json.dumps({"request_id": m.request_id, "type": m.type,
                                   "payload": m.payload_json}))
        received = await queue.receive(10, 0, 30)

        async def _noop() -> None:
            return None

        downs: list[BaseException] = []

        class Health(DatabaseHealth):
            def down(self, exc: BaseException) -> None:
                downs.append(exc)
                super().down(exc)

        health = Health(store, asyncio.Event(), _noop)
        processor = BatchProcessor(
            queue, store, default_registry, RetryPolicy(), health, fifo=False,
            visibility_timeout=30, handler_timeout=60, fatal=lambda *a, **k: None,
            limit=ReceiveLimit(RetryPolicy().max_failures))
        await processor.run(received)
        health.cancel()
        assert paths == {"fused": 1, "fell_back": 1, "general": 1}
        assert len(downs) == 1 and isinstance(downs[0], DatabaseBusy), downs
        assert sorted(mid for mid, _ in queue.visibility_calls) == sorted(
            m.message_id for m in received)
        assert await db.fetchval("SELECT count(*) FROM retry_attempts") == 0
        assert await db.fetchval("SELECT count(*) FROM dead_letters") == 0
        assert await db.fetchval("SELECT count(*) FROM entities") == 0
    finally:
        await read_only.close()
        await writable.close()


async def test_a_connection_lost_in_the_fused_statement_is_an_outage(
    store: Store, db: asyncpg.Connection, database_url: str,
) -> None:
    """The connection goes while the statement waits for a lock: DatabaseUnavailable at once
    (not a fall-back onto the completing transaction), and nothing of it committed."""
    from service.errors import DatabaseUnavailable

    todo = three()
    await store.claim(todo)
    other = await asyncpg.connect(database_url)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT 1 FROM modifications WHERE request_id = 'r2' FOR UPDATE")
        fused = asyncio.create_task(fused_statement(store, todo, rows(todo)))
        pid = await waiting_for_a_lock(db, other, fused)
        await db.execute("SELECT pg_terminate_backend($1)", pid)
        with pytest.raises(DatabaseUnavailable):
            await asyncio.wait_for(fused, 30)
        await tx.rollback()
    finally:
        await other.close()
    assert await outcome(db) == (
        [], [("r1", "IN_PROGRESS", "w-a"), ("r2", "IN_PROGRESS", "w-a"),
             ("r3", "IN_PROGRESS", "w-a")])


async def test_a_bisected_batch_completes_through_the_completing_transaction(
    database_url: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch,
    paths: dict[str, int],
) -> None:
    """A request_id PostgreSQL refuses at the claim (the door's limit lifted): the batch is
    bisected, and its parts are applied by ``Store.apply`` only — the neighbours complete,
    the one at fault is dead-lettered."""
    from service.testing import FakeQueue
    from tests.integration.test_hostile import hostile_id, upsert

    monkeypatch.setattr("service.core.messages.INDEXED_TEXT_MAX_CHARS", 10**9)
    load_reference_handlers()
    pool = await create_pool(database_url, 2)
    try:
        store = Store(pool, "w-a")
        await store.register_worker("w-a")
        queue = FakeQueue()
        bodies = [upsert(f"r{i}", f"e{i}") for i in range(8)]
        bodies.insert(3, upsert(hostile_id(), "e-hostile"))
        for b in bodies:
            queue.send(b)
        received = await queue.receive(10, 0, 30)
        assert len(received) == 9
        fatal: list[Any] = []
        await processor_for(store, queue, fatal).run(received)
        assert not fatal
        assert paths["fused"] == 0 and paths["general"] > 0, paths
        assert await db.fetchval(
            "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'") == 8
        assert await db.fetchval("SELECT count(*) FROM entities") == 8
        assert [r["reason"] for r in await db.fetch("SELECT reason FROM dead_letters")] == [
            "rejected_by_database"]
    finally:
        await pool.close()


def entity(rid: str, eid: str) -> str:
    return json.dumps({"request_id": rid, "type": "entity.upsert",
                       "payload": {"entity_id": eid, "version": 1, "data": {}}})


@pytest.mark.parametrize(("case", "expected"), [
    ("reference", (1, 0)),
    ("fifo", (0, 1)),
    ("an entity twice", (0, 1)),
    ("a user's handler", (0, 1)),
])
async def test_which_batches_the_fused_statement_carries(
    case: str, expected: tuple[int, int], database_url: str, db: asyncpg.Connection,
    paths: dict[str, int],
) -> None:
    """Only a standard queue's batch of the reference handlers alone, no entity twice."""
    from service.handlers import Registry
    from service.testing import FakeQueue

    load_reference_handlers()
    reg = default_registry
    bodies = [entity(f"r{i}", f"e{i}") for i in range(5)]
    if case == "an entity twice":
        bodies[4] = entity("r4", "e0")
    if case == "a user's handler":
        reg = Registry()
        for t in ("entity.upsert", "entity.delete"):
            spec = default_registry.get(t)
            assert spec is not None and spec.batch_fn and spec.entity_row
            reg.register(t, spec.model, spec.fn)
            reg.register_batch(t, spec.batch_fn)
            reg.register_entity_row(t, spec.entity_row)

        async def note(p: Any, conn: Any) -> dict[str, Any]:
            return {"noted": p.entity_id}

        reg.register("note", default_registry.get("entity.upsert").model, note)  # type: ignore[union-attr]
        bodies[2] = bodies[2].replace('"entity.upsert"', '"note"')
    fifo = case == "fifo"
    pool = await create_pool(database_url, 2)
    try:
        store = Store(pool, "w-a")
        await store.register_worker("w-a")
        queue = FakeQueue()
        for i, b in enumerate(bodies):
            queue.send(b, group_id=f"g{i}" if fifo else None)
        received = await queue.receive(10, 0, 30)
        fatal: list[Any] = []
        await processor_for(store, queue, fatal, reg, fifo=fifo).run(received)
        assert not fatal
        assert (paths["fused"], paths["general"]) == expected
        assert not store.outbox_written.is_set()  # results off: no outbox row
        assert await db.fetchval(
            "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'") == 5
        assert queue.messages == {}
    finally:
        await pool.close()


async def fell_back(paths: dict[str, int], task: asyncio.Task[Any], why: str) -> None:
    """Wait (30 s at most) until a fused statement has fallen back, ``task`` still running:
    the lock the test holds is still held."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while paths["fell_back"] == 0:
        assert loop.time() < deadline, why
        assert not task.done(), task
        await asyncio.sleep(0.05)


async def test_a_statement_past_the_handlers_time_limit_falls_back(
    store: Store, db: asyncpg.Connection, database_url: str, paths: dict[str, int],
) -> None:
    """The handlers' time limit bounds the statement: waiting for a claim's lock past it, it
    is cancelled (the connection stays) and the batch goes to the attempt loop, which
    completes it once the lock is gone."""
    todo = three()
    await store.claim(todo)
    other = await asyncpg.connect(database_url)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT 1 FROM modifications WHERE request_id = 'r2' FOR UPDATE")
        applying = asyncio.create_task(store.apply(
            todo, Invoker(default_registry).one, batch=Invoker(default_registry).batching,
            entity_rows=rows(todo), time_limit=0.2))
        await fell_back(paths, applying, "the statement outlived its time limit")
        await tx.rollback()
        res = await asyncio.wait_for(applying, 30)
    finally:
        await other.close()
    assert paths == {"fused": 1, "fell_back": 1, "general": 1}
    assert [m.request_id for m, _ in res.completed] == ["r1", "r2", "r3"]
    assert await outcome(db) == (
        ["r1", "r2", "r3"],
        [("r1", "COMPLETED", "w-a"), ("r2", "COMPLETED", "w-a"), ("r3", "COMPLETED", "w-a")])


async def test_the_batch_bounds_the_fused_statement_by_the_handlers_time_limit(
    database_url: str, db: asyncpg.Connection, paths: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``BatchProcessor`` gives the fused statement its handlers' time limit
    (``handler_timeout``): waiting on an entity another transaction holds locked, the statement
    is cancelled past it and falls back while the lock is still held — not after the pool's
    command timeout. The attempt loop then completes the batch once the lock is gone."""
    from service.testing import FakeQueue

    await db.execute("INSERT INTO entities (entity_id, version, data, request_id)"
                     " VALUES ('e-r2', 0, '{}', 'seed')")
    released = asyncio.Event()
    attempts = completion.complete

    async def after_the_lock(*args: Any, **kwargs: Any) -> Any:
        await released.wait()  # the attempt loop's handlers must not meet the lock
        return await attempts(*args, **kwargs)

    monkeypatch.setattr(completion, "complete", after_the_lock)
    pool = await create_pool(database_url, 2)
    other = await asyncpg.connect(database_url)
    try:
        store = Store(pool, "w-a")
        await store.register_worker("w-a")
        queue = FakeQueue()
        for m in three():
            queue.send(json.dumps({"request_id": m.request_id, "type": m.type,
                                   "payload": m.payload_json}))
        received = await queue.receive(10, 0, 30)
        fatal: list[Any] = []
        processor = processor_for(store, queue, fatal, handler_timeout=0.5)
        tx = other.transaction()
        await tx.start()
        await other.execute("SELECT 1 FROM entities WHERE entity_id = 'e-r2' FOR UPDATE")
        running = asyncio.create_task(processor.run(received))
        await fell_back(paths, running, "the fused statement outlived the handlers' limit")
        await tx.rollback()
        released.set()
        await asyncio.wait_for(running, 30)
    finally:
        await other.close()
        await pool.close()
    assert not fatal
    assert paths == {"fused": 1, "fell_back": 1, "general": 1}
    assert await db.fetchval(
        "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'") == 3
    assert queue.messages == {}

"""Errors raised by the COMMIT of the completing transaction, on the real PostgreSQL store:
a deferred constraint one message's write violates fails that message alone; a conflict
found at commit (SERIALIZABLE) is rerun like one in a handler; the database's own trouble at
commit (a cancel) is an outage, counted against no message. Same rig as
``test_handler_boundary``: ``BatchProcessor`` over ``Store`` and an in-memory queue."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

from tests.integration.test_handler_boundary import (
    P,
    Rig,
    body,
    effect,
    effects,
    failures,
    last_error,
    registry,
    status,
    well_behaved,
)


@pytest.fixture
async def fx(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE fx (rid text)")  # the handlers' effects (``effect``)
    return db


async def _until(predicate: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _holding_trigger(db: asyncpg.Connection) -> None:
    """A row in ``hold`` makes the COMMIT wait (a deferred trigger) for advisory lock 4711:
    the test holds it to act between the batch's last statement and the end of its COMMIT."""
    await db.execute("""
        CREATE TABLE hold (id int);
        CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_advisory_xact_lock(4711); RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON hold
          DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_commit()""")


async def _waiting(db: asyncpg.Connection) -> bool:
    return bool(await db.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"))


async def test_a_deferred_constraint_one_message_violates_fails_it_alone(
    database_url: str, fx: asyncpg.Connection
) -> None:
    await fx.execute("CREATE TABLE parent (id text PRIMARY KEY);"
                     " INSERT INTO parent VALUES ('there');"
                     " CREATE TABLE child (id text REFERENCES parent"
                     "   DEFERRABLE INITIALLY DEFERRED)")

    async def orphan(_p: P, conn: Any) -> None:
        await effect(conn)
        await conn.execute("INSERT INTO child VALUES ('nowhere')")  # fails at COMMIT only

    async def adopted(p: P, conn: Any) -> dict[str, Any]:
        await conn.execute("INSERT INTO child VALUES ('there')")
        return await well_behaved(p, conn)

    async with Rig(database_url, registry(ok=adopted, orphan=orphan)) as rig:
        sent = {rid: rig.queue.send(body(rid, "orphan" if rid == "bad" else "ok"))
                for rid in ("n1", "n2", "bad", "n3")}
        await rig.round()
        acked = list(rig.queue.deleted)
    neighbours = ("n1", "n2", "n3")
    assert [await status(fx, r) for r in neighbours] == ["COMPLETED"] * 3
    assert [await effects(fx, r) for r in neighbours] == [1, 1, 1]
    assert sorted(acked) == sorted(sent[r] for r in neighbours)
    assert await fx.fetchval("SELECT count(*) FROM child") == 3
    assert await effects(fx, "bad") == 0
    assert await failures(fx, "bad") == 1  # retried by the normal policy
    assert (await last_error(fx, "bad") or "").startswith("ForeignKeyViolationError: ")


async def test_a_serialization_failure_at_commit_is_rerun_and_completes(
    database_url: str, fx: asyncpg.Connection
) -> None:
    """Write skew between the batch (reads k=1, writes k=2) and another SERIALIZABLE session
    (writes k=1, reads k=2) that commits while the batch's COMMIT is held in a deferred
    trigger, after its last statement: PostgreSQL fails the batch's COMMIT (40001). The
    rerun commits, counting nothing against the message."""
    await fx.execute("CREATE TABLE s (k int PRIMARY KEY, v int NOT NULL);"
                     " INSERT INTO s VALUES (1, 0), (2, 0)")
    await _holding_trigger(fx)
    runs: list[int] = []

    async def skews(p: P, conn: Any) -> dict[str, Any]:
        runs.append(await conn.fetchval("SELECT v FROM s WHERE k = 1"))
        await conn.execute("UPDATE s SET v = v + 1 WHERE k = 2")
        await conn.execute("INSERT INTO hold VALUES (1)")  # its trigger runs at COMMIT
        return await well_behaved(p, conn)

    other = await asyncpg.connect(database_url)
    await fx.execute("SELECT pg_advisory_lock(4711)")
    serializable = f"{database_url}?default_transaction_isolation=serializable"
    try:
        async with Rig(serializable, registry(sk=skews)) as rig:
            rig.queue.send(body("skew", "sk"))
            batch = asyncio.create_task(rig.round())

            await _until(lambda: _waiting(fx), "the batch's COMMIT held in the deferred trigger")
            async with other.transaction(isolation="serializable"):
                await other.execute("UPDATE s SET v = v + 1 WHERE k = 1")
                await other.fetchval("SELECT v FROM s WHERE k = 2")
            await fx.execute("SELECT pg_advisory_unlock(4711)")
            await asyncio.wait_for(batch, 30)
            acked = len(rig.queue.deleted)
    finally:
        await other.close()
    assert runs == [0, 1]  # the rerun read the other session's committed write
    assert await status(fx, "skew") == "COMPLETED" and acked == 1
    assert await fx.fetchval("SELECT v FROM s WHERE k = 2") == 1
    assert await effects(fx, "skew") == 1
    assert await failures(fx, "skew") is None


async def test_a_cancel_at_commit_is_an_outage_not_a_failure(
    database_url: str, fx: asyncpg.Connection
) -> None:
    """The database's own trouble at COMMIT — here a cancel (57014, what a statement or
    lock timeout raises too) while a deferred trigger waits: counted against neither
    message, the batch deferred like an outage (not split, not blamed on one of them)."""
    await _holding_trigger(fx)

    async def holds(p: P, conn: Any) -> dict[str, Any]:
        await conn.execute("INSERT INTO hold VALUES (1)")
        return await well_behaved(p, conn)

    await fx.execute("SELECT pg_advisory_lock(4711)")
    async with Rig(database_url, registry(ok=well_behaved, hold=holds)) as rig:
        rig.queue.send(body("n1", "ok"))
        rig.queue.send(body("holds", "hold"))
        batch = asyncio.create_task(rig.round())
        await _until(lambda: _waiting(fx), "the batch's COMMIT held in the deferred trigger")
        assert await fx.fetchval(
            "SELECT pg_cancel_backend(pid) FROM pg_locks"
            " WHERE locktype = 'advisory' AND NOT granted")
        await fx.execute("SELECT pg_advisory_unlock(4711)")
        await asyncio.wait_for(batch, 30)
        went_down = not rig.health.is_up
    assert went_down
    assert [await failures(fx, r) for r in ("n1", "holds")] == [None, None]
    assert [await effects(fx, r) for r in ("n1", "holds")] == [0, 0]
    assert "COMPLETED" not in [await status(fx, r) for r in ("n1", "holds")]

"""Errors of the database's own making (SPEC §7, "no healthy message lost to the database"):
``service.adapters.pgerrors`` reads them as outages, and a batch that meets one in the claim, the
failure count or the dead-letter statement is deferred like an outage's — nothing counted,
nothing dead-lettered, and on the queue's last receive a fresh copy instead of a receive
SQS would answer by moving the message to its DLQ."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from service.adapters.pgerrors import translate
from service.core.retry import ReceiveLimit, RetryPolicy
from service.errors import (
    DatabaseBusy,
    DatabaseError,
    DatabaseUnavailable,
    DataRejected,
    PermanentError,
    TransientError,
)
from service.handlers import Registry
from service.runtime.batch import BatchProcessor
from service.runtime.dbhealth import DatabaseHealth
from service.testing import FakeQueue, FakeStore

#: serialization failure, deadlock, lock not available (lock_timeout), query canceled
#: (statement_timeout), insufficient resources, disk full, out of memory, configuration
#: limit exceeded, crash shutdown, idle session timeout, read-only transaction.
BUSY = ["40001", "40P01", "40003", "55P03", "57014", "53000", "53100", "53200", "53400",
        "57P02", "57P05", "25006"]
#: Already outages of the connection: too many connections, admin shutdown.
GONE = ["53300", "57P01"]


def pg_error(sqlstate: str) -> asyncpg.PostgresError:
    cls = asyncpg.PostgresError.get_message_class_for_sqlstate(sqlstate)
    assert cls.sqlstate == sqlstate  # an asyncpg that knows the code (not a generic class)
    return cls(f"the server said {sqlstate}")


@pytest.mark.parametrize("sqlstate", BUSY + GONE)
def test_an_error_of_the_databases_own_making_is_an_outage(sqlstate: str) -> None:
    exc = pg_error(sqlstate)
    ours = translate(exc)
    assert isinstance(ours, DatabaseUnavailable) and isinstance(ours, TransientError)
    assert not isinstance(ours, PermanentError)
    if sqlstate in BUSY:
        # The database is there and refused: still a DatabaseError (CLI commands report it
        # as a failed statement), but one that defers the batch.
        assert isinstance(ours, DatabaseBusy) and isinstance(ours, DatabaseError)
        assert type(exc).__name__ in str(ours)


@pytest.mark.parametrize(("sqlstate", "kind"), [
    ("23505", DatabaseError),  # unique violation: a bad statement, not an outage
    ("42501", DatabaseError),  # insufficient privilege
    ("42P01", DatabaseError),  # undefined table
    ("22P02", DataRejected),  # a value refused: one message's fault
    ("54000", DataRejected),
])
def test_a_statement_the_database_refuses_on_its_merits_is_not(sqlstate: str,
                                                                kind: type) -> None:
    ours = translate(pg_error(sqlstate))
    assert type(ours) is kind
    assert not isinstance(ours, DatabaseUnavailable)


class Note(BaseModel):
    n: int


def body(rid: str, n: int = 1) -> str:
    return json.dumps({"request_id": rid, "type": "note", "payload": {"n": n}})


def busy() -> BaseException:
    """What the store raises when its statement met ``statement_timeout`` (its translation
    at the connection, ``service.adapters.store.connection``)."""
    exc = pg_error("57014")
    ours = translate(exc)
    assert ours is not None
    ours.__cause__ = exc
    return ours


class BusyStore(FakeStore):
    """A store whose ``site`` statement is refused by the database (a table lock under a
    statement_timeout); everything else works."""

    def __init__(self, site: str) -> None:
        super().__init__()
        self.site = site

    async def claim(self, messages: Any) -> Any:
        if self.site == "claim":
            raise busy()
        return await super().claim(messages)

    async def record_failures(self, failures: Any, max_failures: int) -> dict[str, int]:
        if self.site == "record_failures":
            raise busy()
        return await super().record_failures(failures, max_failures)

    async def dead_letter(self, letters: Any) -> None:
        if self.site == "dead_letter":
            raise busy()
        await super().dead_letter(letters)


async def _noop() -> None:
    return None


async def run_once(store: FakeStore, bodies: list[str], receive_count: int
                   ) -> tuple[FakeQueue, DatabaseHealth, list[str]]:
    """One batch of ``bodies``, received for the ``receive_count``-th time from a queue
    whose RedrivePolicy moves a message after 3 receives."""
    reg = Registry()

    async def note(p: Note, conn: Any) -> dict[str, int]:
        if p.n < 0:
            raise RuntimeError("handler refuses negative numbers")
        return {"n": p.n}

    reg.register("note", Note, note)
    queue = FakeQueue()
    queue.max_receive_count = 3
    ids = [queue.send(b) for b in bodies]
    for mid in ids:
        queue.messages[mid].receive_count = receive_count - 1
    limit = ReceiveLimit(5)
    limit.update(await queue.attributes())
    health = DatabaseHealth(store, asyncio.Event(), _noop)
    proc = BatchProcessor(queue, store, reg, RetryPolicy(max_failures=5, rng=lambda: 0.0),
                          health, fifo=False, visibility_timeout=30, handler_timeout=0,
                          fatal=lambda *a, **k: None, limit=limit)
    batch = await queue.receive(10, 0, 30)
    assert [m.receive_count for m in batch] == [receive_count] * len(bodies)
    await proc.run(batch)
    health.cancel()
    return queue, health, ids


@pytest.mark.parametrize(("site", "bodies"), [
    ("claim", [body("a", 1), body("b", 2)]),
    # b's handler fails; counting that failure meets the timeout
    ("record_failures", [body("a", 1), body("b", -1)]),
    # a poison body's dead letter meets the timeout (before any handler runs)
    ("dead_letter", [body("a", 1), "{not json"]),
])
async def test_a_batch_that_meets_one_on_the_last_receive_is_deferred_not_dead_lettered(
    site: str, bodies: list[str],
) -> None:
    store = BusyStore(site)
    queue, health, ids = await run_once(store, bodies, receive_count=3)
    assert store.dead == {}, "dead-lettered for the database's own error"
    assert store.failures == {}, "counted against a message"
    assert not health.is_up  # receiving pauses until a probe passes, as in an outage
    # Each one replaced by a fresh copy: SQS would move it to its DLQ on the next receive.
    assert sorted(queue.requeued) == sorted(ids)
    assert [m.receive_count for m in queue.messages.values()] == [0] * len(ids)


async def test_down_again_while_recovering_is_probed_until_up_again() -> None:
    """A batch that meets the lock again while the recovery's own statements run (releasing
    claims, a GC pass) takes the database down once more: the probe that is still running
    must go on probing, or nothing would ever bring it back up (receiving stopped for good)."""
    rounds: list[int] = []

    async def back() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            health.down(DatabaseBusy("database busy: QueryCanceledError: a batch, meanwhile"))

    health = DatabaseHealth(FakeStore(), asyncio.Event(), back)
    health.down(DatabaseUnavailable("database unavailable: the first outage"))
    try:
        for _ in range(1000):
            if len(rounds) == 2 and health.is_up:
                break
            await asyncio.sleep(0.01)
        assert (rounds, health.is_up) == ([0, 1], True)
    finally:
        health.cancel()

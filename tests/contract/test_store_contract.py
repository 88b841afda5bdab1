"""One contract, two stores: every test runs over the in-memory ``FakeStore`` and over the
real ``Store`` on PostgreSQL. A fake that drifts from the real thing fails here."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import asyncpg
import pytest
from pydantic import BaseModel

from service.adapters.store import Store, create_pool
from service.core.messages import Message, Received
from service.core.seams import DeadLetter, OutboxRow, OutboxSeam, StoreSeam
from service.errors import DatabaseError
from service.testing import FakeDatabase, FakeStore, FakeWorker
from tests.conftest import fresh_database
from tests.servers import Postgres


class Note(BaseModel):
    n: int


def msg(rid: str, n: int = 1, mid: str | None = None, group: str | None = None,
        seq: int | None = None, type_: str = "note") -> Message:
    payload = {"n": n}
    # Independent of service.core.messages.payload_hash: the sorted compact JSON, hashed here.
    digest = hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()
    raw = Received(mid or f"m-{rid}-{n}", "rh", json.dumps(payload), 1, None, group,
                   sequence_number=seq)
    return Message(raw, rid, type_, Note(n=n), payload, digest)


async def ok(m: Message, conn: Any) -> dict[str, Any]:
    return {"n": m.payload.n}  # type: ignore[attr-defined]  # the payload is the registered model


class ResultStore(StoreSeam, OutboxSeam, Protocol):
    """Both seams of a store (the real one and the fake implement both)."""


class Backend(Protocol):
    async def store(self, worker_id: str, results: bool = False,
                    lease: float | None = None) -> ResultStore: ...
    async def kill(self, worker_id: str) -> None: ...
    async def statuses(self) -> dict[str, tuple[str, str]]: ...
    async def letters(self) -> dict[str, tuple[str, str]]: ...
    async def outbox(self) -> list[tuple[str, str, Any, str | None, str | None, bool]]: ...
    async def carried(self, request_id: str) -> tuple[Any, str | None]: ...
    async def age_claims(self, request_ids: list[str], seconds: float) -> None: ...
    async def age_refusal(self, pointer: str, seconds: float) -> None: ...
    async def lose_migrations(self) -> None: ...
    async def go_down(self) -> None: ...


class FakeBackend:
    def __init__(self) -> None:
        self.db = FakeDatabase()

    async def store(self, worker_id: str, results: bool = False,
                    lease: float | None = None) -> ResultStore:
        s = FakeStore(worker_id, self.db, results=results, lease=lease)
        await s.register_worker(worker_id)
        return s

    async def kill(self, worker_id: str) -> None:
        self.db.age_worker(worker_id, 3600)

    async def statuses(self) -> dict[str, tuple[str, str]]:
        return {r.request_id: (r.status, r.owner) for r in self.db.rows.values()}

    async def letters(self) -> dict[str, tuple[str, str]]:
        return {k: (d.reason, d.body) for k, d in self.db.dead.items()}

    async def outbox(self) -> list[tuple[str, str, Any, str | None, str | None, bool]]:
        return sorted((o.row.request_id, o.row.status, o.row.result, o.row.reason,
                       o.row.group_id, o.published_at is not None) for o in self.db.outbox)

    async def carried(self, request_id: str) -> tuple[Any, str | None]:
        r = self.db.rows[request_id]
        return r.message_attributes, r.payload_pointer

    async def age_claims(self, request_ids: list[str], seconds: float) -> None:
        for r in request_ids:
            self.db.age_claim(r, seconds)

    async def age_refusal(self, pointer: str, seconds: float) -> None:
        self.db.refusals[pointer] -= seconds

    async def lose_migrations(self) -> None:
        self.db.schema_behind = True

    async def go_down(self) -> None:
        self.db.down = True


#: A publisher's claim never waits for a row lock (``FOR UPDATE SKIP LOCKED``): the real
#: backend's publisher connections (the store's ``outbox_pool``, as the daemon gives the
#: publisher pools of its own) carry this ``lock_timeout``, so a claim that does wait — on a
#: row another publisher holds — fails within it instead of waiting on that publisher's
#: transaction for ever. It counts lock waits only: load cannot trip it.
PUBLISHER_LOCK_TIMEOUT_MS = 2000

T = TypeVar("T")


async def beside_a_holder(call: Awaitable[T], bound: float = 20) -> T:
    """``call`` (a publisher's claim) while another publisher holds rows: it must return
    without waiting for them. A claim that blocked on a held row fails with that reason (the
    lock_timeout above, real backend), and ``bound`` seconds end any other wait (the
    statement is cancelled on the server too)."""
    try:
        return await asyncio.wait_for(call, bound)
    except DatabaseError as exc:
        if isinstance(exc.__cause__, asyncpg.exceptions.LockNotAvailableError):
            raise AssertionError(
                "the second publisher blocked on a row the first one holds (lock_timeout "
                f"{PUBLISHER_LOCK_TIMEOUT_MS} ms): FOR UPDATE without SKIP LOCKED") from exc
        raise
    except TimeoutError as exc:
        raise AssertionError(f"the second publisher's claim did not return within {bound} s"
                             " while the first one held its rows") from exc


class RealBackend:
    def __init__(self, pool: asyncpg.Pool, database_url: str) -> None:
        self.pool = pool
        self.database_url = database_url
        self.outbox_pool: asyncpg.Pool | None = None  # the publishers', made on first use

    async def store(self, worker_id: str, results: bool = False,
                    lease: float | None = None) -> ResultStore:
        if results and self.outbox_pool is None:
            self.outbox_pool = await create_pool(
                f"{self.database_url}?lock_timeout={PUBLISHER_LOCK_TIMEOUT_MS}", 4)
        s = Store(self.pool, worker_id, results=results,
                  outbox_pool=self.outbox_pool if results else None, lease=lease)
        await s.register_worker(worker_id)
        return s

    async def kill(self, worker_id: str) -> None:
        await self.pool.execute("UPDATE workers SET heartbeat_at = now() - interval '1 hour'"
                                " WHERE worker_id = $1", worker_id)

    async def statuses(self) -> dict[str, tuple[str, str]]:
        rows = await self.pool.fetch("SELECT request_id, status, owner FROM modifications")
        return {r["request_id"]: (r["status"], r["owner"]) for r in rows}

    async def letters(self) -> dict[str, tuple[str, str]]:
        rows = await self.pool.fetch("SELECT sqs_message_id, reason, body FROM dead_letters")
        return {r["sqs_message_id"]: (r["reason"], r["body"]) for r in rows}

    async def outbox(self) -> list[tuple[str, str, Any, str | None, str | None, bool]]:
        rows = await self.pool.fetch("SELECT request_id, status, result, reason, group_id,"
                                     " published_at IS NOT NULL AS published FROM outbox")
        return sorted(tuple(r.values()) for r in rows)

    async def carried(self, request_id: str) -> tuple[Any, str | None]:
        r = await self.pool.fetchrow("SELECT message_attributes, payload_pointer FROM modifications"
                                     " WHERE request_id = $1", request_id)
        return r["message_attributes"], r["payload_pointer"]

    async def age_claims(self, request_ids: list[str], seconds: float) -> None:
        await self.pool.execute("UPDATE modifications SET received_at = received_at - $2::interval"
                                " WHERE request_id = ANY($1)", request_ids,
                                timedelta(seconds=seconds))

    async def age_refusal(self, pointer: str, seconds: float) -> None:
        await self.pool.execute("UPDATE payload_refusals SET first_refused_at ="
                                " first_refused_at - $2::interval WHERE pointer = $1",
                                pointer, timedelta(seconds=seconds))

    async def lose_migrations(self) -> None:
        await self.pool.execute("DELETE FROM ingest_schema_migrations")

    async def go_down(self) -> None:
        await self.pool.close()  # every later call finds no database
        if self.outbox_pool is not None:
            await self.outbox_pool.close()

    async def close(self) -> None:
        await self.pool.close()
        if self.outbox_pool is not None:
            await self.outbox_pool.close()

    async def prune_outbox(self, retention_days: float, limit: int) -> int:
        """One batch of the pruner's outbox step (service.adapters.prune; the store no longer
        deletes published rows itself), in its own transaction as a pass runs it."""
        from service.adapters.prune import STEPS, delete_batch
        from service.settings import Settings

        step = next(s for s in STEPS if s.table == "outbox")
        s = Settings(queue_url="http://127.0.0.1:1/q", database_url="postgresql://u@127.0.0.1/d",
                     results_retention_days=retention_days)
        async with self.pool.acquire() as conn, conn.transaction():
            return (await delete_batch(conn, step, s, limit))["outbox"]


@pytest.fixture(params=["fake", "postgres"])
async def backend(request: pytest.FixtureRequest, pg_server: Postgres) -> AsyncIterator[Backend]:
    if request.param == "fake":
        yield FakeBackend()
        return
    async with fresh_database(pg_server) as database_url:
        real = RealBackend(await create_pool(database_url, 4), database_url)
        try:
            yield real
        finally:
            await real.close()


async def test_claim_duplicate_and_conflict(backend: Backend) -> None:
    a = await backend.store("w-a")
    first = await a.claim([msg("r1"), msg("r2")])
    assert [first[r].claimed for r in ("r1", "r2")] == [True, True]
    assert await backend.statuses() == {"r1": ("IN_PROGRESS", "w-a"), "r2": ("IN_PROGRESS", "w-a")}
    res = await a.apply([msg("r1")], ok)
    assert [(m.request_id, out) for m, out in res.completed] == [("r1", {"n": 1})]
    again = await a.claim([msg("r1", mid="m-redelivered"), msg("r1b", 7)])
    dup = again["r1"]
    assert (dup.claimed, dup.status, dup.request_type) == (False, "COMPLETED", "note")
    assert dup.payload_sha256 == msg("r1").payload_sha256  # → the worker acks a duplicate
    conflict = (await a.claim([msg("r1", n=2)]))["r1"]
    assert not conflict.claimed and conflict.payload_sha256 != msg("r1", n=2).payload_sha256
    # The same payload under another type: the claim reports the type stored, not the one sent.
    retyped = (await a.claim([msg("r1", type_="other")]))["r1"]
    assert (retyped.claimed, retyped.request_type) == (False, "note")
    busy = (await (await backend.store("w-b")).claim([msg("r2")]))["r2"]
    assert (busy.claimed, busy.status, busy.owner) == (False, "IN_PROGRESS", "w-a")


async def test_completion_is_fenced_on_the_owner(backend: Backend) -> None:
    a = await backend.store("w-a")
    b = await backend.store("w-b")
    await a.claim([msg("r1")])
    res = await b.apply([msg("r1")], ok)
    assert res.completed == [] and [m.request_id for m in res.lost] == ["r1"]
    assert await backend.statuses() == {"r1": ("IN_PROGRESS", "w-a")}
    # Its own row, once COMPLETED, is not held any more either: applied again (a second
    # batch of the same worker with the same request), nothing runs, the claim is lost.
    assert [m.request_id for m, _ in (await a.apply([msg("r1")], ok)).completed] == ["r1"]
    ran: list[str] = []

    async def spy(m: Message, conn: Any) -> dict[str, Any]:
        ran.append(m.request_id)
        return await ok(m, conn)

    again = await a.apply([msg("r1")], spy)
    assert (again.completed, [m.request_id for m in again.lost], ran) == ([], ["r1"], [])


async def test_gc_releases_a_dead_owner_never_a_live_one(backend: Backend) -> None:
    live, dead, gc_by = [await backend.store(w) for w in ("w-live", "w-dead", "w-gc")]
    await live.claim([msg("live")])
    await dead.claim([msg("orphan", mid="m-orphan")])
    await backend.kill("w-dead")
    released = await gc_by.gc(30)
    assert [(r["request_id"], r["owner"], r["sqs_message_id"]) for r in released] == [
        ("orphan", "w-dead", "m-orphan")]
    assert await backend.statuses() == {"live": ("IN_PROGRESS", "w-live")}
    late = await dead.apply([msg("orphan", mid="m-orphan")], ok)  # the owner comes back late
    assert late.completed == [] and len(late.lost) == 1


async def test_gc_of_an_earlier_incarnation_only_with_its_name(backend: Backend) -> None:
    old = await backend.store("w-old")
    await old.claim([msg("r1")])
    new = await backend.store("w-new")
    assert await new.gc(30) == []
    assert await new.gc(30, "w-other-name") == []
    assert [r["request_id"] for r in await new.gc(30, "w-old")] == ["r1"]


async def test_release_gives_back_only_this_delivery(backend: Backend) -> None:
    a = await backend.store("w-a")
    first = msg("r1", mid="sqs-1")
    await a.claim([first])
    other = msg("r1", mid="sqs-2")  # another delivery of the same request: contention
    assert not (await a.claim([other]))["r1"].claimed
    await a.release([other])
    # The same SQS message again (a redelivery keeps its MessageId), parsed by another batch
    # that met the claim: its release is not the claim's either.
    redelivered = msg("r1", mid="sqs-1")
    assert not (await a.claim([redelivered]))["r1"].claimed
    await a.release([redelivered])
    await a.release([msg("r1", mid="sqs-1")])  # never claimed anything
    assert await backend.statuses() == {"r1": ("IN_PROGRESS", "w-a")}
    await a.release([first])
    assert await backend.statuses() == {}
    # A completed request is never given back, even by the delivery that completed it.
    done = msg("r2", mid="sqs-3")
    await a.claim([done])
    await a.apply([done], ok)
    await a.release([done])
    assert await backend.statuses() == {"r2": ("COMPLETED", "w-a")}


async def test_a_late_release_never_takes_a_later_claim_of_the_same_message(
    backend: Backend,
) -> None:
    """A batch given back during an outage releases its claims once the database is back
    (``PlanExecutor.release_unreleased``); meanwhile the own-leak GC may have collected them
    and a later batch of the same worker claimed the same message again."""
    a = await backend.store("w-a")
    stranded = msg("r1", mid="sqs-1")
    await a.claim([stranded])
    await backend.age_claims(["r1"], 60)
    assert await a.gc_own_leaks([]) == ["r1"]
    later = msg("r1", mid="sqs-1")
    assert (await a.claim([later]))["r1"].claimed
    await a.release([stranded])
    assert await backend.statuses() == {"r1": ("IN_PROGRESS", "w-a")}
    await a.release([later])
    assert await backend.statuses() == {}


async def test_failure_is_isolated_counted_then_dead_lettered(backend: Backend) -> None:
    a = await backend.store("w-a")
    batch = [msg("r1"), msg("bad", mid="sqs-bad"), msg("r3")]
    await a.claim(batch)

    async def handler(m: Message, conn: Any) -> dict[str, Any]:
        if m.request_id == "bad":
            raise RuntimeError("boom")
        return {}

    res = await a.apply(batch, handler)
    assert sorted(m.request_id for m, _ in res.completed) == ["r1", "r3"]
    assert [(m.request_id, str(e)) for m, e in res.failed] == [("bad", "boom")]
    assert await a.record_failures([(batch[1], "RuntimeError: boom")], 2) == {"bad": 1}
    assert "bad" not in await backend.statuses()  # claim released with the count
    assert (await a.claim([batch[1]]))["bad"].failures == 1
    assert await a.record_failures([(batch[1], "RuntimeError: boom")], 2) == {"bad": 2}
    assert await backend.letters() == {"sqs-bad": ("max_receives_exceeded", batch[1].raw.body)}
    again = (await a.claim([batch[1]]))["bad"]
    assert (again.claimed, again.dead_lettered) == (False, True)


async def test_fifo_failure_blocks_the_rest_of_its_group(backend: Backend) -> None:
    a = await backend.store("w-a")
    batch = [msg("a1", group="A"), msg("a2", group="A"), msg("b1", group="B"),
             msg("a3", group="A")]
    await a.claim(batch)

    async def handler(m: Message, conn: Any) -> dict[str, Any]:
        if m.request_id == "a2":
            raise RuntimeError("a2 fails")
        return {}

    res = await a.apply(batch, handler, fifo=True)
    assert sorted(m.request_id for m, _ in res.completed) == ["a1", "b1"]
    assert [m.request_id for m, _ in res.failed] == ["a2"]
    assert [m.request_id for m in res.blocked] == ["a3"]


async def test_batch_form_runs_once_for_its_group(backend: Backend) -> None:
    a = await backend.store("w-a")
    batch = [msg("r1", 1), msg("r2", 2), msg("r3", 3)]
    await a.claim(batch)
    calls: list[list[str]] = []

    async def many(ms: list[Message], conn: Any) -> list[dict[str, Any] | None]:
        calls.append([m.request_id for m in ms])
        # why the ignore below: the payload is the registered model
        return [{"many": m.payload.n} for m in ms]  # type: ignore[attr-defined]

    res = await a.apply(batch, ok, batch=(lambda m: "k", many))
    assert calls == [["r1", "r2", "r3"]]
    assert sorted((m.request_id, out) for m, out in res.completed) == [
        ("r1", {"many": 1}), ("r2", {"many": 2}), ("r3", {"many": 3})]


async def test_dead_letters_are_idempotent_and_byte_exact(backend: Backend) -> None:
    a = await backend.store("w-a")
    body = ' {"weird":  "\u00fcn\u00efc\u00f8d\u00e9 \\u0000 \t\r\n", "x": [1,2,]} \n'
    letter = DeadLetter("m-1", body, "invalid_json", "bad", None, None, 1)
    await a.dead_letter([letter])
    await a.dead_letter([letter, DeadLetter("m-1", "other", "x", None, None, None, 2)])
    assert await backend.letters() == {"m-1": ("invalid_json", body)}


async def test_stop_releases_own_claims_and_marks_stopped(backend: Backend) -> None:
    a = await backend.store("w-a")
    b = await backend.store("w-b")
    await a.claim([msg("r1"), msg("r2"), msg("done")])
    await a.apply([msg("done")], ok)
    await b.claim([msg("r3")])
    assert await a.stop_worker() == 2
    # Its completed request stays: only claims are released.
    assert await backend.statuses() == {"r3": ("IN_PROGRESS", "w-b"), "done": ("COMPLETED", "w-a")}
    assert await a.heartbeat() is False  # stopped: its claims may be collected


def test_fake_worker_record_is_public() -> None:
    assert FakeWorker("x").stopped is False


# -- results out: the outbox ---------------------------------------------------------------


def letter(mid: str, reason: str, rid: str | None, group: str | None = None) -> DeadLetter:
    return DeadLetter(mid, "{}", reason, "err", rid, "note" if rid else None, 1, group)


async def test_outbox_rows_come_with_the_outcome_only_when_results_are_on(
    backend: Backend,
) -> None:
    off = await backend.store("w-off")
    await off.claim([msg("r0")])
    await off.apply([msg("r0")], ok)
    await off.dead_letter([letter("m-off", "invalid_payload", "r0-bad")])
    assert await backend.outbox() == []  # results off: nothing written, nothing to send

    a = await backend.store("w-a", results=True)
    await a.claim([msg("r1", group="g1"), msg("r2")])
    await a.apply([msg("r1", group="g1"), msg("r2")], ok)
    await a.dead_letter([
        letter("m-p", "invalid_payload", "p1", "g2"),
        letter("m-p", "invalid_payload", "p1", "g2"),  # the same message again: stored once
        letter("m-reuse", "idempotency_key_reused", "r1"),  # another request's key: none
        letter("m-nokey", "invalid_json", None),  # no request_id: nobody to tell
    ])
    r3 = msg("r3")
    await a.claim([r3])
    assert await a.record_failures([(r3, "boom")], max_failures=1) == {"r3": 1}
    assert await backend.outbox() == [
        ("p1", "FAILED", None, "invalid_payload", "g2", False),
        ("r1", "COMPLETED", {"n": 1}, None, "g1", False),
        ("r2", "COMPLETED", {"n": 1}, None, None, False),
        ("r3", "FAILED", None, "max_receives_exceeded", None, False),
    ]
    assert a.outbox_written.is_set()  # the publisher is woken


async def test_publish_marks_only_what_the_destination_accepted(backend: Backend) -> None:
    a = await backend.store("w-a", results=True)
    ms = [msg(f"r{i}") for i in range(12)]
    await a.claim(ms)
    await a.apply(ms, ok)
    assert (await a.outbox_stats())[0] == 12
    seen: list[list[str]] = []

    async def half(rows: list[OutboxRow]) -> set[int]:
        seen.append([r.request_id for r in rows])
        # r3's entry is refused the first time only (a per-entry failure).
        return {r.id for r in rows if r.request_id != "r3" or len(seen) > 1}

    assert await a.publish_outbox(half, 10, fifo=False) == (10, 9)
    assert seen == [[f"r{i}" for i in range(10)]]  # oldest first
    pending, age = await a.outbox_stats()
    assert pending == 3 and age >= 0
    assert await a.publish_outbox(half, 10, fifo=False) == (3, 3)
    assert seen[1] == ["r3", "r10", "r11"]
    assert await a.publish_outbox(half, 10, fifo=False) == (0, 0)
    assert (await a.outbox_stats())[0] == 0
    assert all(published for *_, published in await backend.outbox())
    if isinstance(backend, RealBackend):  # published rows go in the pruner's batches
        assert await backend.prune_outbox(1, 100) == 0  # within the retention: kept
        assert await backend.prune_outbox(0, 5) == 5
        assert await backend.prune_outbox(0, 100) == 7
        assert await backend.outbox() == []


async def test_publishers_never_hold_the_same_row_and_keep_a_group_in_order(
    backend: Backend,
) -> None:
    a = await backend.store("w-a", results=True)
    b = await backend.store("w-b", results=True)
    ms = [msg("a1", group="g"), msg("a2", group="h"), msg("a3")]
    await a.claim(ms)
    await a.apply(ms[:2], ok)  # a1 (group g), a2 (group h)
    await a.apply(ms[2:], ok)
    await a.claim([msg("a4", group="g")])
    await a.apply([msg("a4", group="g")], ok)  # a4: group g, after a1
    inside = asyncio.Event()
    go = asyncio.Event()
    by_a: list[str] = []

    async def slow(rows: list[OutboxRow]) -> set[int]:
        by_a.extend(r.request_id for r in rows)
        inside.set()
        await go.wait()
        return {r.id for r in rows}

    by_b: list[str] = []

    async def record(rows: list[OutboxRow]) -> set[int]:
        by_b.extend(r.request_id for r in rows)
        return {r.id for r in rows}

    first = asyncio.create_task(a.publish_outbox(slow, 1, fifo=True))  # holds a1
    try:
        await asyncio.wait_for(inside.wait(), 10)
        # a1 is held by the first publisher: skipped, and a4 (same group) waits behind it.
        assert await beside_a_holder(b.publish_outbox(record, 10, fifo=True)) == (2, 2)
    finally:  # whatever failed above, the first publisher ends: nothing is left holding rows
        go.set()
        held = await asyncio.wait_for(first, 10)
    assert held == (1, 1)
    assert (by_a, by_b) == (["a1"], ["a2", "a3"])
    assert await b.publish_outbox(record, 10, fifo=True) == (1, 1)
    assert by_b[-1] == "a4"


async def test_a_standard_destination_does_not_hold_a_group_behind_a_held_row(
    backend: Backend,
) -> None:
    """The group rule above is for FIFO destinations only (``fifo=False``): a row whose
    group has an older row held by another publisher is sent, not kept waiting."""
    import asyncio

    a = await backend.store("w-a", results=True)
    b = await backend.store("w-b", results=True)
    for m in (msg("a1", group="g"), msg("a2", group="h"), msg("a3"), msg("a4", group="g")):
        await a.claim([m])
        await a.apply([m], ok)  # outbox ids in this order: a4 is after a1 in group g
    inside, go = asyncio.Event(), asyncio.Event()

    async def slow(rows: list[OutboxRow]) -> set[int]:
        inside.set()
        await go.wait()
        return {r.id for r in rows}

    first = asyncio.create_task(a.publish_outbox(slow, 1, fifo=False))  # holds a1
    await asyncio.wait_for(inside.wait(), 10)
    by_b: list[str] = []

    async def record(rows: list[OutboxRow]) -> set[int]:
        by_b.extend(r.request_id for r in rows)
        return {r.id for r in rows}

    try:
        assert await b.publish_outbox(record, 10, fifo=False) == (3, 3)
    finally:
        go.set()
        await asyncio.wait_for(first, 10)
    assert by_b == ["a2", "a3", "a4"]


async def test_the_destination_gets_each_outcome_whole(backend: Backend) -> None:
    """What the publisher turns into the result message (service.runtime.results): every field of
    the row, for a completion and for a dead letter."""
    from datetime import datetime

    a = await backend.store("w-a", results=True)
    await a.claim([msg("r1", n=7, group="g1")])
    await a.apply([msg("r1", n=7, group="g1")], ok)
    await a.dead_letter([letter("m-p", "invalid_payload", "p1", "g2")])
    rows: list[OutboxRow] = []

    async def send(batch: list[OutboxRow]) -> set[int]:
        rows.extend(batch)
        return {r.id for r in batch}

    assert await a.publish_outbox(send, 10, fifo=False) == (2, 2)
    assert [(r.request_id, r.request_type, r.status, r.result, r.reason, r.group_id)
            for r in rows] == [("r1", "note", "COMPLETED", {"n": 7}, None, "g1"),
                               ("p1", "note", "FAILED", None, "invalid_payload", "g2")]
    assert rows[0].id < rows[1].id
    for r in rows:
        assert isinstance(r.completed_at, datetime) and r.completed_at.tzinfo is not None


async def test_the_publisher_is_woken_only_when_a_completion_wrote_a_result(
    backend: Backend,
) -> None:
    """The same for completions: results off, a completion writes no result and wakes
    nobody; results on, a batch whose every claim was lost completes nothing (no wake-up),
    one that completes does."""
    off = await backend.store("w-off")
    await off.claim([msg("r0")])
    assert len((await off.apply([msg("r0")], ok)).completed) == 1
    assert not off.outbox_written.is_set()

    a = await backend.store("w-a", results=True)
    b = await backend.store("w-b", results=True)
    await b.claim([msg("r1")])
    res = await a.apply([msg("r1")], ok)  # b's claim: lost for a
    assert (res.completed, [m.request_id for m in res.lost]) == ([], ["r1"])
    assert not a.outbox_written.is_set()
    await a.claim([msg("r2")])
    assert len((await a.apply([msg("r2")], ok)).completed) == 1
    assert a.outbox_written.is_set()
    assert await backend.outbox() == [("r2", "COMPLETED", {"n": 1}, None, None, False)]


async def test_the_publisher_is_woken_only_when_a_failure_wrote_a_result(
    backend: Backend,
) -> None:
    """``outbox_written`` wakes the publisher: a failure below the limit writes no result
    (nothing to wake it for), the one that dead-letters does — and with results off no
    failure writes one."""
    a = await backend.store("w-a", results=True)
    r1 = msg("r1")
    await a.claim([r1])
    assert await a.record_failures([(r1, "boom")], max_failures=2) == {"r1": 1}
    assert await backend.outbox() == []
    assert not a.outbox_written.is_set()
    r1 = msg("r1")
    await a.claim([r1])
    assert await a.record_failures([(r1, "boom")], max_failures=2) == {"r1": 2}
    assert [row[:2] for row in await backend.outbox()] == [("r1", "FAILED")]
    assert a.outbox_written.is_set()

    off = await backend.store("w-off")
    r2 = msg("r2")
    await off.claim([r2])
    assert await off.record_failures([(r2, "boom")], max_failures=1) == {"r2": 1}
    assert (await backend.letters())["m-r2-1"][0] == "max_receives_exceeded"
    assert not off.outbox_written.is_set()


async def test_fifo_lost_claim_blocks_only_what_follows_it(backend: Backend) -> None:
    """Review finding: the fake blocked g1, claimed before the lost g2; Store completes it."""
    a = await backend.store("w-a")
    b = await backend.store("w-b")
    await a.claim([msg("g1", group="G")])
    await b.claim([msg("g2", group="G")])  # not ours: lost for a
    await a.claim([msg("g3", group="G")])
    res = await a.apply([msg("g1", group="G"), msg("g2", group="G"), msg("g3", group="G")],
                        ok, fifo=True)
    assert [m.request_id for m, _ in res.completed] == ["g1"]
    assert [m.request_id for m in res.lost] == ["g2"]
    assert [m.request_id for m in res.blocked] == ["g3"]


async def test_a_lost_claim_blocks_nothing_on_a_standard_queue(backend: Backend) -> None:
    """The FIFO rule above is for FIFO queues only: on a standard queue messages that carry
    a MessageGroupId (fair queues) are not held behind a lost claim of their group."""
    a = await backend.store("w-a")
    b = await backend.store("w-b")
    await a.claim([msg("g1", group="G")])
    await b.claim([msg("g2", group="G")])  # not ours: lost for a
    await a.claim([msg("g3", group="G")])
    res = await a.apply([msg("g1", group="G"), msg("g2", group="G"), msg("g3", group="G")],
                        ok, fifo=False)
    assert [m.request_id for m, _ in res.completed] == ["g1", "g3"]
    assert [m.request_id for m in res.lost] == ["g2"]
    assert res.blocked == []


def offloaded(rid: str, key: str, attributes: dict[str, Any] | None = None) -> Message:
    """A message whose payload came from S3 (``key``), with message attributes."""
    from service.core import attributes as attrs
    from service.core.pointers import Pointer

    m = msg(rid)
    m.pointer = Pointer("payloads", key)
    m.attributes = attrs.collect(attributes, None)
    m.attributes_json = attrs.encode(m.attributes)
    return m


async def test_claim_keeps_attributes_and_the_pointer_it_was_read_from(backend: Backend) -> None:
    a = await backend.store("w-a")
    binary = {"DataType": "Binary", "BinaryValue": b"\x00\xff"}
    await a.claim([offloaded("r1", "k1", {"tenant": {"DataType": "String", "StringValue": "acme"},
                                          "blob": binary}), msg("r2")])
    assert await backend.carried("r1") == (
        {"tenant": {"DataType": "String", "StringValue": "acme"},
         "blob": {"DataType": "Binary", "BinaryValue": "AP8="}}, "s3://payloads/k1")
    assert await backend.carried("r2") == (None, None)  # inline, no attributes: NULLs


async def test_known_pointers_name_the_request_and_its_status(backend: Backend) -> None:
    a = await backend.store("w-a")
    await a.claim([offloaded("r1", "k1"), offloaded("r2", "k2")])
    await a.apply([offloaded("r1", "k1")], ok)
    known = await a.known_pointers(["s3://payloads/k1", "s3://payloads/k2", "s3://payloads/k3"])
    assert {uri: (k.request_id, k.request_type, k.status) for uri, k in known.items()} == {
        "s3://payloads/k1": ("r1", "note", "COMPLETED"),
        "s3://payloads/k2": ("r2", "note", "IN_PROGRESS"),
    }
    assert await a.known_pointers([]) == {}


async def test_a_refusal_is_counted_from_the_first_per_pointer(backend: Backend) -> None:
    """S3 refusals (the unreadable-payload rule reads them): seconds since each pointer's
    FIRST refusal, not reset by later ones, one answer per pointer; nothing for nothing."""
    a = await backend.store("w-a")
    k1, k2 = "s3://payloads/k1", "s3://payloads/k2"
    assert await a.note_refusals({}) == {}
    first = await a.note_refusals({k1: "AccessDenied"})
    assert list(first) == [k1] and 0 <= first[k1] < 3600
    await backend.age_refusal(k1, 3600)
    again = await (await backend.store("w-b")).note_refusals({k1: "AccessDenied", k2: "x"})
    assert set(again) == {k1, k2}
    assert 3600 <= again[k1] < 2 * 3600 and 0 <= again[k2] < 3600


async def test_attributes_with_nul_characters_and_binary_values_are_stored(
    backend: Backend,
) -> None:
    """jsonb cannot hold U+0000: an attribute carrying one (an SNS envelope is whatever the
    producer wrote into the body; SQS's own checks vary by emulator) must not fail the
    batch's claim. Parsed from a real-shaped delivery, claimed, read back."""
    from service.core.messages import parse
    from service.handlers import Registry

    reg = Registry()
    reg.register("note", Note, ok)
    envelope = {"Type": "Notification", "Message": json.dumps(
        {"request_id": "r1", "type": "note", "payload": {"n": 1}}),
        "MessageAttributes": {"k\u0000": {"Type": "String", "Value": "v\u0000"},
                              "b": {"Type": "Binary", "Value": "AP8="}}}
    sqs = {"s": {"DataType": "String", "StringValue": "a\u0000b"},
           "raw": {"DataType": "Binary", "BinaryValue": b"\x00\x01\xff"}}
    m = parse(Received("m1", "rh", json.dumps(envelope), message_attributes=sqs), reg)
    assert isinstance(m, Message)
    a = await backend.store("w-a")
    assert (await a.claim([m]))["r1"].claimed
    stored, _ = await backend.carried("r1")
    assert stored == {
        "k\\x00": {"DataType": "String", "StringValue": "v\\x00"},
        "b": {"DataType": "Binary", "BinaryValue": "AP8="},
        "s": {"DataType": "String", "StringValue": "a\\x00b"},
        "raw": {"DataType": "Binary", "BinaryValue": "AAH/"}}


#: SQS sequence numbers are 128-bit decimals: far beyond bigint.
SEQ = 18_446_744_073_709_551_616_000


async def test_fifo_claim_holds_a_message_behind_an_earlier_unfinished_one_of_its_group(
    backend: Backend,
) -> None:
    """SPEC §6 "FIFO order", at claim time: while an earlier message of a group (lower
    SequenceNumber) is IN_PROGRESS under anyone — here a dead owner — a later one is held,
    not claimed; other groups, earlier messages and a standard queue's messages are not."""
    dead = await backend.store("w-dead")
    head = msg("g-1", 1, group="G", seq=SEQ + 10)
    assert (await dead.claim([head]))["g-1"].claimed
    await backend.kill("w-dead")
    s = await backend.store("w-live")
    later = [msg("g-2", 2, group="G", seq=SEQ + 20), msg("h-1", 1, group="H", seq=SEQ + 21),
             msg("g-0", 0, group="G", seq=SEQ + 5), msg("std", 1)]
    c = await s.claim(later)
    assert {k: (v.claimed, v.held) for k, v in c.items()} == {
        "g-2": (False, True), "h-1": (True, False), "g-0": (True, False),
        "std": (True, False)}
    assert "g-2" not in await backend.statuses()  # held: no claim row of its own
    # Its own redelivery is contention, not a hold (the rule is about other requests).
    again = await s.claim([msg("g-1", 1, mid="m-again", group="G", seq=SEQ + 10)])
    assert (again["g-1"].claimed, again["g-1"].held, again["g-1"].status) == (
        False, False, "IN_PROGRESS")
    # g-0 (earlier, claimed above) holds g-2 as well until it is finished.
    await s.apply([later[2]], ok, fifo=True)
    # Once the head is released (the orphan GC here), the group moves on.
    assert (await s.claim([msg("g-2", 2, group="G", seq=SEQ + 20)]))["g-2"].held
    assert [r["request_id"] for r in await s.gc(lease_seconds=30)] == ["g-1"]
    c = await s.claim([msg("g-2", 2, group="G", seq=SEQ + 20)])
    assert (c["g-2"].claimed, c["g-2"].held) == (True, False)


async def test_own_leak_gc_spares_held_young_and_foreign_claims(backend: Backend) -> None:
    """gc_own_leaks releases this worker's claims that no batch holds any more, once they
    are older than the margin (a claim made after the caller's snapshot of ``holding`` is
    safe); another worker's claims are never its business."""
    a, b = await backend.store("w-a"), await backend.store("w-b")
    await a.claim([msg("held"), msg("leaked"), msg("young")])
    await b.claim([msg("theirs")])
    assert await a.gc_own_leaks(["held"]) == []  # all younger than the margin
    await backend.age_claims(["held", "leaked", "theirs"], 60)
    assert await a.gc_own_leaks(["held"]) == ["leaked"]
    assert await backend.statuses() == {"held": ("IN_PROGRESS", "w-a"),
                                        "young": ("IN_PROGRESS", "w-a"),
                                        "theirs": ("IN_PROGRESS", "w-b")}
    assert await a.gc_own_leaks(["held"]) == []  # released once


async def test_ping_and_schema_check(backend: Backend) -> None:
    """ping answers while the database is there; check_schema raises SchemaBehind once a
    migration this code needs is missing; with the database gone, DatabaseUnavailable."""
    from service.errors import DatabaseUnavailable, SchemaBehind

    a = await backend.store("w-a")
    await a.ping()
    await a.check_schema()
    await backend.lose_migrations()
    with pytest.raises(SchemaBehind):
        await a.check_schema()
    await a.ping()  # behind is not down
    await backend.go_down()
    with pytest.raises(DatabaseUnavailable):
        await a.ping()
    with pytest.raises(DatabaseUnavailable):
        await a.claim([msg("r1")])



async def test_claim_takes_over_a_dead_owners_claim_never_a_live_ones(backend: Backend) -> None:
    """With the lease given, the claim statement collects a claim in its way whose owner the
    orphan GC would collect (heartbeat older than the lease), in the same statement; a live
    owner's claim stays contention (SPEC §2.6)."""
    live, dead = await backend.store("w-live"), await backend.store("w-dead")
    await live.claim([msg("r-live")])
    await dead.claim([msg("r-dead", mid="m-dead")])
    await backend.kill("w-dead")
    b = await backend.store("w-b", lease=30)
    mine = msg("r-dead", mid="m-again")
    got = await b.claim([msg("r-live"), mine])
    assert (got["r-live"].claimed, got["r-live"].owner, got["r-live"].collected_from) == (
        False, "w-live", None)
    assert (got["r-dead"].claimed, got["r-dead"].collected_from) == (True, "w-dead")
    assert await backend.statuses() == {"r-live": ("IN_PROGRESS", "w-live"),
                                        "r-dead": ("IN_PROGRESS", "w-b")}
    # The dead owner coming back late is fenced out; the new owner completes it once.
    late = await dead.apply([msg("r-dead", mid="m-dead")], ok)
    assert late.completed == [] and [m.request_id for m in late.lost] == ["r-dead"]
    assert [m.request_id for m, _ in (await b.apply([mine], ok)).completed] == ["r-dead"]
    # Without a lease nothing is taken over, however long the owner has been dead.
    await backend.kill("w-live")
    assert not (await (await backend.store("w-c")).claim([msg("r-live")]))["r-live"].claimed
    # A taken-over claim is the taker's own: released by its token like any claim.
    again = msg("r-live", mid="m-live-2")
    assert (await b.claim([again]))["r-live"].collected_from == "w-live"
    await b.release([again])
    assert "r-live" not in await backend.statuses()


async def test_fifo_head_of_a_dead_owner_is_taken_over_with_its_followers(
    backend: Backend,
) -> None:
    """A FIFO head claimed by a dead owner, received again with its follower in one batch:
    both are claimed in that statement (the caller orders them). Behind a live owner's head
    the follower stays held; a follower received without its head stays held too (only the
    batch's own requests are taken over)."""
    dead = await backend.store("w-dead")
    await dead.claim([msg("h", 1, group="G", seq=SEQ + 1)])
    await backend.kill("w-dead")
    b = await backend.store("w-b", lease=30)
    alone = await b.claim([msg("f", 2, group="G", seq=SEQ + 2)])
    assert (alone["f"].claimed, alone["f"].held) == (False, True)
    both = await b.claim([msg("h", 1, group="G", seq=SEQ + 1),
                          msg("f", 2, group="G", seq=SEQ + 2)])
    assert {k: (v.claimed, v.held, v.collected_from) for k, v in both.items()} == {
        "h": (True, False, "w-dead"), "f": (True, False, None)}
    live = await backend.store("w-live")
    await live.claim([msg("h2", 1, group="K", seq=SEQ + 1)])
    behind = await b.claim([msg("h2", 1, group="K", seq=SEQ + 1),
                            msg("f2", 2, group="K", seq=SEQ + 2)])
    assert {k: (v.claimed, v.held) for k, v in behind.items()} == {
        "h2": (False, False), "f2": (False, True)}
    # A follower's own dead claim is not taken over while its head is unfinished elsewhere.
    await dead.claim([msg("f3", 2, group="M", seq=SEQ + 2)])
    await live.claim([msg("h3", 1, group="M", seq=SEQ + 1)])
    waits = (await b.claim([msg("f3", 2, mid="m-f3-again", group="M", seq=SEQ + 2)]))["f3"]
    assert (waits.claimed, waits.collected_from, waits.owner) == (False, None, "w-dead")

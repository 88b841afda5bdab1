"""One contract, two stores: every test runs over the in-memory ``FakeStore`` and over the
real ``Store`` on PostgreSQL. A fake that drifts from the real thing fails here."""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any, Protocol

import asyncpg
import pytest
from pydantic import BaseModel

from service.messages import Message, Received
from service.seams import DeadLetter, StoreSeam
from service.store import Store, create_pool
from service.testing import FakeDatabase, FakeStore, FakeWorker
from tests.conftest import fresh_database
from tests.servers import Postgres


class Note(BaseModel):
    n: int


def msg(rid: str, n: int = 1, mid: str | None = None, group: str | None = None) -> Message:
    payload = {"n": n}
    # Independent of service.messages.payload_hash: the sorted compact JSON, hashed here.
    digest = hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()
    raw = Received(mid or f"m-{rid}-{n}", "rh", json.dumps(payload), 1, None, group)
    return Message(raw, rid, "note", Note(n=n), payload, digest)


async def ok(m: Message, conn: Any) -> dict[str, Any]:
    return {"n": m.payload.n}  # type: ignore[attr-defined]


class Backend(Protocol):
    async def store(self, worker_id: str) -> StoreSeam: ...
    async def kill(self, worker_id: str) -> None: ...
    async def statuses(self) -> dict[str, tuple[str, str]]: ...
    async def letters(self) -> dict[str, tuple[str, str]]: ...


class FakeBackend:
    def __init__(self) -> None:
        self.db = FakeDatabase()

    async def store(self, worker_id: str) -> StoreSeam:
        s = FakeStore(worker_id, self.db)
        await s.register_worker(worker_id)
        return s

    async def kill(self, worker_id: str) -> None:
        self.db.age_worker(worker_id, 3600)

    async def statuses(self) -> dict[str, tuple[str, str]]:
        return {r.request_id: (r.status, r.owner) for r in self.db.rows.values()}

    async def letters(self) -> dict[str, tuple[str, str]]:
        return {k: (d.reason, d.body) for k, d in self.db.dead.items()}


class RealBackend:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    async def store(self, worker_id: str) -> StoreSeam:
        s = Store(self.pool, worker_id)
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


@pytest.fixture(params=["fake", "postgres"])
async def backend(request: pytest.FixtureRequest, pg_server: Postgres) -> AsyncIterator[Backend]:
    if request.param == "fake":
        yield FakeBackend()
        return
    async with fresh_database(pg_server) as database_url:
        pool = await create_pool(database_url, 4)
        try:
            yield RealBackend(pool)
        finally:
            await pool.close()


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
    busy = (await (await backend.store("w-b")).claim([msg("r2")]))["r2"]
    assert (busy.claimed, busy.status, busy.owner) == (False, "IN_PROGRESS", "w-a")


async def test_completion_is_fenced_on_the_owner(backend: Backend) -> None:
    a = await backend.store("w-a")
    b = await backend.store("w-b")
    await a.claim([msg("r1")])
    res = await b.apply([msg("r1")], ok)
    assert res.completed == [] and [m.request_id for m in res.lost] == ["r1"]
    assert await backend.statuses() == {"r1": ("IN_PROGRESS", "w-a")}


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
    from datetime import UTC, datetime, timedelta

    old = await backend.store("w-old")
    await old.claim([msg("r1")])
    new = await backend.store("w-new")
    assert await new.gc(30) == []
    later = datetime.now(UTC) + timedelta(seconds=5)
    assert await new.gc(30, "w-other-name", later) == []
    assert [r["request_id"] for r in await new.gc(30, "w-old", later)] == ["r1"]


async def test_release_gives_back_only_this_delivery(backend: Backend) -> None:
    a = await backend.store("w-a")
    await a.claim([msg("r1", mid="sqs-1")])
    await a.release([msg("r1", mid="sqs-2")])  # another delivery of the same request
    assert await backend.statuses() == {"r1": ("IN_PROGRESS", "w-a")}
    await a.release([msg("r1", mid="sqs-1")])
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
    await a.claim([msg("r1"), msg("r2")])
    await b.claim([msg("r3")])
    assert await a.stop_worker() == 2
    assert await backend.statuses() == {"r3": ("IN_PROGRESS", "w-b")}
    assert await a.heartbeat() is False  # stopped: its claims may be collected


def test_fake_worker_record_is_public() -> None:
    assert FakeWorker("x").stopped is False

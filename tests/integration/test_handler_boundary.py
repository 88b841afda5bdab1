"""What a handler author can do to the batch path, on the real PostgreSQL store: each test
here is a bug found at that boundary (xfail strict until it is fixed). The batch runs
through ``BatchProcessor`` over ``Store`` and an in-memory queue, as ``service.testing.kit`` does,
with redeliveries made by hand."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from service.adapters.store import Store, create_pool
from service.core.retry import ReceiveLimit, RetryPolicy
from service.handlers import Registry, current_request_id
from service.runtime.batch import BatchProcessor
from service.runtime.dbhealth import DatabaseHealth
from service.testing import FakeQueue


class P(BaseModel):
    note: str = ""


def body(rid: str, type_: str, **payload: Any) -> str:
    return json.dumps({"request_id": rid, "type": type_, "payload": payload})


async def effect(conn: Any) -> None:
    """The handler's database effect: one row in ``fx`` per run that commits."""
    await conn.execute("INSERT INTO fx VALUES ($1)", current_request_id())


async def well_behaved(_p: P, conn: Any) -> dict[str, Any]:
    await effect(conn)
    return {"ok": True}


async def fails(_p: P, _conn: Any) -> None:
    raise RuntimeError("this neighbour fails")


def registry(**handlers: Any) -> Registry:
    reg = Registry()
    for type_, fn in handlers.items():
        reg.register(type_, P, fn)
    return reg


class Rig:
    """One worker's batch path on ``dsn``; ``round()`` receives and runs one batch, making
    everything visible first (a redelivery)."""

    def __init__(self, dsn: str, reg: Registry, pool_size: int = 4, max_failures: int = 3):
        self.dsn, self.reg, self.pool_size, self.max_failures = dsn, reg, pool_size, max_failures

    async def __aenter__(self) -> Rig:
        self.pool = await create_pool(self.dsn, self.pool_size)
        self.store = Store(self.pool, "boundary-worker")
        await self.store.register_worker("boundary")
        self.queue = FakeQueue()
        self.health = DatabaseHealth(self.store, asyncio.Event(), self._back)
        self.proc = BatchProcessor(
            self.queue, self.store, self.reg, RetryPolicy(max_failures=self.max_failures),
            self.health, fifo=False, visibility_timeout=30, handler_timeout=60,
            fatal=lambda *a, **k: None, limit=ReceiveLimit(self.max_failures))
        return self

    async def _back(self) -> None:
        await self.proc.executor.release_unreleased()

    async def __aexit__(self, *exc: object) -> None:
        self.health.cancel()
        await self.pool.close()

    async def round(self) -> None:
        for m in self.queue.messages.values():
            m.visible_at = 0
        batch = await self.queue.receive(10, 0, 30)
        if batch:
            await self.proc.run(batch)


@pytest.fixture
async def fx(db: asyncpg.Connection) -> asyncpg.Connection:
    await db.execute("CREATE TABLE fx (rid text)")
    return db


async def effects(db: asyncpg.Connection, rid: str) -> int:
    return int(await db.fetchval("SELECT count(*) FROM fx WHERE rid = $1", rid))


async def status(db: asyncpg.Connection, rid: str) -> str | None:
    return await db.fetchval("SELECT status FROM modifications WHERE request_id = $1", rid)


async def failures(db: asyncpg.Connection, rid: str) -> int | None:
    return await db.fetchval("SELECT failures FROM retry_attempts WHERE request_id = $1", rid)


async def last_error(db: asyncpg.Connection, rid: str) -> str | None:
    """What an operator reads of a failure (retry_attempts, then the dead letter)."""
    return await db.fetchval("SELECT last_error FROM retry_attempts WHERE request_id = $1", rid)


async def test_a_handler_that_rolls_back_loses_no_neighbours_effect(
    database_url: str, fx: asyncpg.Connection
) -> None:
    async def rolls_back(_p: P, conn: Any) -> None:
        await conn.execute("ROLLBACK")

    async with Rig(database_url, registry(ok=well_behaved, rb=rolls_back)) as rig:
        rig.queue.send(body("neighbour", "ok"))
        rig.queue.send(body("rolls-back", "rb"))
        await rig.round()
        acked = len(rig.queue.deleted)
    # The neighbour was acked and is COMPLETED (its outcome says it landed)...
    assert acked >= 1 and await status(fx, "neighbour") == "COMPLETED"
    # ... so its effect must be there.
    assert await effects(fx, "neighbour") == 1
    assert await last_error(fx, "rolls-back") == (
        "HandlerEndedTransaction: the handler ended the transaction (COMMIT/ROLLBACK)")


async def test_a_handler_that_commits_is_not_applied_twice(
    database_url: str, fx: asyncpg.Connection
) -> None:
    async def commits(_p: P, conn: Any) -> None:
        await effect(conn)
        await conn.execute("COMMIT")

    async with Rig(database_url, registry(c=commits, bad=fails)) as rig:
        rig.queue.send(body("commits", "c"))
        rig.queue.send(body("bad", "bad"))
        await rig.round()
    assert await effects(fx, "commits") <= 1
    assert (await last_error(fx, "commits") or "").startswith("HandlerEndedTransaction: ")


async def swallows(_p: P, conn: Any) -> None:
    try:
        await conn.execute("SELECT 1/0")
    except asyncpg.DivisionByZeroError:
        pass  # "ignore it": the transaction is aborted all the same


@pytest.mark.parametrize("last", [False, True], ids=["a-neighbour-finds-it", "complete-finds-it"])
async def test_a_handler_that_swallows_a_database_error_fails_alone(
    last: bool, database_url: str, fx: asyncpg.Connection
) -> None:
    """Found aborted by the next handler's statement, or — the swallower last — by the
    completing statement itself: either way the swallower fails, its neighbours complete."""
    order = (("n1", "ok"), ("n2", "ok"), ("swallows", "sw")) if last else (
        ("n1", "ok"), ("swallows", "sw"), ("n2", "ok"))
    async with Rig(database_url, registry(ok=well_behaved, sw=swallows)) as rig:
        for rid, type_ in order:
            rig.queue.send(body(rid, type_))
        await rig.round()
    assert [await status(fx, r) for r in ("n1", "n2")] == ["COMPLETED", "COMPLETED"]
    assert await failures(fx, "swallows") == 1
    assert (await last_error(fx, "swallows") or "").startswith(
        "HandlerLeftTransactionAborted: the handler returned with the transaction aborted")


@pytest.mark.parametrize("breaks", ["closes", "terminates", "leaves_a_query_running",
                                    "own_connection_error", "own_connection_error_when_aborted",
                                    "returns_with_a_query_running"])
async def test_a_handler_that_breaks_its_connection_is_dead_lettered_at_the_limit(
    breaks: str, database_url: str, fx: asyncpg.Connection
) -> None:
    async def breaker(_p: P, conn: Any) -> None:
        if breaks == "closes":
            await conn.close()
            return
        if breaks == "terminates":
            conn.terminate()
            return
        if breaks.startswith("own_connection_error"):
            if breaks.endswith("_when_aborted"):  # the daemon's check finds it aborted, not gone
                with contextlib.suppress(asyncpg.DivisionByZeroError):
                    await conn.execute("SELECT 1/0")
            # As its own connection to another database (a lookup service) would raise.
            raise asyncpg.ConnectionDoesNotExistError("the lookup database went away")
        asyncio.ensure_future(conn.execute("SELECT pg_sleep(0.3)"))
        await asyncio.sleep(0)
        if breaks == "returns_with_a_query_running":
            return  # the daemon's next statement finds the connection busy
        raise ValueError("left a query running")

    async with Rig(database_url, registry(br=breaker), max_failures=2) as rig:
        rig.queue.send(body("breaks", "br"))
        # Far more receives than the limit (2) and the repeat-offender net (3 x 2).
        for _ in range(8):
            await rig.round()
            await asyncio.wait_for(rig.health.up.wait(), 30)
            if not rig.queue.messages:
                break
        lettered = await fx.fetchval("SELECT count(*) FROM dead_letters")
    assert lettered == 1, f"{rig.queue.visibility_calls=}"
    error = await fx.fetchval("SELECT error FROM dead_letters")
    assert error.startswith({
        "closes": "HandlerClosedConnection: the handler closed its database connection",
        "terminates": "HandlerClosedConnection: the handler closed its database connection",
        "own_connection_error_when_aborted":
            "ConnectionDoesNotExistError: the lookup database went away",
        "leaves_a_query_running": "ValueError: left a query running",
        "own_connection_error": "ConnectionDoesNotExistError: the lookup database went away",
        "returns_with_a_query_running": "HandlerLeftTransactionAborted: the handler returned "
                                        "with the transaction aborted or its connection busy",
    }[breaks]), error


async def test_a_batch_that_goes_well_pays_for_no_probe(
    database_url: str, fx: asyncpg.Connection
) -> None:
    """The probe (``SELECT 1`` after each handler) only runs once a transaction was found
    aborted: a batch that goes well makes no statement beyond its own."""
    statements: list[str] = []

    def log(query: Any) -> None:
        statements.append(query.query)

    async def logged(p: P, conn: Any) -> dict[str, Any]:
        conn.add_query_logger(log)  # a set: added once
        return await well_behaved(p, conn)

    async with Rig(database_url, registry(ok=logged), pool_size=1) as rig:
        for rid in ("a", "b", "c"):
            rig.queue.send(body(rid, "ok"))
        await rig.round()
        await asyncio.sleep(0.1)  # query loggers run from the event loop (call_soon)
    assert [await status(fx, r) for r in ("a", "b", "c")] == ["COMPLETED"] * 3
    assert statements and "SELECT 1" not in statements, statements


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be printed")


async def test_an_unprintable_exception_is_counted_and_its_neighbour_acked(
    database_url: str, fx: asyncpg.Connection
) -> None:
    async def raises_unprintable(_p: P, _conn: Any) -> None:
        raise Unprintable()

    async with Rig(database_url, registry(ok=well_behaved, up=raises_unprintable)) as rig:
        neighbour = rig.queue.send(body("neighbour", "ok"))
        rig.queue.send(body("unprintable", "up"))
        await rig.round()
        acked = list(rig.queue.deleted)
    assert await status(fx, "neighbour") == "COMPLETED"
    assert acked == [neighbour]
    assert await failures(fx, "unprintable") == 1
    assert await last_error(fx, "unprintable") == "Unprintable: <its str() raised RuntimeError>"


async def test_a_result_with_an_escaped_backslash_u0000_text_completes(
    database_url: str, fx: asyncpg.Connection
) -> None:
    text = "\\u0000"  # six characters: a backslash, then u0000 (no NUL in it)

    async def returns_text(_p: P, _conn: Any) -> dict[str, Any]:
        return {"pattern": text}

    async with Rig(database_url, registry(rt=returns_text)) as rig:
        rig.queue.send(body("escaped", "rt"))
        await rig.round()
    assert await status(fx, "escaped") == "COMPLETED"
    assert json.loads(await fx.fetchval(
        "SELECT result::text FROM modifications WHERE request_id = 'escaped'")) == {
            "pattern": text}


async def test_a_payload_with_an_escaped_backslash_u0000_text_completes(
    database_url: str, fx: asyncpg.Connection
) -> None:
    text = "\\u0000"  # six characters: a backslash, then u0000 (no NUL in it)
    # PostgreSQL stores it (the daemon's own claim statement casts the same JSON to jsonb).
    assert await fx.fetchval("SELECT ($1::text::jsonb)->>'note'",
                             json.dumps({"note": text})) == text
    async with Rig(database_url, registry(ok=well_behaved)) as rig:
        rig.queue.send(body("escaped", "ok", note=text))
        await rig.round()
    assert await fx.fetchval("SELECT reason FROM dead_letters") is None
    assert await status(fx, "escaped") == "COMPLETED"
    assert await effects(fx, "escaped") == 1


async def test_a_session_setting_does_not_leak_into_the_next_batch(
    database_url: str, fx: asyncpg.Connection
) -> None:
    """Reset, not thrown away: the next batch runs on the same backend (one pooled
    connection), and the setting is gone."""
    backends: list[int] = []

    async def sets(_p: P, conn: Any) -> None:
        backends.append(conn.get_server_pid())
        await conn.execute("SET statement_timeout = '50ms'")  # meant as SET LOCAL

    async def slow(_p: P, conn: Any) -> dict[str, Any]:
        backends.append(conn.get_server_pid())
        await conn.execute("SELECT pg_sleep(0.2)")
        return {"statement_timeout": await conn.fetchval("SHOW statement_timeout")}

    async with Rig(database_url, registry(sets=sets, slow=slow), pool_size=1) as rig:
        rig.queue.send(body("sets", "sets"))
        await rig.round()
        rig.queue.send(body("slow", "slow"))  # another batch, on the same connection
        await rig.round()
    assert await failures(fx, "slow") is None
    assert await status(fx, "slow") == "COMPLETED"
    assert len(backends) == 2 and backends[0] == backends[1], backends


async def _role(fx: asyncpg.Connection, name: str) -> str:
    """A role the test's user may SET ROLE to, with every privilege the store needs."""
    me = await fx.fetchval("SELECT current_user")
    await fx.execute(f'CREATE ROLE "{name}"; GRANT "{name}" TO "{me}";'
                     f' GRANT ALL ON ALL TABLES IN SCHEMA public TO "{name}";'
                     f' GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{name}"')
    return name


@pytest.mark.parametrize("dsn_role", [False, True], ids=["own_user", "role_in_the_dsn"])
async def test_a_role_an_advisory_lock_and_a_listen_do_not_leak_into_the_next_batch(
    database_url: str, fx: asyncpg.Connection, dsn_role: bool
) -> None:
    """What RESET ALL leaves (SET ROLE, session advisory locks, LISTEN) is reset too: the next
    batch, on the same backend, runs as the role the connection was made with (the store's
    statements with it), holds no lock and listens to nothing."""
    db = await fx.fetchval("SELECT current_database()")
    roles = [await _role(fx, f"r_{db}")]
    expected = await fx.fetchval("SELECT current_user")
    if dsn_role:  # the connection's own role, given in the DSN: what RESET ROLE returns to
        roles.append(expected := await _role(fx, f"base_{db}"))
        database_url += f"?role={expected}"
    backends: list[int] = []

    async def becomes(_p: P, conn: Any) -> None:
        backends.append(conn.get_server_pid())
        await conn.execute(f'SET ROLE "{roles[0]}"')  # the rest of its batch runs as that role
        await conn.execute("SELECT pg_advisory_lock(4242); LISTEN boundary_channel")

    async def reads(_p: P, conn: Any) -> dict[str, Any]:
        backends.append(conn.get_server_pid())
        row = await conn.fetchrow(
            "SELECT current_user AS user, (SELECT count(*) FROM pg_locks WHERE"
            " locktype = 'advisory' AND pid = pg_backend_pid()) AS locks,"
            " (SELECT count(*) FROM pg_listening_channels()) AS listening")
        return dict(row)

    try:
        async with Rig(database_url, registry(becomes=becomes, reads=reads), pool_size=1) as rig:
            rig.queue.send(body("becomes", "becomes"))
            await rig.round()
            rig.queue.send(body("reads", "reads"))  # another batch, on the same connection
            await rig.round()
    finally:
        for role in roles:
            await fx.execute(f'DROP OWNED BY "{role}"; DROP ROLE "{role}"')
    assert await status(fx, "becomes") == "COMPLETED"
    result = await fx.fetchval("SELECT result FROM modifications WHERE request_id = 'reads'")
    assert json.loads(result) == {"user": expected, "locks": 0, "listening": 0}
    assert len(backends) == 2 and backends[0] == backends[1], backends


async def test_a_batch_form_that_declines_after_writing_is_not_applied_twice(
    database_url: str, fx: asyncpg.Connection
) -> None:
    reg = registry(ok=well_behaved)

    async def writes_then_declines(items: list[tuple[str, P]], conn: Any) -> None:
        await conn.executemany("INSERT INTO fx VALUES ($1)", [(rid,) for rid, _ in items])
        return None  # "these cannot go as one batch after all"

    reg.register_batch("ok", writes_then_declines)
    async with Rig(database_url, reg) as rig:
        rig.queue.send(body("a", "ok"))
        rig.queue.send(body("b", "ok"))
        await rig.round()
    assert [await effects(fx, r) for r in ("a", "b")] == [1, 1]


@pytest.mark.parametrize("at", [0, 1, 2], ids=["offender-first", "offender-middle", "offender-last"])
async def test_a_handler_that_commits_costs_its_neighbours_nothing(
    at: int, database_url: str, fx: asyncpg.Connection
) -> None:
    """Its COMMIT must not commit what the handlers before it wrote while their rows are
    still IN_PROGRESS: what a crash right after it would leave is read from another session
    inside the handler. Each neighbour's effect lands once, with its row COMPLETED and its
    message acked once; the committer fails alone, with what it wrote undone."""
    seen_after_commit: list[int] = []

    async def commits(_p: P, conn: Any) -> None:
        await effect(conn)
        try:
            await conn.execute("COMMIT")
        finally:
            seen_after_commit.append(int(await fx.fetchval("SELECT count(*) FROM fx")))

    order = ["n1", "n2"]
    order.insert(at, "commits")
    async with Rig(database_url, registry(ok=well_behaved, c=commits)) as rig:
        sent = {rid: rig.queue.send(body(rid, "c" if rid == "commits" else "ok"))
                for rid in order}
        await rig.round()
        acked = list(rig.queue.deleted)
    assert seen_after_commit == [0]
    assert [await effects(fx, r) for r in ("n1", "n2")] == [1, 1]
    assert [await status(fx, r) for r in ("n1", "n2")] == ["COMPLETED", "COMPLETED"]
    assert sorted(acked) == sorted([sent["n1"], sent["n2"]])
    assert await effects(fx, "commits") == 0
    assert await failures(fx, "commits") == 1
    assert (await last_error(fx, "commits") or "").startswith(
        "HandlerEndedTransaction: the handler ended the transaction (COMMIT/ROLLBACK)")


async def test_a_batch_form_that_commits_costs_its_group_nothing(
    database_url: str, fx: asyncpg.Connection
) -> None:
    """The batch form's COMMIT is refused like a plain handler's: the attempt is rerun one by
    one, where the message whose handler commits fails alone and the others apply once."""
    async def one(_p: P, conn: Any) -> dict[str, Any]:
        await effect(conn)
        if current_request_id() == "commits":
            await conn.execute("COMMIT")
        return {"ok": True}

    async def many(items: list[tuple[str, P]], conn: Any) -> list[dict[str, Any] | None] | None:
        await conn.executemany("INSERT INTO fx VALUES ($1)", [(rid,) for rid, _ in items])
        if any(rid == "commits" for rid, _ in items):
            await conn.execute("COMMIT")
        return [{"ok": True} for _ in items]

    reg = registry(ok=one)
    reg.register_batch("ok", many)
    async with Rig(database_url, reg) as rig:
        for rid in ("a", "commits", "b"):
            rig.queue.send(body(rid, "ok"))
        await rig.round()
    assert [await effects(fx, r) for r in ("a", "b", "commits")] == [1, 1, 0]
    assert [await status(fx, r) for r in ("a", "b")] == ["COMPLETED", "COMPLETED"]
    assert (await last_error(fx, "commits") or "").startswith("HandlerEndedTransaction: ")

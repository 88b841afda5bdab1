"""``dlq list`` / ``dlq replay`` against real PostgreSQL and the moto SQS server.

The two-session tests prove the replay race fix (seed 002): session A holds the row lock
while it "sends" (blocked on an event inside the injected send), session B replays the
same row. With the lock, B waits on it (seen in ``pg_stat_activity``) and then finds the
row replayed; exactly one send happens. The same test run against ``racy_replay_one``
(select without ``FOR UPDATE``) sends twice — it is marked ``xfail(strict=True)`` so the
suite shows the test can fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from service.adapters.sql import queries
from service.cli import _parser
from service.ops import dlq
from service.ops.dlq import AlreadyReplayed, Letter, NotFound, SendFailed
from tests.integration.conftest import make_settings

BODY_WEIRD = 'not json {\u00e9\t"x":  1}\n  trailing spaces   \r\n\u2603'

Impl = Callable[[asyncpg.Connection, int, dlq.Send], Coroutine[Any, Any, Letter]]
BatchImpl = Callable[..., Coroutine[Any, Any, list[Letter]]]


async def add_letter(
    conn: asyncpg.Connection, body: str, reason: str = "invalid_json",
    request_id: str | None = None, received_at: datetime | None = None,
    replayed_at: datetime | None = None,
) -> int:
    return int(await conn.fetchval(
        "INSERT INTO dead_letters (sqs_message_id, body, reason, error, request_id, request_type,"
        " receive_count, received_at, replayed_at)"
        " VALUES (gen_random_uuid()::text, $1, $2, 'boom', $3, 'entity.upsert', 1,"
        " coalesce($4, now()), $5) RETURNING id",
        body, reason, request_id, received_at, replayed_at,
    ))


def args(*argv: str) -> Any:
    return _parser().parse_args(["dlq", *argv])


def receive_all(sqs: Any, queue_url: str, expect: int) -> list[dict[str, Any]]:
    """Receive until ``expect`` messages came back, then check nothing more is there."""
    got: list[dict[str, Any]] = []
    for _ in range(20):
        if len(got) >= expect:
            break
        resp = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                                   AttributeNames=["All"])
        got.extend(resp.get("Messages", []))
    extra = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0)
    got.extend(extra.get("Messages", []))
    return got


class Sends:
    """An injected ``send`` that records calls and can block until released."""

    def __init__(self, block: bool = False) -> None:
        self.calls: list[int] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        if not block:
            self.release.set()

    async def __call__(self, letter: Letter) -> str:
        self.calls.append(letter.id)
        self.entered.set()
        await self.release.wait()
        return f"msg-{letter.id}"


async def wait_for_lock_wait(observer: asyncpg.Connection, pid: int,
                             done: asyncio.Task[Any], within: float = 10) -> bool:
    """True once ``pid`` waits on a lock; False if ``done`` finished first (no blocking)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while loop.time() < deadline:
        waiting = await observer.fetchval(
            "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid)
        if waiting:
            return True
        if done.done():
            return False
        await asyncio.sleep(0.02)
    raise AssertionError(f"session pid={pid} neither blocked on a lock nor finished "
                         f"within {within}s")


# -- a deliberately broken implementation, to prove the race tests can fail -----------------

async def racy_replay_one(conn: asyncpg.Connection, letter_id: int, send: dlq.Send) -> Letter:
    """The shape seed 002 reports: select without FOR UPDATE, send, mark."""
    async with conn.transaction():
        row = await conn.fetchrow(
            "SELECT * FROM dead_letters WHERE id = $1 AND replayed_at IS NULL", letter_id)
        if row is None:
            raise AlreadyReplayed(Letter.of(await conn.fetchrow(queries()["dlq_find_one"], letter_id)))
        letter = Letter.of(row)
        await send(letter)
        await conn.execute("UPDATE dead_letters SET replayed_at = now() WHERE id = $1", letter_id)
    return letter


async def racy_replay_batch(conn: asyncpg.Connection, send: dlq.Send, reason: str | None = None,
                            limit: int = 10) -> list[Letter]:
    async with conn.transaction():
        rows = await conn.fetch(
            "SELECT * FROM dead_letters WHERE replayed_at IS NULL ORDER BY id LIMIT $1", limit)
        letters = [Letter.of(r) for r in rows]
        for x in letters:
            await send(x)
        await conn.execute("UPDATE dead_letters SET replayed_at = now() WHERE id = ANY($1)",
                           [x.id for x in letters])
    return letters


# -- list ---------------------------------------------------------------------------------

async def test_list_filters_by_reason_time_and_replayed(
    db: asyncpg.Connection, database_url: str, queue_url: str, sqs_endpoint: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    t0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    a = await add_letter(db, "a-body", "invalid_json", "r-a", t0)
    b = await add_letter(db, "b-body", "unknown_type", "r-b", t0 + timedelta(hours=1))
    c = await add_letter(db, BODY_WEIRD, "invalid_json", None, t0 + timedelta(hours=2))
    d = await add_letter(db, "d-body", "invalid_json", "r-d", t0 + timedelta(hours=3),
                         replayed_at=t0 + timedelta(hours=4))
    s = make_settings(queue_url, database_url, sqs_endpoint)

    async def ids(*argv: str) -> list[int]:
        assert await dlq.main(s, args("list", "--format", "json", *argv)) == 0
        return [x["id"] for x in json.loads(capsys.readouterr().out)]

    assert await ids() == [a, b, c]
    assert await ids("--include-replayed") == [a, b, c, d]
    assert await ids("--reason", "invalid_json") == [a, c]
    assert await ids("--since", "2024-05-01T13:00:00Z") == [b, c]
    assert await ids("--until", "2024-05-01T13:00:00+00:00") == [a]
    # No offset: UTC, like every timestamp the tool prints.
    assert await ids("--since", "2024-05-01T13:00:00", "--until", "2024-05-01T14:00:00") == [b]
    assert await ids("--reason", "invalid_json", "--include-replayed",
                     "--since", "2024-05-01T14:00:00Z") == [c, d]
    assert await ids("--limit", "2") == [a, b]

    assert await dlq.main(s, args("list", "--format", "json", "--include-replayed")) == 0
    rows = {x["id"]: x for x in json.loads(capsys.readouterr().out)}
    assert rows[c]["body"] == BODY_WEIRD
    assert rows[d]["replayed_at"] == (t0 + timedelta(hours=4)).isoformat()
    assert rows[a]["received_at"] == t0.isoformat()
    assert rows[a]["reason"] == "invalid_json" and rows[a]["request_id"] == "r-a"

    assert await dlq.main(s, args("list")) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["id", "received_at", "reason", "request_id", "replayed_at",
                                "body"]
    assert len(table) == 1 + 3 + 1 and table[-1] == "(3 dead letters)"
    assert table[1].split() == [str(a), "2024-05-01T12:00:00Z", "invalid_json", "r-a", "-",
                                "a-body"]
    # A body with newlines still takes one line of the table.
    assert table[3].startswith(str(c)) and "\\n" in table[3]

    assert await dlq.main(s, args("list", "--since", "yesterday")) == 2
    assert "--since" in capsys.readouterr().err


# -- replay through the CLI, onto the moto queue -------------------------------------------

async def test_replay_one_sends_raw_body_and_marks_replayed(
    db: asyncpg.Connection, database_url: str, queue_url: str, sqs_endpoint: str,
    sqs_client: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    lid = await add_letter(db, BODY_WEIRD, request_id="r-1")
    other = await add_letter(db, "other")
    s = make_settings(queue_url, database_url, sqs_endpoint)

    assert await dlq.main(s, args("replay", "--id", str(lid))) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "replayed 1"
    msgs = receive_all(sqs_client, queue_url, expect=1)
    assert [m["Body"] for m in msgs] == [BODY_WEIRD]  # byte for byte
    assert await db.fetchval("SELECT replayed_at IS NOT NULL FROM dead_letters WHERE id=$1", lid)
    assert await db.fetchval("SELECT replayed_at FROM dead_letters WHERE id=$1", other) is None

    # Replaying it again is refused, clearly, and sends nothing.
    assert await dlq.main(s, args("replay", "--id", str(lid))) == 1
    err = capsys.readouterr().err
    assert f"id={lid} was already replayed" in err
    assert receive_all(sqs_client, queue_url, expect=0) == []

    assert await dlq.main(s, args("replay", "--id", "999999")) == 1
    assert "id=999999 not found" in capsys.readouterr().err


async def test_replay_to_fifo_queue_sets_group_and_dedup_id(
    db: asyncpg.Connection, database_url: str, fifo_queue_url: str, sqs_endpoint: str,
    sqs_client: Any,
) -> None:
    """A letter stored without its group (before dead_letters kept it, or not from a FIFO
    queue) goes to the group of its request_id, or dlq-replay."""
    with_rid = await add_letter(db, '{"request_id": "r-9"}', request_id="r-9")
    without = await add_letter(db, "junk", request_id=None)
    s = make_settings(fifo_queue_url, database_url, sqs_endpoint)
    assert await dlq.main(s, args("replay", "--all")) == 0
    msgs = receive_all(sqs_client, fifo_queue_url, expect=2)
    got = {m["Body"]: m["Attributes"] for m in msgs}
    assert got['{"request_id": "r-9"}']["MessageGroupId"] == "r-9"
    assert got['{"request_id": "r-9"}']["MessageDeduplicationId"] == f"dlq-{with_rid}"
    assert got["junk"]["MessageGroupId"] == "dlq-replay"
    assert got["junk"]["MessageDeduplicationId"] == f"dlq-{without}"


async def test_replay_to_fifo_queue_keeps_the_original_message_group(
    db: asyncpg.Connection, database_url: str, fifo_queue_url: str, sqs_endpoint: str,
    sqs_client: Any,
) -> None:
    """A FIFO message dead-lettered by the daemon goes back into the group it came from
    (its followers and its replay stay in one order), not into a group named after it."""
    from service.adapters.store import Store, create_pool
    from service.core.seams import DeadLetter

    pool = await create_pool(database_url, 2)
    try:
        await Store(pool, "w-dl").dead_letter([DeadLetter(
            "m-poison", '{"request_id": "r-7"}', "unknown_type", "no handler", "r-7", "t", 1,
            "orders-42")])
    finally:
        await pool.close()
    s = make_settings(fifo_queue_url, database_url, sqs_endpoint)
    assert await dlq.main(s, args("replay", "--all")) == 0
    [m] = receive_all(sqs_client, fifo_queue_url, expect=1)
    assert m["Body"] == '{"request_id": "r-7"}'
    assert m["Attributes"]["MessageGroupId"] == "orders-42"


async def test_replay_all_by_reason_then_everything(
    db: asyncpg.Connection, database_url: str, queue_url: str, sqs_endpoint: str,
    sqs_client: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    bodies = {await add_letter(db, f"json-{i}", "invalid_json"): f"json-{i}" for i in range(13)}
    typed = {await add_letter(db, f"type-{i}", "unknown_type"): f"type-{i}" for i in range(3)}
    await add_letter(db, "old", "unknown_type", replayed_at=datetime.now(UTC))
    s = make_settings(queue_url, database_url, sqs_endpoint)

    assert await dlq.main(s, args("replay", "--all", "--reason", "unknown_type")) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("replayed 3 ")
    assert sorted(m["Body"] for m in receive_all(sqs_client, queue_url, 3)) == sorted(
        typed.values())

    # 13 rows: more than one batch of 10.
    assert await dlq.main(s, args("replay", "--all")) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("replayed 13 ")
    assert sorted(m["Body"] for m in receive_all(sqs_client, queue_url, 13)) == sorted(
        bodies.values())
    assert await db.fetchval("SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL") == 0

    assert await dlq.main(s, args("replay", "--all")) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("replayed 0 ")


async def test_dry_run_sends_and_changes_nothing(
    db: asyncpg.Connection, database_url: str, queue_url: str, sqs_endpoint: str,
    sqs_client: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    a = await add_letter(db, "a-body", "invalid_json", "r-a")
    b = await add_letter(db, "b-body", "unknown_type", "r-b")
    s = make_settings(queue_url, database_url, sqs_endpoint)
    before = await db.fetch("SELECT * FROM dead_letters ORDER BY id")

    assert await dlq.main(s, args("replay", "--all", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert f"would replay id={a} " in out and f"would replay id={b} " in out
    assert "body=a-body" in out and "would replay 2" in out
    assert await dlq.main(s, args("replay", "--all", "--reason", "unknown_type",
                                  "--dry-run")) == 0
    out = capsys.readouterr().out
    assert f"id={a} " not in out and "would replay 1" in out
    assert await dlq.main(s, args("replay", "--id", str(a), "--dry-run")) == 0
    assert "would replay 1" in capsys.readouterr().out

    assert await db.fetch("SELECT * FROM dead_letters ORDER BY id") == before
    assert receive_all(sqs_client, queue_url, expect=0) == []


async def test_send_failure_rolls_back_one_and_keeps_sent_rows_of_a_batch(
    db: asyncpg.Connection,
) -> None:
    from botocore.exceptions import EndpointConnectionError

    ids = [await add_letter(db, f"b{i}") for i in range(3)]
    calls: list[int] = []

    async def fail_on_second(letter: Letter) -> str:
        calls.append(letter.id)
        if len(calls) == 2:
            raise EndpointConnectionError(endpoint_url="http://sqs.invalid")
        return "ok"

    with pytest.raises(SendFailed) as info:
        await dlq.replay_batch(db, fail_on_second, None, 10)
    # The first row did reach the queue: it is marked; the failed one and the rest are not.
    assert [x.id for x in info.value.replayed] == ids[:1]
    marked = await db.fetch("SELECT id FROM dead_letters WHERE replayed_at IS NOT NULL")
    assert [r["id"] for r in marked] == ids[:1]

    async def always_fail(letter: Letter) -> str:
        raise EndpointConnectionError(endpoint_url="http://sqs.invalid")

    with pytest.raises(SendFailed):
        await dlq.replay_one(db, ids[1], always_fail)
    assert await db.fetchval("SELECT replayed_at FROM dead_letters WHERE id=$1", ids[1]) is None
    with pytest.raises(NotFound):
        await dlq.replay_one(db, 424242, always_fail)


def test_cli_process_exit_codes(database_url: str, queue_url: str, sqs_endpoint: str) -> None:
    """The console entry point end to end: list, replay, replay again (exit 1)."""
    async def seed() -> int:
        conn = await asyncpg.connect(database_url)
        try:
            return await add_letter(conn, "cli-body", request_id="r-cli")
        finally:
            await conn.close()

    lid = asyncio.run(seed())
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           "INGEST_DATABASE_URL": database_url, "INGEST_QUEUE_URL": queue_url,
           "INGEST_SQS_ENDPOINT_URL": sqs_endpoint}

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "service", "dlq", *argv], env=env,
                              capture_output=True, text=True, timeout=60)

    ls = cli("list", "--format", "json")
    assert ls.returncode == 0, ls.stderr
    assert [x["body"] for x in json.loads(ls.stdout)] == ["cli-body"]
    first = cli("replay", "--id", str(lid))
    assert first.returncode == 0, first.stderr
    again = cli("replay", "--id", str(lid))
    assert again.returncode == 1
    assert "already replayed" in again.stderr


# -- the race (seed 002): two sessions, one row ------------------------------------------------

@pytest.mark.parametrize("impl", [
    pytest.param(dlq.replay_one, id="locked"),
    pytest.param(racy_replay_one, id="racy-without-for-update",
                 marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                         reason="proves the test catches the race")),
])
async def test_two_sessions_replaying_one_row_send_once(
    impl: Impl, database_url: str, db: asyncpg.Connection,
) -> None:
    lid = await add_letter(db, "race-body", request_id="r-race")
    a, b = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        send_a, send_b = Sends(block=True), Sends()
        task_a = asyncio.create_task(impl(a, lid, send_a))
        # A has selected (and, if correct, locked) the row and is inside send().
        await asyncio.wait_for(send_a.entered.wait(), 10)
        task_b = asyncio.create_task(impl(b, lid, send_b))
        b_blocked = await wait_for_lock_wait(db, b.get_server_pid(), task_b)
        send_a.release.set()
        res_a, res_b = await asyncio.wait_for(
            asyncio.gather(task_a, task_b, return_exceptions=True), 10)

        assert send_a.calls + send_b.calls == [lid], "the dead letter was sent more than once"
        assert b_blocked, "session B did not wait for A's row lock"
        assert isinstance(res_a, Letter) and res_a.id == lid
        assert isinstance(res_b, AlreadyReplayed), res_b
        assert "already replayed" in str(res_b)
        assert await db.fetchval(
            "SELECT replayed_at IS NOT NULL FROM dead_letters WHERE id = $1", lid)
    finally:
        await a.close()
        await b.close()


async def test_second_session_sends_when_the_first_rolls_back(
    database_url: str, db: asyncpg.Connection,
) -> None:
    """The lock must not lose the row: if A's send fails, B (waiting) replays it."""
    from botocore.exceptions import EndpointConnectionError

    lid = await add_letter(db, "rb-body")
    a, b = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        entered, fail = asyncio.Event(), asyncio.Event()

        async def send_a(letter: Letter) -> str:
            entered.set()
            await fail.wait()
            raise EndpointConnectionError(endpoint_url="http://sqs.invalid")

        send_b = Sends()
        task_a = asyncio.create_task(dlq.replay_one(a, lid, send_a))
        await asyncio.wait_for(entered.wait(), 10)
        task_b = asyncio.create_task(dlq.replay_one(b, lid, send_b))
        assert await wait_for_lock_wait(db, b.get_server_pid(), task_b)
        fail.set()
        with pytest.raises(SendFailed):
            await asyncio.wait_for(task_a, 10)
        assert (await asyncio.wait_for(task_b, 10)).id == lid
        assert send_b.calls == [lid]
    finally:
        await a.close()
        await b.close()


async def _drain(batch: BatchImpl, conn: asyncpg.Connection, send: dlq.Send,
                 size: int) -> list[Letter]:
    done: list[Letter] = []
    while rows := await batch(conn, send, None, size):
        done.extend(rows)
    return done


@pytest.mark.parametrize("batch", [
    pytest.param(dlq.replay_batch, id="skip-locked"),
    pytest.param(racy_replay_batch, id="racy-without-for-update",
                 marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                         reason="proves the test catches the race")),
])
async def test_concurrent_replay_all_sends_each_row_once(
    batch: BatchImpl, database_url: str, db: asyncpg.Connection,
) -> None:
    ids = [await add_letter(db, f"all-{i}") for i in range(7)]
    a, b = await asyncpg.connect(database_url), await asyncpg.connect(database_url)
    try:
        send_a, send_b = Sends(block=True), Sends()
        # A takes a batch of 3 and stalls inside the first send, holding its row locks.
        task_a = asyncio.create_task(batch(a, send_a, None, 3))
        await asyncio.wait_for(send_a.entered.wait(), 10)
        # B runs a whole --all to completion meanwhile: SKIP LOCKED means it neither waits
        # for A nor takes A's rows.
        done_b = await asyncio.wait_for(_drain(batch, b, send_b, 2), 10)
        send_a.release.set()
        done_a = await asyncio.wait_for(task_a, 10)

        all_sends = send_a.calls + send_b.calls
        assert sorted(all_sends) == ids, f"sends {sorted(all_sends)} != each row once"
        assert [x.id for x in done_a] == ids[:3]
        assert [x.id for x in done_b] == ids[3:]
        assert await db.fetchval(
            "SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL") == 0
    finally:
        await a.close()
        await b.close()


async def test_replay_all_is_bounded_to_rows_present_at_start(
    db: asyncpg.Connection, database_url: str,
) -> None:
    """A replayed poison that comes back as a new dead letter is not replayed again in the
    same run (the daemon re-dead-letters it under a new SQS message id)."""
    await add_letter(db, "p0")
    await add_letter(db, "p1")
    sent: list[str] = []

    async def send_and_redeadletter(letter: Letter) -> str:
        sent.append(letter.body)
        # Another connection stands in for the daemon storing it again.
        conn = await asyncpg.connect(database_url)
        try:
            await add_letter(conn, letter.body + "'")
        finally:
            await conn.close()
        return "ok"

    done = await asyncio.wait_for(dlq.replay_all(db, send_and_redeadletter, batch_size=1), 10)
    assert sent == ["p0", "p1"] and len(done) == 2
    assert await db.fetchval("SELECT count(*) FROM dead_letters WHERE replayed_at IS NULL") == 2


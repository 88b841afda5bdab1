"""Retention against a real PostgreSQL (and moto for the queue side): what goes, what stays,
what a concurrent claim or a second pruner sees, the refusal of a retention SQS could
outlive, and `dlq replay` of a letter whose request is past the retention."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from service.adapters.prune import PRUNE_LOCK_KEY, STEPS, TABLES, delete_batch, prune_once
from service.adapters.store import Q, Store, create_pool
from service.core.messages import Message, Received, payload_hash
from service.observe import metrics
from service.settings import Settings
from tests.integration.conftest import eventually, make_settings, running_worker

REPO = Path(__file__).resolve().parents[2]
MODS = next(s for s in STEPS if s.table == "modifications")


def settings(dsn: str, **over: Any) -> Settings:
    return Settings(queue_url="http://127.0.0.1:1/q", database_url=dsn, **over)


def msg(rid: str, version: int = 1, mid: str | None = None) -> Message:
    from service.handlers.entities import EntityUpsert

    payload = {"entity_id": "e-" + rid, "version": version, "data": {"v": version}}
    raw = Received(mid or f"m-{rid}-{uuid.uuid4().hex[:6]}", "rh", "{}", 1, None, None)
    return Message(raw, rid, "entity.upsert", EntityUpsert.model_validate(payload), payload,
                   payload_hash(payload))


async def done(m: Message, conn: asyncpg.Connection) -> dict[str, bool]:
    return {"ok": True}


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_url, 4)
    yield p
    await p.close()


async def completed(db: asyncpg.Connection, n: int, days_ago: float, prefix: str = "old") -> None:
    """``n`` COMPLETED rows, ``days_ago`` old (inserted as the claim would leave them)."""
    await db.execute(
        "INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,"
        " sqs_message_id, owner, received_at, completed_at)"
        " SELECT $1 || '-' || i, 'entity.upsert',"
        "        jsonb_build_object('entity_id', $1 || '-e' || (i % 7), 'version', i,"
        "                           'data', jsonb_build_object('i', i)),"
        "        md5(i::text), 'COMPLETED', 'm-' || $1 || '-' || i, 'w',"
        "        now() - make_interval(secs => $3), now() - make_interval(secs => $3)"
        "   FROM generate_series(1, $2) AS i", prefix, n, days_ago * 86400)


async def refusals(db: asyncpg.Connection, n: int, days_ago: float, prefix: str,
                   first_days_ago: float | None = None) -> None:
    """``n`` payload_refusals rows ``s3://b/<prefix>-<i>``, last refused ``days_ago`` (first
    refused ``first_days_ago``, by default then too), as note_refusals leaves them."""
    await db.execute(
        "INSERT INTO payload_refusals (pointer, first_refused_at, last_refused_at, refusals,"
        " last_error)"
        " SELECT 's3://b/' || $1 || '-' || i, now() - make_interval(secs => $4),"
        "        now() - make_interval(secs => $3) - make_interval(secs => i), 3, 'AccessDenied'"
        "   FROM generate_series(1, $2) AS i",
        prefix, n, days_ago * 86400, (first_days_ago or days_ago) * 86400 + n)


def value(table: str) -> float:
    v = metrics.REGISTRY.get_sample_value("sqs_ingest_pruned_rows_total", {"table": table})
    return v or 0.0


async def test_duplicate_inside_the_window_is_still_a_duplicate_after_prune(
    pool: asyncpg.Pool, db: asyncpg.Connection, database_url: str,
) -> None:
    store = Store(pool, "w-a")
    await store.register_worker("w-a")
    old, young = msg("r-old"), msg("r-young")
    assert all(c.claimed for c in (await store.claim([old, young])).values())
    assert len((await store.apply([old, young], done)).completed) == 2
    await db.execute("UPDATE modifications SET completed_at = now() - interval '31 days'"
                     " WHERE request_id = 'r-old'")
    await db.execute("UPDATE modifications SET completed_at = now() - interval '29 days'"
                     " WHERE request_id = 'r-young'")

    counts = await prune_once(database_url, settings(database_url, retention_days=30))

    assert counts is not None and counts["modifications"] == 1
    again = await store.claim([msg("r-young"), msg("r-old")])
    # Redelivered inside the window: the duplicate check still holds it.
    assert not again["r-young"].claimed and again["r-young"].status == "COMPLETED"
    # Past the window it is gone (the queue can no longer hold it: check_retention).
    assert again["r-old"].claimed


async def test_only_what_is_past_its_retention_goes(
    db: asyncpg.Connection, database_url: str,
) -> None:
    await completed(db, 12, 40, "old")
    await completed(db, 3, 20, "young")
    # An ancient claim still in progress (its worker is alive: GC's business, not ours).
    await db.execute(
        "INSERT INTO workers (worker_id, worker_name, hostname, pid, heartbeat_at) VALUES"
        " ('w-live', 'n', 'h', 1, now()),"
        " ('w-gone', 'n', 'h', 2, now() - interval '8 days'),"
        " ('w-holding', 'n', 'h', 3, now() - interval '8 days')")
    await db.execute(
        "INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,"
        " sqs_message_id, owner, received_at) VALUES"
        " ('ip-1', 'entity.upsert', '{}', 'x', 'IN_PROGRESS', 'm-ip1', 'w-live',"
        "  now() - interval '90 days'),"
        " ('ip-2', 'entity.upsert', '{}', 'x', 'IN_PROGRESS', 'm-ip2', 'w-holding',"
        "  now() - interval '90 days')")
    await db.execute(
        "INSERT INTO retry_attempts (request_id, failures, updated_at) VALUES"
        " ('old-1', 2, now() - interval '40 days'),"   # with its request
        " ('stale', 1, now() - interval '31 days'),"   # a message that stopped coming back
        " ('fresh', 1, now() - interval '1 day')")
    await db.execute(
        "INSERT INTO dead_letters (sqs_message_id, body, reason, received_at, replayed_at) VALUES"
        " ('d-unreplayed', 'x', 'invalid_json', now() - interval '400 days', NULL),"
        " ('d-replayed-old', 'x', 'invalid_json', now() - interval '60 days',"
        "  now() - interval '31 days'),"
        " ('d-replayed-young', 'x', 'invalid_json', now() - interval '60 days',"
        "  now() - interval '2 days')")
    await db.execute(
        "INSERT INTO reconciliation_runs (run_id, run_date, window_start, window_end, status,"
        " finished_at) VALUES"
        " (1, '2020-01-01', now(), now(), 'ok', now() - interval '91 days'),"
        " (2, '2020-01-02', now(), now(), 'ok', now() - interval '10 days')")
    await db.execute(
        "INSERT INTO reconciliation_discrepancies (run_id, kind)"
        " SELECT 1 + (i % 2), 'k' FROM generate_series(1, 9) AS i")  # 4 of run 1, 5 of run 2
    await db.execute(
        "INSERT INTO outbox (request_id, status, published_at) VALUES"
        " ('o1', 'COMPLETED', now() - interval '8 days'),"
        " ('o2', 'COMPLETED', now() - interval '1 day'),"
        " ('o3', 'COMPLETED', NULL)")
    await db.execute(
        "INSERT INTO payload_refusals (pointer, first_refused_at, last_refused_at) VALUES"
        " ('s3://b/old', now() - interval '40 days', now() - interval '31 days'),"
        " ('s3://b/young', now() - interval '40 days', now() - interval '1 day')")
    before = {t: value(t) for t in TABLES}
    s = settings(database_url, prune_batch_size=5)  # several batches of modifications

    assert await prune_once(database_url, s, dry_run=True) == {
        "modifications": 12, "retry_attempts": 2, "dead_letters": 1,
        "reconciliation_discrepancies": 4, "reconciliation_runs": 1, "workers": 1, "outbox": 1,
        "payload_refusals": 1}
    counts = await prune_once(database_url, s)

    assert counts == {
        "modifications": 12, "retry_attempts": 2, "dead_letters": 1,
        "reconciliation_discrepancies": 4, "reconciliation_runs": 1, "workers": 1, "outbox": 1,
        "payload_refusals": 1}
    assert {t: value(t) - before[t] for t in TABLES} == counts
    left = await db.fetch("SELECT request_id FROM modifications ORDER BY 1")
    assert [r[0] for r in left] == ["ip-1", "ip-2", "young-1", "young-2", "young-3"]
    assert [r[0] for r in await db.fetch("SELECT request_id FROM retry_attempts")] == ["fresh"]
    assert {r[0] for r in await db.fetch("SELECT sqs_message_id FROM dead_letters")} == {
        "d-unreplayed", "d-replayed-young"}
    assert await db.fetchval("SELECT array_agg(run_id) FROM reconciliation_runs") == [2]
    assert await db.fetchval("SELECT count(*) FROM reconciliation_discrepancies") == 5
    assert {r[0] for r in await db.fetch("SELECT worker_id FROM workers")} == {
        "w-live", "w-holding"}
    assert {r[0] for r in await db.fetch("SELECT request_id FROM outbox")} == {"o2", "o3"}
    assert [r[0] for r in await db.fetch("SELECT pointer FROM payload_refusals")] == [
        "s3://b/young"]
    # Nothing left to do: a second pass deletes nothing.
    assert set((await prune_once(database_url, s) or {}).values()) == {0}


@pytest.mark.parametrize("batch", [1, 1000])
async def test_entity_checkpoint_breaks_a_version_tie_by_what_was_applied(
    db: asyncpg.Connection, database_url: str, batch: int,
) -> None:
    """Two requests of one entity and version completed by one statement (same
    ``completed_at``): the handler applied the second id; the checkpoint keeps it, as the
    replay does (transforms.replay_entities)."""
    await db.execute(
        "INSERT INTO modifications (request_id, request_type, payload, payload_sha256,"
        " status, sqs_message_id, completed_at, result)"
        " SELECT r, 'entity.upsert', jsonb_build_object('entity_id', 't', 'version', 7,"
        "        'data', jsonb_build_object('r', r)),"
        " 'h', 'COMPLETED', 'm-' || r, now() - interval '50 days',"
        " jsonb_build_object('applied', r = 't-b')"
        " FROM unnest(ARRAY['t-a', 't-b']) AS r")
    await prune_once(database_url, settings(database_url, prune_batch_size=batch))
    assert await db.fetchval(
        "SELECT request_id FROM entity_checkpoints WHERE entity_id = 't'") == "t-b"


@pytest.mark.parametrize("batch", [1, 1000])
async def test_entity_checkpoint_keeps_the_winner_of_what_was_pruned(
    db: asyncpg.Connection, database_url: str, batch: int,
) -> None:
    """Per entity, the checkpoint is the winner of replay_entities' order over everything
    pruned so far, across batches and passes: highest version, then first completed."""
    rows = [  # request_id, version, days ago completed
        ("a1", 3, 50), ("a2", 5, 49), ("a3", 5, 45), ("a4", 4, 44),  # winner a2 (tie: first)
        ("b1", 1, 50), ("b2", 2, 10),  # b2 is young: only b1 is pruned
    ]
    for rid, version, days in rows:
        await db.execute(
            "INSERT INTO modifications (request_id, request_type, payload, payload_sha256,"
            " status, sqs_message_id, completed_at) VALUES ($1, 'entity.upsert',"
            " jsonb_build_object('entity_id', left($1, 1), 'version', $2::int,"
            "                    'data', jsonb_build_object('r', $1::text)),"
            " 'h', 'COMPLETED', 'm-' || $1, now() - make_interval(days => $3))",
            rid, version, days)
    # Batches of one: the winner is decided across transactions; one batch: inside it.
    await prune_once(database_url, settings(database_url, prune_batch_size=batch))
    cps = {r["entity_id"]: (r["request_id"], r["version"]) for r in await db.fetch(
        "SELECT entity_id, request_id, version FROM entity_checkpoints")}
    assert cps == {"a": ("a2", 5), "b": ("b1", 1)}
    md5 = await db.fetchval("SELECT data_md5 FROM entity_checkpoints WHERE entity_id = 'a'")
    assert md5 == await db.fetchval("SELECT md5(jsonb_build_object('r', 'a2')::text)")


async def test_each_batch_commits_on_its_own(
    db: asyncpg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A claim never waits for more than the batch in flight: when the second batch starts,
    the first one's deletes are already committed (seen from another session)."""
    from service.adapters import prune

    await completed(db, 9, 40, "old")
    seen: list[int] = []
    original = prune.delete_batch

    async def watched(conn: asyncpg.Connection, step: Any, s: Settings,
                      limit: int) -> dict[str, int]:
        if step.table == "modifications":
            seen.append(await db.fetchval("SELECT count(*) FROM modifications"))
        return await original(conn, step, s, limit)

    monkeypatch.setattr(prune, "delete_batch", watched)
    await prune_once(database_url, settings(database_url, prune_batch_size=4))
    assert seen == [9, 5, 1]


# -- two sessions: a batch held open, deterministically ------------------------------------


async def waiting_on_lock(db: asyncpg.Connection, pid: int) -> bool:
    return bool(await db.fetchval(
        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid))


async def test_claim_waits_at_most_for_the_batch_in_flight(
    pool: asyncpg.Pool, db: asyncpg.Connection, database_url: str,
) -> None:
    await completed(db, 10, 40, "old")
    s = settings(database_url)
    store = Store(pool, "w-a")
    await store.register_worker("w-a")
    pruner = await asyncpg.connect(database_url)
    try:
        tx = pruner.transaction()
        await tx.start()
        assert (await delete_batch(pruner, MODS, s, 1000))["modifications"] == 10
        # A claim of other requests does not wait for the batch at all.
        fresh = await asyncio.wait_for(store.claim([msg("new-1")]), 30)
        assert fresh["new-1"].claimed
        # A claim of a request the batch is deleting waits for that batch, and only it.
        task = asyncio.create_task(store.claim([msg("old-3")]))
        pids = await eventually(lambda: db.fetch(
            # The claim statement's opening (pg_stat_activity keeps its first 1 kB only).
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE 'WITH input AS%'"), "the claim waiting on the batch", 30)
        assert len(pids) == 1 and not task.done()
        await tx.commit()
        got = await asyncio.wait_for(task, 30)
        assert got["old-3"].claimed  # pruned: past the window, a new request
    finally:
        await pruner.close()


async def test_pruner_skips_rows_another_session_holds(
    db: asyncpg.Connection, database_url: str,
) -> None:
    await completed(db, 6, 40, "old")
    s = settings(database_url)
    holder = await asyncpg.connect(database_url)
    pruner = await asyncpg.connect(database_url)
    try:
        async with holder.transaction():
            await holder.execute(
                "SELECT 1 FROM modifications WHERE request_id = 'old-2' FOR UPDATE")
            await pruner.execute("SET lock_timeout = '2s'")  # a wait would be an error
            async with pruner.transaction():
                first = await delete_batch(pruner, MODS, s, 1000)
            assert first["modifications"] == 5
        async with pruner.transaction():
            assert (await delete_batch(pruner, MODS, s, 1000))["modifications"] == 1
    finally:
        await holder.close()
        await pruner.close()
    assert await db.fetchval("SELECT count(*) FROM modifications") == 0


async def test_two_pruners_never_delete_a_row_twice(
    db: asyncpg.Connection, database_url: str,
) -> None:
    await completed(db, 20, 40, "old")
    await db.execute("UPDATE modifications SET payload = payload || '{\"version\": 1}'")
    s = settings(database_url)
    a = await asyncpg.connect(database_url)
    b = await asyncpg.connect(database_url)

    async def batch_b() -> dict[str, int]:
        async with b.transaction():
            return await delete_batch(b, MODS, s, 1000)

    try:
        ta = a.transaction()
        await ta.start()
        got_a = await delete_batch(a, MODS, s, 8)  # A's batch in flight, uncommitted
        # B skips A's rows; the entity checkpoints both write are where it waits for A's
        # commit (then folds its winners into A's): a wait of one batch, not an error.
        task = asyncio.create_task(batch_b())
        b_pid = b.get_server_pid()
        await eventually(lambda: waiting_on_lock(db, b_pid), "B waiting for A's checkpoints")
        await ta.commit()
        got_b = await asyncio.wait_for(task, 10)
    finally:
        await a.close()
        await b.close()
    assert (got_a["modifications"], got_b["modifications"]) == (8, 12)
    assert await db.fetchval("SELECT count(*) FROM modifications") == 0
    # Each entity's checkpoint is the first completed among equal versions, across both.
    cps = await db.fetch("SELECT entity_id, request_id FROM entity_checkpoints ORDER BY 1")
    firsts = await db.fetch(
        "SELECT 'old-e' || (i % 7) AS e, min(i) AS i FROM generate_series(1, 20) i GROUP BY 1"
        " ORDER BY 1")
    assert [(r[0], r[1]) for r in cps] == [(r[0], f"old-{r[1]}") for r in firsts]


async def test_a_second_pruner_skips_the_pass(
    db: asyncpg.Connection, database_url: str,
) -> None:
    await completed(db, 5, 40, "old")
    other = await asyncpg.connect(database_url)
    try:
        assert await other.fetchval("SELECT pg_try_advisory_lock($1)", PRUNE_LOCK_KEY)
        assert await prune_once(database_url, settings(database_url)) is None
        assert await db.fetchval("SELECT count(*) FROM modifications") == 5
    finally:
        await other.close()  # the lock goes with the session
    assert (await prune_once(database_url, settings(database_url)) or {})["modifications"] == 5


async def test_the_daemon_prunes_periodically(
    queue_url: str, sqs_endpoint: str, database_url: str, db: asyncpg.Connection,
) -> None:
    """The worker's own pass (INGEST_PRUNE_INTERVAL), its rows counted in the metric."""
    await completed(db, 7, 40, "old")
    await refusals(db, 3, 40, "old")
    before = {t: value(t) for t in ("modifications", "payload_refusals")}
    cfg = make_settings(queue_url, database_url, sqs_endpoint, prune_interval=0.5)
    async with running_worker(cfg):
        await eventually(lambda: db.fetchval(
            "SELECT (SELECT count(*) FROM modifications)"
            "     + (SELECT count(*) FROM payload_refusals) = 0"), "the daemon's prune pass", 20)
    assert {t: value(t) - n for t, n in before.items()} == {
        "modifications": 7, "payload_refusals": 3}


async def test_each_pass_of_the_daemon_checks_the_queue_s_retention_again(
    sqs_client: Any, sqs_endpoint: str, database_url: str, db: asyncpg.Connection,
) -> None:
    """The daemon started under a queue that keeps messages 4 days, with a 10-day retention.
    An operator raises the queue's retention to 14 days while it runs: SQS may now redeliver
    what a pass would delete, so the pass is refused (nothing deleted) — red when only the
    start checks — and runs again once the queue's retention is back below."""
    url = sqs_client.create_queue(QueueName="ret-" + uuid.uuid4().hex[:10],
                                  Attributes={"MessageRetentionPeriod": "345600"})["QueueUrl"]
    await completed(db, 3, 12, "old")
    # The loop's own first pass is 30 s or more away: the test drives the passes itself.
    cfg = make_settings(url, database_url, sqs_endpoint, prune_interval=3600,
                        retention_days=10, dead_letter_retention_days=10)
    async with running_worker(cfg) as (worker, _):
        sqs_client.set_queue_attributes(
            QueueUrl=url, Attributes={"MessageRetentionPeriod": "1209600"})
        assert await worker.maintenance.prune_pass() is None
        assert await db.fetchval("SELECT count(*) FROM modifications") == 3
        sqs_client.set_queue_attributes(
            QueueUrl=url, Attributes={"MessageRetentionPeriod": "345600"})
        assert (await worker.maintenance.prune_pass() or {})["modifications"] == 3
    assert await db.fetchval("SELECT count(*) FROM modifications") == 0


async def test_prune_once_over_a_pool_gives_the_lock_back(
    pool: asyncpg.Pool, db: asyncpg.Connection, database_url: str,
) -> None:
    """The API as a caller with its own pool uses it: the pooled connection returns without
    the session lock (else no pruner could run again until it closed)."""
    await completed(db, 3, 40, "old")
    assert (await prune_once(pool, settings(database_url)) or {})["modifications"] == 3
    assert await db.fetchval("SELECT pg_try_advisory_lock($1)", PRUNE_LOCK_KEY)
    await db.execute("SELECT pg_advisory_unlock($1)", PRUNE_LOCK_KEY)
    assert await prune_once(pool, settings(database_url), dry_run=True) == dict.fromkeys(
        TABLES, 0)


async def test_a_pass_over_a_pool_keeps_its_connection(
    database_url: str, db: asyncpg.Connection,
) -> None:
    """The lock is given back by its own statement: the pooled session goes on (ending it
    is only the way out when that statement cannot run, a pass cancelled mid-statement)."""
    await completed(db, 2, 40, "old")
    p = await create_pool(database_url, 1)
    try:
        pid = await p.fetchval("SELECT pg_backend_pid()")
        assert (await prune_once(p, settings(database_url)) or {})["modifications"] == 2
        assert await p.fetchval("SELECT pg_backend_pid()") == pid
        assert await db.fetchval("SELECT pg_try_advisory_lock($1)", PRUNE_LOCK_KEY)
        await db.execute("SELECT pg_advisory_unlock($1)", PRUNE_LOCK_KEY)
    finally:
        await p.close()


async def test_a_pass_pauses_between_full_batches_and_stops_when_told(
    database_url: str, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """INGEST_PRUNE_PAUSE seconds after each full batch; ``stop`` ends the pass between
    batches (what is left goes next pass). The pause is recorded instead of slept, and the
    first one sets ``stop``."""
    from types import SimpleNamespace

    from service.adapters import prune

    await completed(db, 5, 40, "old")
    stop = asyncio.Event()
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)
        stop.set()

    monkeypatch.setattr(prune, "asyncio", SimpleNamespace(sleep=pause))
    s = settings(database_url, prune_batch_size=2, prune_pause=0.25)
    counts = await prune_once(database_url, s, stop=stop)
    assert counts == {**dict.fromkeys(TABLES, 0), "modifications": 2}
    assert pauses == [0.25]
    assert await db.fetchval("SELECT count(*) FROM modifications") == 3
    # Without ``stop`` the pass runs to the end: batches of 2 and 1, one pause.
    pauses.clear()
    counts = await prune_once(database_url, s)
    assert (counts or {})["modifications"] == 3 and pauses == [0.25]


async def test_the_driver_s_errors_leave_a_pass_as_service_errors(
    database_url: str, db: asyncpg.Connection,
) -> None:
    """prune_once's contract: no database is DatabaseUnavailable, a failed statement
    DatabaseError, each with the driver's error as its cause."""
    import socket

    from service.errors import DatabaseError, DatabaseUnavailable

    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        nowhere = f"postgresql://u@127.0.0.1:{sock.getsockname()[1]}/d"
        with pytest.raises(DatabaseUnavailable) as down:
            await prune_once(nowhere, settings(nowhere))
    assert isinstance(down.value.__cause__, OSError)
    await db.execute("ALTER TABLE workers RENAME TO workers_gone")
    try:
        with pytest.raises(DatabaseError) as failed:
            await prune_once(database_url, settings(database_url))
        assert not isinstance(failed.value, DatabaseUnavailable)
        assert isinstance(failed.value.__cause__, asyncpg.UndefinedTableError)
    finally:
        await db.execute("ALTER TABLE workers_gone RENAME TO workers")


# -- payload_refusals: INGEST_RETENTION_DAYS after the last refusal -------------------------

REFUSALS = next(s for s in STEPS if s.table == "payload_refusals")


async def pointers(db: asyncpg.Connection) -> list[str]:
    return [r[0] for r in await db.fetch("SELECT pointer FROM payload_refusals ORDER BY 1")]


async def test_a_refusal_goes_the_retention_after_its_last_refusal(
    pool: asyncpg.Pool, db: asyncpg.Connection, database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counted from ``last_refused_at`` with INGEST_RETENTION_DAYS (30; the other retentions
    set apart: 7, 45, 90), in batches each committed on its own; a pointer refused again
    after its row went starts its clock again, one still refused keeps it."""
    from service.adapters import prune

    await refusals(db, 5, 31, "old")                         # not refused for 31 days: due
    await refusals(db, 1, 29, "young")                       # 29 days: kept
    await refusals(db, 1, 1, "lately", first_days_ago=60)    # refused since 60 days, still
    seen: list[int] = []
    original = prune.delete_batch

    async def watched(conn: asyncpg.Connection, step: Any, s: Settings,
                      limit: int) -> dict[str, int]:
        if step.table == "payload_refusals":  # what another session sees: batches committed
            seen.append(await db.fetchval("SELECT count(*) FROM payload_refusals"))
        return await original(conn, step, s, limit)

    monkeypatch.setattr(prune, "delete_batch", watched)
    s = settings(database_url, retention_days=30, dead_letter_retention_days=45,
                 worker_retention_days=7, results_retention_days=7, prune_batch_size=2)
    before = value("payload_refusals")

    assert (await prune_once(database_url, s, dry_run=True) or {})["payload_refusals"] == 5
    counts = await prune_once(database_url, s)

    assert counts is not None and counts["payload_refusals"] == 5
    assert value("payload_refusals") - before == 5
    assert seen == [7, 5, 3]  # batches of 2, 2, 1: the last one short, the step ends
    assert await pointers(db) == ["s3://b/lately-1", "s3://b/young-1"]
    # A pruned pointer refused again is a new refusal (its clock starts again); one that
    # stayed is still counted from its first refusal, 60 days ago.
    again = await Store(pool, "w-a").note_refusals({"s3://b/old-1": "AccessDenied",
                                                     "s3://b/lately-1": "AccessDenied"})
    assert again["s3://b/old-1"] < 60
    assert again["s3://b/lately-1"] > 59 * 86400


async def test_the_refusal_pruner_skips_a_pointer_being_refused(
    db: asyncpg.Connection, database_url: str,
) -> None:
    """A refusal in flight (note_refusals' upsert, uncommitted) holds its row: the batch
    skips it instead of waiting, and once committed the refusal keeps the row young."""
    await refusals(db, 4, 40, "old")
    s = settings(database_url)
    refuser = await asyncpg.connect(database_url)
    pruner = await asyncpg.connect(database_url)
    try:
        async with refuser.transaction():
            await refuser.fetch(Q["note_refusals"], ["s3://b/old-2"], ["AccessDenied"])
            await pruner.execute("SET lock_timeout = '2s'")  # a wait would be an error
            async with pruner.transaction():
                assert (await delete_batch(pruner, REFUSALS, s, 1000)) == {
                    "payload_refusals": 3}
        async with pruner.transaction():
            assert (await delete_batch(pruner, REFUSALS, s, 1000)) == {"payload_refusals": 0}
    finally:
        await refuser.close()
        await pruner.close()
    assert await pointers(db) == ["s3://b/old-2"]


async def test_a_refusal_waits_at_most_for_the_batch_in_flight(
    pool: asyncpg.Pool, db: asyncpg.Connection, database_url: str,
) -> None:
    """The other way round: a refusal of a pointer the batch in flight is deleting waits
    for that batch only, then records a new first refusal; other pointers do not wait."""
    await refusals(db, 3, 40, "old")
    store = Store(pool, "w-a")
    pruner = await asyncpg.connect(database_url)
    try:
        tx = pruner.transaction()
        await tx.start()
        assert await delete_batch(pruner, REFUSALS, settings(database_url), 1000) == {
            "payload_refusals": 3}
        other = await asyncio.wait_for(store.note_refusals({"s3://b/new": "AccessDenied"}), 30)
        assert other["s3://b/new"] < 60
        task = asyncio.create_task(store.note_refusals({"s3://b/old-3": "AccessDenied"}))
        await eventually(lambda: db.fetch(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%INSERT INTO payload_refusals%'"), "the refusal waiting", 30)
        assert not task.done()
        await tx.commit()
        got = await asyncio.wait_for(task, 30)
        assert got["s3://b/old-3"] < 60  # a new row: counted from now, not 40 days ago
    finally:
        await pruner.close()
    assert await pointers(db) == ["s3://b/new", "s3://b/old-3"]


# -- dlq replay of a letter whose request is past the retention ---------------------------


def body(rid: str, version: int) -> str:
    return json.dumps({"request_id": rid, "type": "entity.upsert",
                       "payload": {"entity_id": "e-" + rid, "version": version,
                                   "data": {"v": version}}})


async def test_the_dry_run_counts_what_the_pass_deletes_around_dead_letters(
    db: asyncpg.Connection, database_url: str,
) -> None:
    """``prune --dry-run`` answers what the pass would delete, also for requests a dead
    letter pins: unreplayed, or replayed less than INGEST_DEAD_LETTER_RETENTION_DAYS ago
    (30) — here 2 days, far beyond a pin counted in the wrong unit."""
    await completed(db, 4, 40, "old")  # old-1 … old-4, all past the 30-day retention
    await db.execute(
        "INSERT INTO dead_letters (sqs_message_id, body, reason, request_id, replayed_at)"
        " VALUES ('d1', 'x', 'idempotency_key_reused', 'old-1', NULL),"
        "        ('d2', 'x', 'idempotency_key_reused', 'old-2', now() - interval '2 days'),"
        "        ('d3', 'x', 'idempotency_key_reused', 'old-3', now() - interval '31 days')")
    s = settings(database_url)

    dry = await prune_once(database_url, s, dry_run=True)
    assert dry is not None and dry["modifications"] == 2  # old-3 and old-4
    counts = await prune_once(database_url, s)
    assert counts is not None and counts["modifications"] == dry["modifications"]
    left = await db.fetch("SELECT request_id FROM modifications ORDER BY 1")
    assert [r[0] for r in left] == ["old-1", "old-2"]


async def test_replayed_letter_of_an_old_request_is_still_a_duplicate(
    sqs_client: Any, sqs_endpoint: str, queue_url: str, database_url: str,
    db: asyncpg.Connection,
) -> None:
    """A request reused with another payload was refused (idempotency_key_reused). Long
    after, its original is past the retention: pruned, a replay of the letter would apply
    the reused key. The letter pins its request instead — before the replay, and after it
    while the replayed copy may still be in the queue: the replay stays a refusal."""
    cfg = make_settings(queue_url, database_url, sqs_endpoint)
    sqs_client.send_message(QueueUrl=queue_url, MessageBody=body("r-x", 1))
    async with running_worker(cfg):
        await eventually(lambda: db.fetchval(
            "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'"), "r-x applied")
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=body("r-x", 2))
        await eventually(lambda: db.fetchval("SELECT count(*) FROM dead_letters"),
                         "the reused key refused")
    assert await db.fetchval("SELECT reason FROM dead_letters") == "idempotency_key_reused"
    await db.execute("UPDATE modifications SET completed_at = now() - interval '60 days'")

    counts = await prune_once(database_url, settings(database_url))
    assert counts is not None and counts["modifications"] == 0  # pinned by the letter

    env = {**os.environ, "INGEST_DATABASE_URL": database_url, "INGEST_QUEUE_URL": queue_url,
           "INGEST_SQS_ENDPOINT_URL": sqs_endpoint, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    res = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "service", "dlq", "replay", "--all"],
        env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    # A pass between the replay and the copy's delivery: the replayed letter still pins.
    counts = await prune_once(database_url, settings(database_url))
    assert counts is not None and counts["modifications"] == 0
    async with running_worker(cfg):
        await eventually(lambda: db.fetchval("SELECT count(*) FROM dead_letters"
                                             " WHERE replayed_at IS NULL"),
                         "the replayed copy refused again")
    entity = await db.fetchrow("SELECT version, data FROM entities WHERE entity_id = 'e-r-x'")
    assert entity["version"] == 1  # the reused payload never landed
    # Replayed (the new letter too) and past the dead-letter retention: all of it goes.
    await db.execute("UPDATE dead_letters SET replayed_at = now() - interval '31 days'")
    last = await prune_once(database_url, settings(database_url)) or {}
    assert (last["dead_letters"], last["modifications"]) == (2, 1)


# -- the safety rule, through the real CLI against moto ------------------------------------


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    return subprocess.run([sys.executable, "-m", "service", *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.fixture
def long_queue(sqs_client: Any) -> str:
    """A queue that keeps messages 14 days (SQS's maximum)."""
    return str(sqs_client.create_queue(
        QueueName="ret-" + uuid.uuid4().hex[:10],
        Attributes={"MessageRetentionPeriod": "1209600"})["QueueUrl"])


def cli_env(dsn: str, queue: str | None, endpoint: str, **extra: str) -> dict[str, str]:
    env = {"INGEST_DATABASE_URL": dsn, "INGEST_SQS_ENDPOINT_URL": endpoint,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "INGEST_HTTP_PORT": "0", **extra}
    if queue is not None:
        env["INGEST_QUEUE_URL"] = queue
    return env


async def test_prune_refuses_a_retention_the_queue_outlives(
    long_queue: str, sqs_endpoint: str, database_url: str, db: asyncpg.Connection,
) -> None:
    await completed(db, 3, 15, "old")
    res = await asyncio.to_thread(cli, ["prune"], cli_env(
        database_url, long_queue, sqs_endpoint, INGEST_RETENTION_DAYS="14"))
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "INGEST_RETENTION_DAYS=14" in lines[0]
    assert "MessageRetentionPeriod=1209600" in lines[0]
    assert await db.fetchval("SELECT count(*) FROM modifications") == 3  # nothing deleted

    res = await asyncio.to_thread(cli, ["prune", "--dry-run"], cli_env(
        database_url, long_queue, sqs_endpoint, INGEST_RETENTION_DAYS="14.5"))
    assert res.returncode == 0, res.stderr
    assert "modifications" in res.stdout and "would delete 3 row(s)" in res.stdout
    res = await asyncio.to_thread(cli, ["prune"], cli_env(
        database_url, long_queue, sqs_endpoint, INGEST_RETENTION_DAYS="14.5"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0].split() == ["modifications", "3"]
    assert await db.fetchval("SELECT count(*) FROM modifications") == 0


async def test_daemon_refuses_to_start_with_a_retention_the_queue_outlives(
    long_queue: str, sqs_endpoint: str, database_url: str,
) -> None:
    res = await asyncio.to_thread(cli, ["run"], cli_env(
        database_url, long_queue, sqs_endpoint, INGEST_DEAD_LETTER_RETENTION_DAYS="7"))
    assert res.returncode == 2, res.stdout + res.stderr
    line = [ln for ln in res.stderr.splitlines() if ln.startswith("sqs-ingest:")]
    assert len(line) == 1 and "INGEST_DEAD_LETTER_RETENTION_DAYS=7" in line[0]
    assert "MessageRetentionPeriod=1209600" in line[0]


async def test_prune_without_the_queue(
    sqs_endpoint: str, database_url: str, db: asyncpg.Connection,
) -> None:
    """The queue cannot be asked: above SQS's 14-day maximum the pass is safe whatever the
    queue says; at or below it nothing is deleted."""
    await completed(db, 2, 20, "old")
    res = await asyncio.to_thread(cli, ["prune"], cli_env(
        database_url, None, sqs_endpoint, INGEST_RETENTION_DAYS="10"))
    assert res.returncode == 1 and "cannot read the queue" in res.stderr, res.stderr
    assert await db.fetchval("SELECT count(*) FROM modifications") == 2
    res = await asyncio.to_thread(cli, ["prune"], cli_env(
        database_url, None, sqs_endpoint, INGEST_RETENTION_DAYS="15"))
    assert res.returncode == 0, res.stderr
    assert await db.fetchval("SELECT count(*) FROM modifications") == 0

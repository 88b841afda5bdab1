from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from service.adapters import migrate as migrate_module
from service.adapters.migrate import (
    MigrationChanged,
    applied_checksums,
    check_schema,
    load_migrations,
    migrate,
    migrations_dir,
)
from tests.integration.conftest import eventually
from tests.servers import Postgres

#: What migrations/ holds, written out: a file that goes missing, is renamed or is not
#: picked up by the loader must change this list (not be taken from the loader itself).
EXPECTED = [(1, "core"), (2, "outbox"), (3, "attributes"), (4, "retention"),
            (5, "fifo_order"), (6, "payload_refusals"), (7, "dead_letter_group"), (8, "claim_token"),
            (9, "checkpoint_applied"), (10, "outbox_refused"),
            (11, "outbox_refused_idx")]


async def empty_db(pg: Postgres) -> str:
    name = "m_" + uuid.uuid4().hex[:10]
    conn = await asyncpg.connect(pg.dsn())
    await conn.execute(f"CREATE DATABASE {name}")
    await conn.close()
    return pg.dsn(name)


async def test_every_migration_applies_to_an_empty_database_once(pg_server: Postgres) -> None:
    dsn = await empty_db(pg_server)
    applied = await migrate(dsn)
    assert [(m.version, m.name) for m in applied] == EXPECTED
    assert await migrate(dsn) == []
    conn = await asyncpg.connect(dsn)
    try:
        tables = {r["tablename"] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        assert {"modifications", "dead_letters", "entities", "reconciliation_runs",
                "reconciliation_discrepancies", "workers", "ingest_schema_migrations",
                "outbox"} <= tables
        cols = {r["column_name"] for r in await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name='modifications'")}
        assert {"request_id", "request_type", "payload", "payload_sha256", "status",
                "sqs_message_id", "owner", "received_at", "completed_at", "result"} <= cols
    finally:
        await conn.close()


async def test_two_concurrent_migrations_apply_each_file_once(pg_server: Postgres) -> None:
    dsn = await empty_db(pg_server)
    a, b = await asyncio.gather(migrate(dsn), migrate(dsn))
    assert sorted((m.version, m.name) for m in a + b) == EXPECTED
    assert not (a and b)  # one did everything, the other found it done


async def test_run_refuses_a_schema_that_is_behind(pg_server: Postgres) -> None:
    dsn = await empty_db(pg_server)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env.update(INGEST_DATABASE_URL=dsn, INGEST_QUEUE_URL="http://127.0.0.1:9/q",
               INGEST_HTTP_PORT="0")
    proc = subprocess.run([sys.executable, "-m", "service", "run"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "sqs-ingest migrate" in proc.stdout + proc.stderr


def _sqs_ingest(command: str, dsn: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env.update(INGEST_DATABASE_URL=dsn, INGEST_QUEUE_URL="http://127.0.0.1:9/q",
               INGEST_HTTP_PORT="0")
    return subprocess.run([sys.executable, "-m", "service", command], env=env,
                          capture_output=True, text=True, timeout=60)


async def test_an_applied_migration_changed_since_is_refused(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit to an applied file would never reach the database: migrate and run refuse."""
    dsn = await empty_db(pg_server)
    await migrate(dsn)
    first = load_migrations()[0]
    # The same tree, with the first file edited after it was applied and a new one on top.
    edited = tmp_path / "migrations"
    shutil.copytree(migrations_dir(), edited)
    (edited / first.filename).write_text(first.sql + "\n-- edited after rollout\n")
    (edited / "999_later.sql").write_text("CREATE TABLE later_one (id int);\n")
    monkeypatch.setattr(migrate_module, "migrations_dir", lambda: edited)

    with pytest.raises(MigrationChanged, match=first.filename):
        await migrate(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        assert 999 not in await applied_checksums(conn)  # nothing applied on top of it
        with pytest.raises(MigrationChanged, match=first.filename):
            await check_schema(conn)
        # The same mismatch seen from a process running the shipped files.
        await conn.execute("UPDATE ingest_schema_migrations SET checksum = 'edited'"
                           " WHERE version = $1", first.version)
    finally:
        await conn.close()
    proc = _sqs_ingest("migrate", dsn)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and first.filename in proc.stderr
    proc = _sqs_ingest("run", dsn)
    assert proc.returncode == 1
    assert first.filename in proc.stdout + proc.stderr


async def test_indexes_built_concurrently_beforehand_are_taken_by_the_migration(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README "Indexes on a large table": an operator builds a migration's indexes online
    (CREATE INDEX CONCURRENTLY, same name) before `migrate`; the migration must then apply
    (IF NOT EXISTS), not fail on an index that already exists."""
    dsn = await empty_db(pg_server)
    older = tmp_path / "older"
    older.mkdir()
    for path in migrations_dir().glob("*.sql"):
        if int(path.name.split("_", 1)[0]) < 4:
            shutil.copy(path, older / path.name)
    monkeypatch.setattr(migrate_module, "migrations_dir", lambda: older)
    await migrate(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE INDEX CONCURRENTLY IF NOT EXISTS modifications_prune_idx"
                           " ON modifications (completed_at) WHERE status = 'COMPLETED'")
    finally:
        await conn.close()
    monkeypatch.undo()
    assert [m.version for m in await migrate(dsn)] == [v for v, _ in EXPECTED if v >= 4]


async def _migrated_before(dsn: str, version: int, monkeypatch: pytest.MonkeyPatch,
                           tmp_path: Path) -> None:
    """Apply the shipped migrations older than ``version`` (an earlier release's schema)."""
    older = tmp_path / f"before_{version}"
    older.mkdir()
    for path in migrations_dir().glob("*.sql"):
        if int(path.name.split("_", 1)[0]) < version:
            shutil.copy(path, older / path.name)
    with monkeypatch.context() as m:
        m.setattr(migrate_module, "migrations_dir", lambda: older)
        await migrate(dsn)


def _migrate_env(dsn: str, **over: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env.update(INGEST_DATABASE_URL=dsn, INGEST_HTTP_PORT="0", **over)
    return env


async def _waiting_for(conn: asyncpg.Connection, table: str, mode: str) -> bool:
    """Whether some session queues for ``mode`` on ``table`` (not granted yet)."""
    return bool(await conn.fetchval(
        "SELECT count(*) FROM pg_locks WHERE relation = to_regclass($1) AND mode = $2"
        " AND NOT granted", table, mode))


INSERT_CLAIM = ("INSERT INTO modifications (request_id, request_type, payload, payload_sha256,"
                " status, sqs_message_id, owner) VALUES ($1, 't', '{}', 'x', 'IN_PROGRESS',"
                " $1, 'w')")


async def test_a_migration_queued_behind_a_long_read_never_stalls_ingestion(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconcile read holds ACCESS SHARE on modifications; `migrate` of 005 needs ACCESS
    EXCLUSIVE. Claims (INSERTs) must not queue behind the waiting ALTER: it gives up its
    place after lock_timeout and tries again; once the read ends, the migration applies."""
    dsn = await empty_db(pg_server)
    await _migrated_before(dsn, 5, monkeypatch, tmp_path)
    reader, writer, watch = [await asyncpg.connect(dsn) for _ in range(3)]
    proc = None
    try:
        await reader.execute("BEGIN; SELECT count(*) FROM modifications")  # still open
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "migrate",
            # 1 s: each wait is long enough for the poll below to see it queued.
            env=_migrate_env(dsn, INGEST_MIGRATE_LOCK_TIMEOUT="1",
                             INGEST_MIGRATE_ATTEMPTS="1000"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        await eventually(lambda: _waiting_for(watch, "modifications", "AccessExclusiveLock"),
                         "migrate's ALTER queued behind the read")
        # Behind an ALTER that waits without lock_timeout this INSERT waits as long as the
        # read lasts (here: for ever); with it, at most one lock_timeout.
        await asyncio.wait_for(writer.execute(INSERT_CLAIM, "during-migrate"), 30)
        assert proc.returncode is None  # the read still holds it: migrate keeps trying
        await reader.execute("COMMIT")
        out, err = await asyncio.wait_for(proc.communicate(), 90)
        assert proc.returncode == 0, err.decode()
        assert b'"event":"migration_lock_timeout"' in err
        assert b"005_fifo_order" in out
        assert await applied_checksums(watch) == {m.version: m.checksum
                                                  for m in load_migrations()}
        assert await watch.fetchval("SELECT count(*) FROM modifications") == 1
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        for c in (reader, writer, watch):
            await c.close()


async def test_migrate_blocked_in_every_attempt_exits_1_with_one_line(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn = await empty_db(pg_server)
    await _migrated_before(dsn, 5, monkeypatch, tmp_path)
    reader = await asyncpg.connect(dsn)
    proc = None
    try:
        await reader.execute("BEGIN; SELECT count(*) FROM modifications")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "service", "migrate",
            env=_migrate_env(dsn, INGEST_MIGRATE_LOCK_TIMEOUT="0.05",
                             INGEST_MIGRATE_ATTEMPTS="2"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 1
        assert out == b""
        lines = [ln for ln in err.decode().splitlines() if not ln.startswith("{")]
        assert len(lines) == 1, lines
        assert lines[0].startswith("sqs-ingest: migrate failed: migration 005_fifo_order.sql")
        assert "lock_timeout 0.05 s in 2 attempt(s)" in lines[0]
        assert err.count(b'"event":"migration_lock_timeout"') == 1  # the one retry, logged
        await reader.execute("COMMIT")
        assert sorted(await applied_checksums(reader)) == [1, 2, 3, 4]
        assert not await reader.fetchval(  # rolled back: nothing of 005 is left
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_name = 'modifications' AND column_name = 'group_id'")
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        await reader.close()


CONCURRENT = """-- sqs-ingest: no-transaction
-- Built online; every statement re-runnable (a crash between two re-runs the file).
CREATE INDEX CONCURRENTLY IF NOT EXISTS modifications_test_type_idx
    ON modifications (request_type) WHERE request_type <> ';';
/* a second one; */ CREATE INDEX CONCURRENTLY IF NOT EXISTS modifications_test_sent_idx
    ON modifications (sent_at);
"""


def _with_extra(tmp_path: Path, name: str, sql: str) -> Path:
    tree = tmp_path / "with_extra"
    shutil.copytree(migrations_dir(), tree)
    (tree / name).write_text(sql)
    return tree


async def _valid_indexes(conn: asyncpg.Connection, like: str) -> dict[str, bool]:
    rows = await conn.fetch(
        "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE c.relname LIKE $1", like)
    return {r["relname"]: r["indisvalid"] for r in rows}


async def test_a_no_transaction_migration_builds_indexes_concurrently_and_is_checksummed(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn = await empty_db(pg_server)
    tree = _with_extra(tmp_path, "900_concurrent.sql", CONCURRENT)
    monkeypatch.setattr(migrate_module, "migrations_dir", lambda: tree)
    [extra] = [m for m in load_migrations() if m.version == 900]
    assert not extra.transactional
    applied = await migrate(dsn)
    assert [m.version for m in applied][-1] == 900
    assert await migrate(dsn) == []
    conn = await asyncpg.connect(dsn)
    try:
        assert (await applied_checksums(conn))[900] == extra.checksum
        assert await _valid_indexes(conn, "modifications_test_%") == {
            "modifications_test_type_idx": True, "modifications_test_sent_idx": True}
    finally:
        await conn.close()


async def test_a_concurrent_build_refused_its_lock_drops_its_invalid_index_and_retries(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CREATE INDEX CONCURRENTLY waits for an open writer of its table; at lock_timeout
    it fails and leaves an INVALID index, which `IF NOT EXISTS` would take as built."""
    from structlog.testing import capture_logs

    dsn = await empty_db(pg_server)
    await migrate(dsn)
    tree = _with_extra(tmp_path, "900_concurrent.sql", CONCURRENT)
    monkeypatch.setattr(migrate_module, "migrations_dir", lambda: tree)
    writer = await asyncpg.connect(dsn)
    task = None
    try:
        await writer.execute("BEGIN")
        await writer.execute(INSERT_CLAIM, "open-writer")
        with capture_logs() as logs:
            task = asyncio.create_task(migrate(dsn, lock_timeout=0.2, attempts=1000))

            async def retried() -> bool:
                assert not task.done(), task  # it cannot finish while the writer is open
                return any(e["event"] == "migration_lock_timeout" for e in logs)

            await eventually(retried, "a concurrent build refused its lock")
            await writer.execute("COMMIT")
            applied = await asyncio.wait_for(task, 120)
        assert [m.version for m in applied] == [900]
        assert await _valid_indexes(writer, "modifications_test_%") == {
            "modifications_test_type_idx": True, "modifications_test_sent_idx": True}
    finally:
        if task is not None and not task.done():
            task.cancel()
        await writer.close()

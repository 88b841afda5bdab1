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
from tests.servers import Postgres

#: What migrations/ holds, written out: a file that goes missing, is renamed or is not
#: picked up by the loader must change this list (not be taken from the loader itself).
EXPECTED = [(1, "core"), (2, "outbox"), (3, "attributes"), (4, "retention"),
            (5, "fifo_order"), (6, "payload_refusals")]


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

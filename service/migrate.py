"""Applies ``migrations/NNN_name.sql`` in order, under an advisory lock, and checks them.

Two processes migrating at once (an initContainer per replica) serialise on the lock;
the second finds every version recorded and applies nothing. Each applied file's
checksum is recorded and compared on every ``migrate`` and ``run``: a file edited after it
was applied would never be applied again, so the database would silently differ from what
the code expects — that is refused, naming the file.

No migration may stall ingestion behind it. Every statement runs under ``lock_timeout``:
an ALTER that waits for a lock (behind a long reconcile read, say) gives up its place in
PostgreSQL's lock queue after that long, instead of holding every claim queued behind
it, and the migration is rolled back and tried again after a backoff, a bounded number
of times. A file whose first line is ``-- sqs-ingest: no-transaction`` runs outside a
transaction, one statement at a time, for ``CREATE INDEX CONCURRENTLY``; an INVALID
index that a failed concurrent build left behind is dropped before the build is retried.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import asyncpg
import structlog

from service.errors import MigrationBlocked, MigrationChanged, SchemaBehind

__all__ = ["MigrationBlocked", "MigrationChanged", "SchemaBehind", "check_schema", "migrate"]

log = structlog.get_logger(__name__)

# Arbitrary but fixed: every sqs-ingest process contends for this one lock.
MIGRATION_LOCK_KEY = 0x5151_1E57
_NAME = re.compile(r"^(\d+)_([\w-]+)\.sql$")

#: The first line of a migration that must run outside a transaction.
NO_TRANSACTION = "-- sqs-ingest: no-transaction"
#: Defaults of INGEST_MIGRATE_LOCK_TIMEOUT and INGEST_MIGRATE_ATTEMPTS.
LOCK_TIMEOUT = 5.0
ATTEMPTS = 10
#: Longest pause between two attempts (they double from lock_timeout up to this).
MAX_BACKOFF = 30.0
#: A lock not granted within lock_timeout, or a deadlock PostgreSQL broke by cancelling
#: the migration: both mean "ingestion had the table", so the migration is tried again.
_RETRIED = (asyncpg.LockNotAvailableError, asyncpg.DeadlockDetectedError)

# One SQL token that may hide a ';': comments, strings, quoted names, dollar quotes.
_TOKEN = re.compile(
    r"--[^\n]*|/\*.*?\*/|'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|(\$[A-Za-z_]*\$).*?\1|;", re.S
)
_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)
_CONCURRENT_INDEX = re.compile(
    r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+(?:IF\s+NOT\s+EXISTS\s+)?"
    r"((?:\"[^\"]+\"|[\w$]+)(?:\.(?:\"[^\"]+\"|[\w$]+))?)\s+ON\b", re.I
)

VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS ingest_schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    checksum    text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def filename(self) -> str:
        return f"{self.version:03d}_{self.name}.sql"

    @property
    def transactional(self) -> bool:
        return self.sql.split("\n", 1)[0].strip() != NO_TRANSACTION


def statements(sql: str) -> list[str]:
    """The statements of ``sql`` (split at each ``;`` outside comments, strings, quoted
    names and dollar quotes), without those that are only comments."""
    out, start = [], 0
    for m in _TOKEN.finditer(sql):
        if m.group() == ";":
            out.append(sql[start:m.start()])
            start = m.end()
    out.append(sql[start:])
    return [s.strip() for s in out if _COMMENT.sub("", s).strip()]


def migrations_dir() -> Path:
    packaged = Path(__file__).parent / "migrations"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parent.parent / "migrations"


def load_migrations(directory: Path | None = None) -> list[Migration]:
    found = []
    for path in sorted((directory or migrations_dir()).glob("*.sql")):
        m = _NAME.match(path.name)
        if not m:
            raise ValueError(f"migration file name must be NNN_name.sql: {path.name}")
        found.append(Migration(int(m.group(1)), m.group(2), path.read_text()))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"duplicate migration versions in {versions}")
    return found


def latest_version() -> int:
    migs = load_migrations()
    return migs[-1].version if migs else 0


async def applied_checksums(conn: asyncpg.Connection) -> dict[int, str]:
    """Version → checksum of every migration recorded as applied."""
    exists = await conn.fetchval("SELECT to_regclass('ingest_schema_migrations') IS NOT NULL")
    if not exists:
        return {}
    rows = await conn.fetch("SELECT version, checksum FROM ingest_schema_migrations")
    return {r["version"]: r["checksum"] for r in rows}


def _check_unchanged(migrations: list[Migration], applied: dict[int, str]) -> None:
    """Raise MigrationChanged for the first applied migration whose file was edited since."""
    for mig in migrations:
        recorded = applied.get(mig.version)
        if recorded is not None and recorded != mig.checksum:
            raise MigrationChanged(mig)


async def migrate(
    dsn: str, lock_timeout: float = LOCK_TIMEOUT, attempts: int = ATTEMPTS
) -> list[Migration]:
    """Apply every pending migration; returns the ones this call applied.

    Raises ``MigrationBlocked`` when one did not get its locks in ``attempts`` tries of
    ``lock_timeout`` seconds each (the ones before it stay applied)."""
    conn = await asyncpg.connect(dsn)
    applied: list[Migration] = []
    try:
        # Waited for without a timeout: the advisory lock only queues migrate behind migrate.
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            await conn.execute("SELECT set_config('lock_timeout', $1, false)",
                               f"{max(1, round(lock_timeout * 1000))}ms")
            await conn.execute(VERSION_TABLE)
            done = await applied_checksums(conn)
            migrations = load_migrations()
            _check_unchanged(migrations, done)  # before applying anything on top of it
            for mig in migrations:
                if mig.version in done:
                    continue
                if mig.transactional:
                    await _retrying(mig, partial(_in_transaction, conn, mig), lock_timeout,
                                    attempts)
                else:
                    for stmt in statements(mig.sql):
                        await _retrying(mig, partial(_concurrently, conn, stmt), lock_timeout,
                                        attempts)
                    await _record(conn, mig)
                log.info("migration_applied", version=mig.version, name=mig.name)
                applied.append(mig)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    finally:
        await conn.close()
    return applied


async def _retrying(
    mig: Migration, step: Callable[[], Awaitable[None]], lock_timeout: float, attempts: int
) -> None:
    """``step`` until it is not refused a lock, at most ``attempts`` times, backing off."""
    for attempt in range(1, attempts + 1):
        try:
            await step()
            return
        except _RETRIED as exc:
            if attempt == attempts:
                raise MigrationBlocked(mig, attempts, lock_timeout, exc) from exc
            delay = min(MAX_BACKOFF, lock_timeout * 2 ** (attempt - 1))
            delay *= random.uniform(0.5, 1.0)  # two migrate Jobs retrying do not march in step
            log.warning("migration_lock_timeout", version=mig.version, name=mig.name,
                        attempt=attempt, attempts=attempts, retry_in=round(delay, 3),
                        error=str(exc))
            await asyncio.sleep(delay)


async def _in_transaction(conn: asyncpg.Connection, mig: Migration) -> None:
    async with conn.transaction():
        await conn.execute(mig.sql)
        await _record(conn, mig)


async def _record(conn: asyncpg.Connection, mig: Migration) -> None:
    await conn.execute(
        "INSERT INTO ingest_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
        mig.version, mig.name, mig.checksum,
    )


async def _concurrently(conn: asyncpg.Connection, stmt: str) -> None:
    """One statement of a no-transaction migration. A concurrent index build that fails
    (a lock timeout, a crash of an earlier migrate) leaves an INVALID index, which writes
    keep maintaining and ``IF NOT EXISTS`` would take as built: it is dropped first."""
    found = _CONCURRENT_INDEX.search(_COMMENT.sub("", stmt))
    index = found.group(1) if found else None
    if index is not None:
        await _drop_invalid(conn, index)
    try:
        await conn.execute(stmt)
    except asyncpg.PostgresError:
        if index is not None:
            try:
                await _drop_invalid(conn, index)
            except asyncpg.PostgresError as exc:  # left for the next attempt to drop
                log.warning("invalid_index_not_dropped", index=index, error=str(exc))
        raise


async def _drop_invalid(conn: asyncpg.Connection, index: str) -> None:
    invalid = await conn.fetchval(
        "SELECT i.indexrelid::regclass::text FROM pg_index i"
        " WHERE i.indexrelid = to_regclass($1) AND NOT i.indisvalid", index)
    if invalid is not None:
        log.warning("invalid_index_dropped", index=invalid)
        await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {invalid}")


async def check_schema(conn: asyncpg.Connection) -> None:
    """Raise SchemaBehind naming the command to run when migrations are pending, or
    MigrationChanged naming the file when an applied migration was edited since."""
    done = await applied_checksums(conn)
    migrations = load_migrations()
    _check_unchanged(migrations, done)
    missing = [m.version for m in migrations if m.version not in done]
    if missing:
        raise SchemaBehind(
            f"database schema is behind (missing migrations {missing}): "
            "run `sqs-ingest migrate` first"
        )

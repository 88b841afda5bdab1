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

Handler packages bring their own tables (SPEC §7 "handler migrations"): a distribution
declaring an entry point in the group ``sqs_ingest.migrations`` names a package whose
``migrations/`` folder holds ``NNN_name.sql``. They are applied after the core's, under the
same lock, lock_timeout and checksums, recorded per distribution in
``ingest_handler_migrations`` with the tables each file created (``sqs-ingest grants`` grants
those).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.metadata
import importlib.resources
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import asyncpg
import structlog

from service.errors import (
    ConfigError,
    HandlerMigrationChanged,
    MigrationBlocked,
    MigrationChanged,
    SchemaBehind,
)

__all__ = ["HandlerMigrationChanged", "MigrationBlocked", "MigrationChanged", "SchemaBehind",
           "check_schema", "migrate"]

log = structlog.get_logger(__name__)

# Arbitrary but fixed: every sqs-ingest process contends for this one lock.
MIGRATION_LOCK_KEY = 0x5151_1E57
_NAME = re.compile(r"^(\d+)_([\w-]+)\.sql$")

#: The first line of a migration that must run outside a transaction.
NO_TRANSACTION = "-- sqs-ingest: no-transaction"
#: Defaults of INGEST_MIGRATE_LOCK_TIMEOUT and INGEST_MIGRATE_ATTEMPTS.
LOCK_TIMEOUT = 5.0
ATTEMPTS = 10
#: Seconds between two tries of the migration lock while another migrate holds it.
LOCK_POLL = 0.2
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

#: The entry-point group of handler packages' migrations (SPEC §7).
ENTRY_POINT_GROUP = "sqs_ingest.migrations"

HANDLER_TABLE = """
CREATE TABLE IF NOT EXISTS ingest_handler_migrations (
    distribution    text NOT NULL,
    version         integer NOT NULL,
    name            text NOT NULL,
    checksum        text NOT NULL,
    created_tables  text[] NOT NULL DEFAULT '{}',
    applied_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (distribution, version)
)
"""

# Every ordinary and partitioned table outside the system schemas, schema-qualified.
_TABLES = """
SELECT format('%I.%I', n.nspname, c.relname) FROM pg_catalog.pg_class c
JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND n.nspname NOT IN ('pg_catalog', 'information_schema')
  AND n.nspname NOT LIKE 'pg\\_toast%' AND n.nspname NOT LIKE 'pg\\_temp\\_%'
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
    def label(self) -> str:
        return f"{self.version:03d}_{self.name}"

    @property
    def transactional(self) -> bool:
        return self.sql.split("\n", 1)[0].strip() != NO_TRANSACTION


@dataclass(frozen=True)
class HandlerMigration(Migration):
    """A migration of a handler package, recorded under its distribution's name."""

    distribution: str = ""

    @property
    def filename(self) -> str:
        return f"{self.distribution}: migrations/{super().filename}"

    @property
    def label(self) -> str:
        return f"{self.distribution}/{super().label}"


@dataclass(frozen=True)
class HandlerPackage:
    distribution: str
    migrations: list[HandlerMigration]


def handler_packages() -> list[HandlerPackage]:
    """Every installed distribution's ``sqs_ingest.migrations`` entry points, by name; a
    package that cannot be found or has no ``migrations/`` folder is bad configuration."""
    found: dict[str, list[HandlerMigration]] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else ep.name
        try:
            directory = Path(str(importlib.resources.files(ep.value) / "migrations"))
        except Exception as exc:  # the package's own import failed, or it is not installed
            raise ConfigError(f"handler package {dist}: entry point "
                              f"{ENTRY_POINT_GROUP} {ep.value!r} cannot be imported: "
                              f"{type(exc).__name__}: {exc}") from exc
        if not directory.is_dir():
            raise ConfigError(f"handler package {dist}: {ep.value!r} "
                              "has no migrations/ folder")
        try:
            migs = load_migrations(directory)
        except ValueError as exc:
            raise ConfigError(f"handler package {dist}: {exc}") from exc
        found.setdefault(dist, []).extend(
            HandlerMigration(m.version, m.name, m.sql, distribution=dist) for m in migs)
    return [HandlerPackage(d, sorted(m, key=lambda x: x.version))
            for d, m in sorted(found.items())]


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
    # service/adapters/migrate.py: the wheel carries them as service/migrations, a checkout
    # at the repository's root
    here = Path(__file__).resolve()
    packaged = here.parents[1] / "migrations"
    if packaged.is_dir():
        return packaged
    return here.parents[2] / "migrations"


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


async def handler_checksums(conn: asyncpg.Connection) -> dict[str, dict[int, str]]:
    """Distribution → version → checksum of every handler migration recorded as applied."""
    exists = await conn.fetchval("SELECT to_regclass('ingest_handler_migrations') IS NOT NULL")
    if not exists:
        return {}
    done: dict[str, dict[int, str]] = {}
    for r in await conn.fetch(
            "SELECT distribution, version, checksum FROM ingest_handler_migrations"):
        done.setdefault(r["distribution"], {})[r["version"]] = r["checksum"]
    return done


def _check_unchanged(migrations: list[Migration], applied: dict[int, str]) -> None:
    """Raise MigrationChanged for the first applied migration whose file was edited since."""
    for mig in migrations:
        recorded = applied.get(mig.version)
        if recorded is not None and recorded != mig.checksum:
            if isinstance(mig, HandlerMigration):
                raise HandlerMigrationChanged(mig)
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
        # Polled, not waited for inside a statement: a waiting statement holds a snapshot,
        # which the other migrate's CREATE INDEX CONCURRENTLY waits for — a deadlock
        # PostgreSQL broke by cancelling one of them (measured with migration 011).
        while True:
            if await conn.fetchval("SELECT pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY):
                break
            await asyncio.sleep(LOCK_POLL)
        try:
            await conn.execute("SELECT set_config('lock_timeout', $1, false)",
                               f"{max(1, round(lock_timeout * 1000))}ms")
            await conn.execute(VERSION_TABLE)
            done = await applied_checksums(conn)
            migrations = load_migrations()
            packages = handler_packages()
            _check_unchanged(migrations, done)  # before applying anything on top of it
            handlers_done: dict[str, dict[int, str]] = {}
            if packages:
                await conn.execute(HANDLER_TABLE)
                handlers_done = await handler_checksums(conn)
                for pkg in packages:
                    _check_unchanged(list(pkg.migrations),
                                     handlers_done.get(pkg.distribution, {}))
            pending: list[tuple[Migration, dict[int, str]]] = [(m, done) for m in migrations]
            for pkg in packages:  # after the core's: they may refer to its tables
                recorded = handlers_done.get(pkg.distribution, {})
                pending += [(m, recorded) for m in pkg.migrations]
            for mig, recorded in pending:
                if mig.version in recorded:
                    continue
                await _apply(conn, mig, lock_timeout, attempts)
                log.info("migration_applied", version=mig.version, name=mig.name,
                         **({"distribution": mig.distribution}
                            if isinstance(mig, HandlerMigration) else {}))
                applied.append(mig)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    finally:
        await conn.close()
    return applied


async def _apply(conn: asyncpg.Connection, mig: Migration, lock_timeout: float,
                 attempts: int) -> None:
    if mig.transactional:
        await _retrying(mig, partial(_in_transaction, conn, mig), lock_timeout, attempts)
        return
    before = await _table_names(conn)
    for stmt in statements(mig.sql):
        await _retrying(mig, partial(_concurrently, conn, stmt), lock_timeout, attempts)
    await _record(conn, mig, before)


async def _table_names(conn: asyncpg.Connection) -> set[str]:
    return {r[0] for r in await conn.fetch(_TABLES)}


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
        # Taken in the migration's transaction: the tables it created are exactly the new
        # names after it (a rename counts as created too, under its new name).
        before = await _table_names(conn) if isinstance(mig, HandlerMigration) else set()
        await conn.execute(mig.sql)
        await _record(conn, mig, before)


async def _record(conn: asyncpg.Connection, mig: Migration, before: set[str]) -> None:
    if isinstance(mig, HandlerMigration):
        created = sorted(await _table_names(conn) - before)
        await conn.execute(
            "INSERT INTO ingest_handler_migrations (distribution, version, name, checksum,"
            " created_tables) VALUES ($1, $2, $3, $4, $5)",
            mig.distribution, mig.version, mig.name, mig.checksum, created)
        return
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
    packages = installed_packages()
    if not packages:
        return
    handlers_done = await handler_checksums(conn)
    for pkg in packages:
        recorded = handlers_done.get(pkg.distribution, {})
        _check_unchanged(list(pkg.migrations), recorded)
        pending = [m.version for m in pkg.migrations if m.version not in recorded]
        if pending:
            raise SchemaBehind(
                f"database schema is behind (handler package {pkg.distribution} is missing "
                f"migrations {pending}): run `sqs-ingest migrate` first"
            )


@functools.cache
def installed_packages() -> tuple[HandlerPackage, ...]:
    """The handler packages, read once per process (/readyz asks on every probe)."""
    return tuple(handler_packages())

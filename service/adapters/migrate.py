"""Applies ``migrations/NNN_name.sql`` in order, under an advisory lock, and checks them.

Two processes migrating at once (an initContainer per replica) serialise on the lock;
the second finds every version recorded and applies nothing. Each applied file's
checksum is recorded and compared on every ``migrate`` and ``run``: a file edited after it
was applied would never be applied again, so the database would silently differ from what
the code expects — that is refused, naming the file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import structlog

from service.errors import MigrationChanged, SchemaBehind

__all__ = ["MigrationChanged", "SchemaBehind", "check_schema", "migrate"]

log = structlog.get_logger(__name__)

# Arbitrary but fixed: every sqs-ingest process contends for this one lock.
MIGRATION_LOCK_KEY = 0x5151_1E57
_NAME = re.compile(r"^(\d+)_([\w-]+)\.sql$")

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


def _check_unchanged(migrations: list[Migration], applied: dict[int, str]) -> None:
    """Raise MigrationChanged for the first applied migration whose file was edited since."""
    for mig in migrations:
        recorded = applied.get(mig.version)
        if recorded is not None and recorded != mig.checksum:
            raise MigrationChanged(mig)


async def migrate(dsn: str) -> list[Migration]:
    """Apply every pending migration; returns the ones this call applied."""
    conn = await asyncpg.connect(dsn)
    applied: list[Migration] = []
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            await conn.execute(VERSION_TABLE)
            done = await applied_checksums(conn)
            migrations = load_migrations()
            _check_unchanged(migrations, done)  # before applying anything on top of it
            for mig in migrations:
                if mig.version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(mig.sql)
                    await conn.execute(
                        "INSERT INTO ingest_schema_migrations (version, name, checksum)"
                        " VALUES ($1, $2, $3)",
                        mig.version,
                        mig.name,
                        mig.checksum,
                    )
                log.info("migration_applied", version=mig.version, name=mig.name)
                applied.append(mig)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
    finally:
        await conn.close()
    return applied


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

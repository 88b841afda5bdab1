"""Applies ``migrations/NNN_name.sql`` in order, under an advisory lock.

Two processes migrating at once (an initContainer per replica) serialise on the lock;
the second finds every version recorded and applies nothing.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import structlog

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


class SchemaBehind(Exception):
    """The database lacks migrations this code needs."""


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


async def applied_versions(conn: asyncpg.Connection) -> set[int]:
    exists = await conn.fetchval("SELECT to_regclass('ingest_schema_migrations') IS NOT NULL")
    if not exists:
        return set()
    return {r["version"] for r in await conn.fetch("SELECT version FROM ingest_schema_migrations")}


async def migrate(dsn: str) -> list[Migration]:
    """Apply every pending migration; returns the ones this call applied."""
    conn = await asyncpg.connect(dsn)
    applied: list[Migration] = []
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            await conn.execute(VERSION_TABLE)
            done = await applied_versions(conn)
            for mig in load_migrations():
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
    """Raise SchemaBehind naming the command to run when migrations are pending."""
    done = await applied_versions(conn)
    missing = [m.version for m in load_migrations() if m.version not in done]
    if missing:
        raise SchemaBehind(
            f"database schema is behind (missing migrations {missing}): "
            "run `sqs-ingest migrate` first"
        )

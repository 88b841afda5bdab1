"""``sqs-ingest grants --role ROLE [--apply]`` (SPEC §7 "grants"): the SQL that lets ROLE run
the daemon — the core tables' grants of ``sqs_ingest_app`` in deploy/sql/roles.sql (the same
list: tests/unit/test_grants.py compares them), and SELECT, INSERT, UPDATE, DELETE on every
table a handler package's migrations created (``ingest_handler_migrations.created_tables``),
with USAGE on those tables' own sequences (serial and identity columns)."""

from __future__ import annotations

import sys

import asyncpg

#: The daemon's privileges on the core tables: deploy/sql/roles.sql's sqs_ingest_app rows.
APP_GRANTS: tuple[tuple[str, str], ...] = (
    ("modifications", "SELECT, INSERT, UPDATE, DELETE"),
    ("retry_attempts", "SELECT, INSERT, UPDATE, DELETE"),
    ("dead_letters", "SELECT, INSERT, UPDATE, DELETE"),
    ("entities", "SELECT, INSERT, UPDATE"),
    ("entity_checkpoints", "SELECT, INSERT, UPDATE"),
    ("outbox", "SELECT, INSERT, UPDATE, DELETE"),
    ("workers", "SELECT, INSERT, UPDATE, DELETE"),
    ("payload_refusals", "SELECT, INSERT, UPDATE, DELETE"),
    ("reconciliation_runs", "SELECT"),
    ("reconciliation_discrepancies", "SELECT"),
    ("ingest_schema_migrations", "SELECT"),
    ("ingest_handler_migrations", "SELECT"),
)
#: What a handler may do in its own tables.
HANDLER_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"

_SEQUENCES = """
SELECT format('%I.%I', n.nspname, s.relname) FROM pg_catalog.pg_class s
JOIN pg_catalog.pg_namespace n ON n.oid = s.relnamespace
JOIN pg_catalog.pg_depend d ON d.objid = s.oid AND d.deptype IN ('a', 'i')
WHERE s.relkind = 'S' AND d.refobjid = $1::regclass ORDER BY 1
"""
# A recorded table that still exists, as a schema-qualified quoted name, and its schema.
_RESOLVE = """
SELECT format('%I.%I', n.nspname, c.relname), quote_ident(n.nspname)
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = to_regclass($1)
"""


async def statements(conn: asyncpg.Connection, role: str) -> list[str]:
    """The GRANT statements, for the tables that exist in the connected database."""
    who, database = await conn.fetchrow("SELECT quote_ident($1), quote_ident(current_database())",
                                        role)
    out = [f"GRANT CONNECT ON DATABASE {database} TO {who};",
           f"GRANT USAGE ON SCHEMA public TO {who};"]
    tables: list[tuple[str, str]] = [(f"public.{t}", privs) for t, privs in APP_GRANTS]
    if await conn.fetchval("SELECT to_regclass('ingest_handler_migrations') IS NOT NULL"):
        recorded = await conn.fetch(
            "SELECT DISTINCT unnest(created_tables) AS t FROM ingest_handler_migrations"
            " ORDER BY 1")
        tables += [(r["t"], HANDLER_PRIVILEGES) for r in recorded]
    schemas = {"public"}
    for name, privs in tables:
        row = await conn.fetchrow(_RESOLVE, name)
        if row is None:  # not created yet (an older schema), or dropped since
            continue
        qualified, schema = row
        if schema not in schemas:
            schemas.add(schema)
            out.append(f"GRANT USAGE ON SCHEMA {schema} TO {who};")
        out.append(f"GRANT {privs} ON TABLE {qualified} TO {who};")
        if "INSERT" in privs:
            out += [f"GRANT USAGE ON SEQUENCE {s[0]} TO {who};"
                    for s in await conn.fetch(_SEQUENCES, qualified)]
    return out


async def main(dsn: str, redacted: str, role: str, apply: bool) -> int:
    from service.secrets import safe

    try:
        conn = await asyncpg.connect(dsn)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        print(safe(f"sqs-ingest: grants cannot connect to {redacted}: "
                   f"{type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    try:
        sql = await statements(conn, role)
        if apply:
            async with conn.transaction():
                for stmt in sql:
                    await conn.execute(stmt)
    except asyncpg.PostgresError as exc:
        print(safe(f"sqs-ingest: grants failed: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    finally:
        await conn.close()
    print("\n".join(sql))
    return 0

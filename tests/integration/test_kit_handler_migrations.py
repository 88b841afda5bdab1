"""The test kit runs handler packages' migrations: an installed package's (entry points
``sqs_ingest.migrations``) land in the kit's template as ``sqs-ingest migrate`` applies them,
and ``handler_migrations`` reads a package that is importable but not installed."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import asyncpg
import pytest

from service.testing.kit import create_template, handler_migrations
from tests.handler_package import install, write_package
from tests.servers import Postgres


async def _tables(dsn: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r[0] for r in await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    finally:
        await conn.close()


async def test_the_template_holds_an_installed_handler_packages_tables(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    install(write_package(source), tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    name = "kit_" + uuid.uuid4().hex[:8]
    await create_template(pg_server, name)
    assert {"acme_orders", "modifications", "ingest_handler_migrations"} <= \
        await _tables(pg_server.dsn(name))
    conn = await asyncpg.connect(pg_server.dsn(name))
    try:
        assert await conn.fetchval("SELECT created_tables FROM ingest_handler_migrations"
                                   " WHERE distribution = 'acme-orders'") == ["public.acme_orders"]
    finally:
        await conn.close()


async def test_handler_migrations_reads_a_package_that_is_not_installed(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_package(tmp_path)  # importable from tmp_path, no dist-info: not installed
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "acme_orders", raising=False)  # another test's copy
    (tmp_path / "acme_orders" / "migrations" / "002_index.sql").write_text(
        "-- sqs-ingest: no-transaction\n"
        "CREATE INDEX CONCURRENTLY acme_orders_amount ON acme_orders (amount_cents);\n"
        "CREATE INDEX CONCURRENTLY acme_orders_request ON acme_orders (request_id);\n")
    sql = handler_migrations("acme_orders")
    assert len(sql) == 3 and "CREATE TABLE acme_orders" in sql[0]
    name = "kit_" + uuid.uuid4().hex[:8]
    await create_template(pg_server, name, sql)
    assert "acme_orders" in await _tables(pg_server.dsn(name))

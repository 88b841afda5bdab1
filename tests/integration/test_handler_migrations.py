"""Handler migrations and grants (SPEC §7), from outside: a handler package written in an
empty folder and installed next to the project, ``sqs-ingest migrate`` creating its table,
``sqs-ingest grants --role R --apply``, and the daemon running as R (a role created LOGIN
with no other privilege) writing the package's rows, each request COMPLETED once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from service.adapters.migrate import migrate
from tests.acceptance.harness import Daemon, daemon_env, send_all, wait_drained
from tests.handler_package import install, write_package
from tests.integration.test_migrate import empty_db
from tests.servers import Postgres, wait_until

REPO = Path(__file__).resolve().parents[2]


def sqs_ingest(site: Path, dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env.update(INGEST_DATABASE_URL=dsn, INGEST_QUEUE_URL="http://127.0.0.1:9/q",
               INGEST_HTTP_PORT="0", PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    return subprocess.run([sys.executable, "-m", "service", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def installed(tmp_path: Path) -> Path:
    source = tmp_path / "acme-orders"
    source.mkdir()
    assert not any(source.iterdir())  # an empty folder
    site = tmp_path / "site"
    install(write_package(source), site)
    return site


def order(rid: str, order_id: str, amount: int = 100) -> str:
    return json.dumps({"request_id": rid, "type": "acme.order",
                       "payload": {"order_id": order_id, "amount_cents": amount}})


async def test_a_handler_package_runs_under_a_role_given_only_its_grants(
    pg_server: Postgres, tmp_path: Path, queue_url: str, sqs_endpoint: str, sqs_client: Any,
) -> None:
    site = installed(tmp_path)
    owner_dsn = await empty_db(pg_server)  # the cluster's superuser stands for the owner
    role = "r_" + uuid.uuid4().hex[:8]
    admin = await asyncpg.connect(owner_dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
    finally:
        await admin.close()

    done = await asyncio.to_thread(sqs_ingest, site, owner_dsn, "migrate")
    assert done.returncode == 0, done.stderr
    assert "acme-orders/001_orders" in done.stdout
    again = await asyncio.to_thread(sqs_ingest, site, owner_dsn, "migrate")
    assert again.returncode == 0 and "applied 0 migration(s)" in again.stdout

    printed = await asyncio.to_thread(sqs_ingest, site, owner_dsn, "grants", "--role", role)
    assert printed.returncode == 0, printed.stderr
    assert f"ON TABLE public.acme_orders TO {role};" in printed.stdout
    assert f"GRANT USAGE ON SEQUENCE public.acme_orders_id_seq TO {role};" in printed.stdout
    check = await asyncpg.connect(owner_dsn)
    try:  # printing applied nothing
        assert not await check.fetchval(
            "SELECT has_table_privilege($1, 'acme_orders', 'INSERT')", role)
    finally:
        await check.close()
    applied = await asyncio.to_thread(sqs_ingest, site, owner_dsn, "grants", "--role", role,
                                      "--apply")
    assert applied.returncode == 0, applied.stderr

    dsn = f"postgresql://{role}@127.0.0.1:{pg_server.port}/{owner_dsn.rsplit('/', 1)[1]}"
    rid = uuid.uuid4().hex[:8]
    bodies = [order(f"{rid}-{i}", f"o-{i}", 100 + i) for i in range(12)]
    env = daemon_env(dsn, queue_url, sqs_endpoint,
                     PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    del env["INGEST_HANDLERS"]  # the package's entry point alone registers acme.order
    d = Daemon(env, tmp_path)
    try:
        d.start().wait_ready()
        send_all(sqs_client, queue_url, bodies)
        wait_drained(sqs_client, queue_url, [d])
        wait_until(lambda: d.metric("sqs_ingest_messages_processed_total") == 12, 30,
                   "12 processed")
        assert d.stop() == 0, d.logs()
    finally:
        if d.proc is not None and not d.exited():
            d.proc.kill()
            d.wait(10)

    conn = await asyncpg.connect(owner_dsn)
    try:
        rows = await conn.fetch("SELECT order_id, amount_cents, request_id FROM acme_orders"
                                " ORDER BY id")
        assert sorted((r["order_id"], r["amount_cents"], r["request_id"]) for r in rows) == \
            sorted((f"o-{i}", 100 + i, f"{rid}-{i}") for i in range(12))
        statuses = await conn.fetch(
            "SELECT request_id, status, count(*) AS n FROM modifications"
            " WHERE request_id LIKE $1 GROUP BY 1, 2", f"{rid}-%")
        assert sorted((r["request_id"], r["status"], r["n"]) for r in statuses) == \
            sorted((f"{rid}-{i}", "COMPLETED", 1) for i in range(12))
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
    finally:
        await conn.close()


async def test_migrate_records_each_file_and_the_tables_it_created(
    pg_server: Postgres, tmp_path: Path
) -> None:
    site = installed(tmp_path)
    dsn = await empty_db(pg_server)
    (site / "acme_orders" / "migrations" / "002_refunds.sql").write_text(
        "CREATE TABLE acme_refunds (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY);\n"
        "ALTER TABLE acme_orders ADD COLUMN note text;\n")
    done = await asyncio.to_thread(sqs_ingest, site, dsn, "migrate")
    assert done.returncode == 0, done.stderr
    # After the core's, in order.
    assert done.stdout.strip().endswith(
        "011_outbox_refused_idx, acme-orders/001_orders, acme-orders/002_refunds")
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT distribution, version, name, created_tables"
                                " FROM ingest_handler_migrations ORDER BY version")
        assert [tuple(r) for r in rows] == [
            ("acme-orders", 1, "orders", ["public.acme_orders"]),
            ("acme-orders", 2, "refunds", ["public.acme_refunds"]),
        ]
        # The core's own record is untouched by the package's files.
        assert await conn.fetchval("SELECT max(version) FROM ingest_schema_migrations") == 11
    finally:
        await conn.close()
    printed = await asyncio.to_thread(sqs_ingest, site, dsn, "grants", "--role", "someone")
    assert "GRANT USAGE ON SEQUENCE public.acme_refunds_id_seq TO someone;" in printed.stdout


async def test_two_concurrent_migrations_apply_each_handler_file_once(
    pg_server: Postgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two migrate Jobs at once serialise on the one advisory lock, handler files included."""
    install(write_package(_empty(tmp_path / "src")), tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    dsn = await empty_db(pg_server)
    a, b = await asyncio.gather(migrate(dsn), migrate(dsn))
    labels = sorted(m.label for m in a + b)
    assert labels.count("acme-orders/001_orders") == 1 and len(labels) == 12
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM ingest_handler_migrations") == 1
    finally:
        await conn.close()


def _empty(folder: Path) -> Path:
    folder.mkdir()
    return folder


async def test_a_changed_applied_handler_migration_exits_2_naming_package_and_file(
    pg_server: Postgres, tmp_path: Path
) -> None:
    site = installed(tmp_path)
    dsn = await empty_db(pg_server)
    assert (await asyncio.to_thread(sqs_ingest, site, dsn, "migrate")).returncode == 0
    applied = site / "acme_orders" / "migrations" / "001_orders.sql"
    applied.write_text(applied.read_text() + "\n-- edited after rollout\n")
    (site / "acme_orders" / "migrations" / "002_later.sql").write_text(
        "CREATE TABLE acme_later (id int);\n")
    done = await asyncio.to_thread(sqs_ingest, site, dsn, "migrate")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "acme-orders" in lines[0] and "001_orders.sql" in lines[0]
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('acme_later')") is None
    finally:
        await conn.close()
    run = await asyncio.to_thread(sqs_ingest, site, dsn, "run")
    assert run.returncode == 1
    assert "001_orders.sql" in run.stdout + run.stderr


async def test_run_refuses_a_handler_package_with_pending_migrations(
    pg_server: Postgres, tmp_path: Path
) -> None:
    site = installed(tmp_path)
    dsn = await empty_db(pg_server)
    # The core's migrations only: the package was installed after.
    assert (await asyncio.to_thread(sqs_ingest, tmp_path / "nothing", dsn, "migrate")
            ).returncode == 0
    run = await asyncio.to_thread(sqs_ingest, site, dsn, "run")
    assert run.returncode == 1, run.stderr
    out = run.stdout + run.stderr
    assert "acme-orders" in out and "sqs-ingest migrate" in out

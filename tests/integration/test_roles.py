"""deploy/sql/roles.sql on a throwaway cluster, applied the way its header says (psql +
PGOPTIONS passwords), then the documented deployment: migrate as ``sqs_ingest_owner``, run
the daemon and ``dlq`` as ``sqs_ingest_app`` with a password in the DSN.

The cluster's pg_hba is switched to scram-sha-256 for the two roles, so the password is
actually checked (initdb's ``-A trust`` would accept anything).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from service.adapters.migrate import migrate
from tests.acceptance.harness import Daemon, daemon_env, send_all, upsert, wait_drained
from tests.handler_package import install, write_package
from tests.servers import Postgres, _pg_bin, postgres_server, wait_until

REPO = Path(__file__).resolve().parents[2]
ROLES_SQL = REPO / "deploy/sql/roles.sql"
DB = "ingest"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Postgres, str, str]]:
    """A cluster with roles.sql applied, scram auth for the roles, the schema migrated as
    the owner, then roles.sql again (its grants are per table: the documented order).
    Another application's table sits in the same schema. Yields (cluster, owner password,
    app password); the reconcile role's password is RECONCILE_PW."""
    owner_pw = "own-" + uuid.uuid4().hex
    app_pw = "app-" + uuid.uuid4().hex
    with postgres_server() as pg:
        subprocess.run([_pg_bin("psql"), "-v", "ON_ERROR_STOP=1", "-q", "-d", pg.dsn(),
                        "-c", f"CREATE DATABASE {DB}"], check=True, capture_output=True)
        subprocess.run([_pg_bin("psql"), "-v", "ON_ERROR_STOP=1", "-q", "-d", pg.dsn(DB),
                        "-c", "CREATE TABLE other_app_orders (id int)"],
                       check=True, capture_output=True)
        # SCRAM verifiers (roles.sql refuses cleartext), made as its header says.
        env = {**os.environ, "PGOPTIONS": f"-c sqs_ingest.owner_password={verifier_of(owner_pw)} "
                                          f"-c sqs_ingest.app_password={verifier_of(app_pw)} "
                                          f"-c sqs_ingest.reconcile_password="
                                          f"{verifier_of(RECONCILE_PW)}"}

        def apply_roles() -> None:
            res = subprocess.run([_pg_bin("psql"), "-v", "ON_ERROR_STOP=1", "-q",
                                  "-d", pg.dsn(DB), "-f", str(ROLES_SQL)],
                                 env=env, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr

        for _ in range(2):  # the header promises it is idempotent
            apply_roles()
        hba = Path(pg.datadir) / "pg_hba.conf"
        scram = "".join(f"host all {r} 127.0.0.1/32 scram-sha-256\n"
                        for r in ("sqs_ingest_owner", "sqs_ingest_app", "sqs_ingest_reconcile"))
        # First match wins: the role lines go before initdb's "trust" lines.
        hba.write_text(scram + hba.read_text())
        subprocess.run([_pg_bin("psql"), "-q", "-d", pg.dsn(), "-c", "SELECT pg_reload_conf()"],
                       check=True, capture_output=True)
        asyncio.run(migrate(role_dsn(pg, "sqs_ingest_owner", owner_pw)))
        apply_roles()  # after the migrations: the per-table grants
        yield pg, owner_pw, app_pw


RECONCILE_PW = "rec-" + uuid.uuid4().hex
SCRAM_VERIFIER = REPO / "scripts" / "scram-verifier.py"


def verifier_of(password: str) -> str:
    out = subprocess.run([sys.executable, str(SCRAM_VERIFIER)], input=password,
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def role_dsn(pg: Postgres, role: str, password: str, db: str = DB) -> str:
    return f"postgresql://{role}:{password}@127.0.0.1:{pg.port}/{db}"


async def test_passwords_are_checked_and_tables_owned_by_owner(
    cluster: tuple[Postgres, str, str],
) -> None:
    pg, _, app_pw = cluster
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(role_dsn(pg, "sqs_ingest_app", "wrong-" + app_pw))
    conn = await asyncpg.connect(role_dsn(pg, "sqs_ingest_app", app_pw))
    try:
        owners = {r["tableowner"] for r in await conn.fetch(
            "SELECT tableowner FROM pg_tables WHERE schemaname = 'public'"
            " AND tablename <> 'other_app_orders'")}
        assert owners == {"sqs_ingest_owner"}
        assert await conn.fetchval("SELECT current_user") == "sqs_ingest_app"
    finally:
        await conn.close()


async def test_app_role_has_no_ddl(cluster: tuple[Postgres, str, str]) -> None:
    pg, _, app_pw = cluster
    conn = await asyncpg.connect(role_dsn(pg, "sqs_ingest_app", app_pw))
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE TABLE sneaky (id int)")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("CREATE TEMPORARY TABLE sneaky_tmp (id int)")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("ALTER TABLE dead_letters ADD COLUMN x int")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("DROP TABLE entities")
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("TRUNCATE modifications")
    finally:
        await conn.close()


async def test_daemon_and_dlq_run_as_app_role_without_leaking_the_password(
    cluster: tuple[Postgres, str, str], tmp_path: Path, queue_url: str, sqs_endpoint: str,
    sqs_client: Any,
) -> None:
    pg, _, app_pw = cluster
    dsn = role_dsn(pg, "sqs_ingest_app", app_pw)
    rid = uuid.uuid4().hex[:8]
    poison = f"poison {rid} not json"
    bodies = [upsert(f"{rid}-{i}", f"{rid}-e{i}", 1) for i in range(10)] + [poison]

    # The default pollers: "== 11" counts exactly, which holds because the tests' moto
    # locks each queue's receive (tests/moto_fifo.py; scripts/probes/moto_double_delivery.py).
    d = Daemon(daemon_env(dsn, queue_url, sqs_endpoint), tmp_path)
    try:
        d.start().wait_ready()
        send_all(sqs_client, queue_url, bodies)
        wait_drained(sqs_client, queue_url, [d])
        wait_until(lambda: d.metric("sqs_ingest_messages_processed_total") == 11, 20,
                   "11 processed")
        assert d.stop() == 0, d.logs()
    finally:
        if d.proc is not None and not d.exited():
            d.proc.kill()
            d.wait(10)

    conn = await asyncpg.connect(dsn)
    try:
        done = await conn.fetchval(
            "SELECT count(*) FROM modifications WHERE status = 'COMPLETED' AND request_id LIKE $1",
            f"{rid}-%")
        assert done == 10
        # Found by the run's id, then compared byte for byte (selecting by the body itself
        # could only ever return what it was asked for).
        stored = await conn.fetch(
            "SELECT body, reason FROM dead_letters WHERE strpos(body, $1) > 0", rid)
        assert [(r["body"], r["reason"]) for r in stored] == [(poison, "invalid_json")]
    finally:
        await conn.close()

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           "INGEST_DATABASE_URL": dsn, "INGEST_QUEUE_URL": queue_url,
           "INGEST_SQS_ENDPOINT_URL": sqs_endpoint}
    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "service", "dlq", *argv], env=env,
                              capture_output=True, text=True, timeout=60)

    ls = await asyncio.to_thread(cli, "list", "--format", "json")
    assert ls.returncode == 0, ls.stderr
    letters = [x for x in json.loads(ls.stdout) if x["body"] == poison]
    assert len(letters) == 1
    rp = await asyncio.to_thread(cli, "replay", "--id", str(letters[0]["id"]))
    assert rp.returncode == 0, rp.stderr

    logs = d.logs() + ls.stdout + ls.stderr + rp.stdout + rp.stderr
    assert "postgresql://sqs_ingest_app@" in d.logs(), "expected the redacted DSN in the start line"
    assert app_pw not in logs


@pytest.mark.parametrize("command", [["run"], ["migrate"], ["gc"], ["dlq", "list"]])
def test_password_never_in_error_output(
    cluster: tuple[Postgres, str, str], tmp_path: Path, queue_url: str, sqs_endpoint: str,
    command: list[str],
) -> None:
    """Failure paths print the DSN, not the password: a database that does not exist."""
    pg, _, app_pw = cluster
    dsn = role_dsn(pg, "sqs_ingest_app", app_pw, db="no_such_db")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           **daemon_env(dsn, queue_url, sqs_endpoint), "INGEST_HTTP_PORT": "0"}
    res = subprocess.run([sys.executable, "-m", "service", *command], env=env,
                         capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert app_pw not in out, out


async def test_results_publish_under_the_app_role(
    cluster: tuple[Postgres, str, str], tmp_path: Path, queue_url: str, sqs_endpoint: str,
    sqs_client: Any,
) -> None:
    """The outbox (migration 002) is written, claimed FOR UPDATE, marked and pruned by the
    app role: roles.sql's default privileges reach tables a later migration creates."""
    from service.adapters.store import Q

    pg, _, app_pw = cluster
    dsn = role_dsn(pg, "sqs_ingest_app", app_pw)
    rid = uuid.uuid4().hex[:8]
    dest = sqs_client.create_queue(QueueName=f"results-{rid}")["QueueUrl"]
    poison = json.dumps({"request_id": f"{rid}-bad", "type": "entity.upsert", "payload": {}})
    d = Daemon(daemon_env(dsn, queue_url, sqs_endpoint, INGEST_RESULTS_QUEUE_URL=dest),
               tmp_path, "results")
    try:
        d.start().wait_ready()
        send_all(sqs_client, queue_url,
                 [upsert(f"{rid}-{i}", f"{rid}-e{i}", 1) for i in range(5)] + [poison])
        wait_drained(sqs_client, queue_url, [d])
        wait_until(lambda: d.metric("sqs_ingest_results_published_total") == 6, 30,
                   "6 results published")
        assert d.stop() == 0, d.logs()
    finally:
        if d.proc is not None and not d.exited():
            d.proc.kill()
            d.wait(10)
    assert "permission denied" not in d.logs()
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE request_id LIKE $1 AND published_at IS NOT NULL",
            f"{rid}-%") == 6
        await conn.execute(Q["outbox_prune"], 0.0, 1000)  # retention's DELETE
        assert await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE request_id LIKE $1", f"{rid}-%") == 0
    finally:
        await conn.close()


async def test_prune_under_the_app_role(cluster: tuple[Postgres, str, str]) -> None:
    """Retention (migration 004) as the app role: deletes from every table, writes the entity
    checkpoints (INSERT … ON CONFLICT DO UPDATE) and takes its advisory lock — no DDL."""
    from service.adapters.prune import prune_once
    from service.settings import Settings

    pg, _, app_pw = cluster
    dsn = role_dsn(pg, "sqs_ingest_app", app_pw)
    rid = uuid.uuid4().hex[:8]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "INSERT INTO modifications (request_id, request_type, payload, payload_sha256,"
            " status, sqs_message_id, completed_at) VALUES ($1, 'entity.upsert',"
            " '{\"entity_id\": \"role-e\", \"version\": 1, \"data\": {}}', 'h', 'COMPLETED',"
            " $1, now() - interval '40 days')", f"{rid}-old")
        await conn.execute(
            "INSERT INTO dead_letters (sqs_message_id, body, reason, replayed_at)"
            " VALUES ($1, 'x', 'invalid_json', now() - interval '40 days')", f"{rid}-dl")
        counts = await prune_once(dsn, Settings(queue_url="http://127.0.0.1:1/q",
                                                database_url=dsn))
        assert counts is not None
        assert counts["modifications"] >= 1 and counts["dead_letters"] >= 1
        assert await conn.fetchval(
            "SELECT request_id FROM entity_checkpoints WHERE entity_id = 'role-e'") == f"{rid}-old"
    finally:
        await conn.close()


# -- least privilege, exactly: what each role may do on each table ---------------------------

PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")
RW = {"SELECT", "INSERT", "UPDATE", "DELETE"}
# Written independently of roles.sql: a grant widened there (or a blanket/default grant
# coming back) makes the comparison below fail.
EXPECTED = {
    "sqs_ingest_app": {
        "modifications": RW, "retry_attempts": RW, "dead_letters": RW, "outbox": RW,
        "workers": RW, "payload_refusals": RW, "entities": {"SELECT", "INSERT", "UPDATE"},
        "entity_checkpoints": {"SELECT", "INSERT", "UPDATE"},
        # The checker's evidence: the reconcile role alone writes (and prunes) it.
        "reconciliation_runs": {"SELECT"},
        "reconciliation_discrepancies": {"SELECT"},
        "ingest_schema_migrations": {"SELECT"},
    },
    "sqs_ingest_reconcile": {
        "modifications": {"SELECT"}, "entities": {"SELECT"}, "entity_checkpoints": {"SELECT"},
        "reconciliation_runs": {"SELECT", "INSERT", "DELETE"},
        "reconciliation_discrepancies": {"INSERT"},
    },
}


@pytest.mark.parametrize("role", sorted(EXPECTED))
async def test_each_role_holds_exactly_its_grants(cluster: tuple[Postgres, str, str],
                                                  role: str) -> None:
    pg, _, _ = cluster
    conn = await asyncpg.connect(pg.dsn(DB))  # superuser: asks about the role
    try:
        tables = [r["t"] for r in await conn.fetch(
            "SELECT tablename AS t FROM pg_tables WHERE schemaname = 'public' ORDER BY 1")]
        assert "other_app_orders" in tables and "modifications" in tables
        held = {}
        for t in tables:
            privs = {p for p in PRIVILEGES if await conn.fetchval(
                "SELECT has_table_privilege($1, $2, $3)", role, f"public.{t}", p)}
            if privs:
                held[t] = privs
        assert held == EXPECTED[role]
        # No default privileges hand the owner's next table to the role.
        assert await conn.fetchval(
            "SELECT count(*) FROM pg_default_acl d, aclexplode(d.defaclacl) a"
            " WHERE a.grantee = (SELECT oid FROM pg_roles WHERE rolname = $1)", role) == 0
        assert not await conn.fetchval(
            "SELECT has_schema_privilege($1, 'public', 'CREATE')", role)
    finally:
        await conn.close()


async def test_app_role_cannot_touch_migrations_or_other_tables(
    cluster: tuple[Postgres, str, str],
) -> None:
    pg, _, app_pw = cluster
    conn = await asyncpg.connect(role_dsn(pg, "sqs_ingest_app", app_pw))
    try:
        assert await conn.fetchval("SELECT count(*) FROM ingest_schema_migrations") >= 4
        for sql in ("INSERT INTO ingest_schema_migrations (version, name, checksum)"
                    " VALUES (999, 'x', 'x')",
                    "UPDATE ingest_schema_migrations SET checksum = 'x'",
                    "DELETE FROM ingest_schema_migrations",
                    "SELECT * FROM other_app_orders",
                    "INSERT INTO other_app_orders VALUES (1)",
                    "INSERT INTO reconciliation_runs (run_date, window_start, window_end, status,"
                    " counts, started_at, finished_at) VALUES (current_date, now(), now(),"
                    " 'clean', '{}', now(), now())",
                    "UPDATE reconciliation_runs SET status = 'clean'",
                    "DELETE FROM reconciliation_runs",
                    "UPDATE reconciliation_discrepancies SET kind = 'x'",
                    "DELETE FROM reconciliation_discrepancies",
                    "DELETE FROM entities"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    finally:
        await conn.close()


async def test_reconcile_role_reads_and_writes_only_its_results(
    cluster: tuple[Postgres, str, str],
) -> None:
    from datetime import UTC, date, datetime

    from service.reconcile import io

    pg, _, _ = cluster
    conn = await asyncpg.connect(role_dsn(pg, "sqs_ingest_reconcile", RECONCILE_PW))
    try:
        # What the job reads (Spark runs these through JDBC in read-only sessions)...
        for table in ("modifications", "entities", "entity_checkpoints"):
            await conn.fetch(f"SELECT * FROM {table} LIMIT 1")
        # ... and what it writes, through the job's own functions: twice for one date, so
        # the replace (DELETE of the previous run, discrepancies cascading) runs too.
        assert await io.try_lock(conn)
        now = datetime.now(UTC)
        for _ in range(2):
            run_id = await io.write_results(conn, io.RunRecord(
                run_date=date(2026, 1, 1), window_start=now, window_end=now, status="clean",
                counts={}, started_at=now, finished_at=now,
                discrepancies=[("missing_in_peer", "r-1", None, "peer1", "{}")]))
        assert await io.run_exists(conn, date(2026, 1, 1))
        await io.unlock(conn)
        assert run_id > 0
        for sql in ("INSERT INTO modifications (request_id, request_type, payload,"
                    " payload_sha256, status, sqs_message_id, owner) VALUES"
                    " ('x', 't', '{}', 'h', 'COMPLETED', 'm', 'o')",
                    "UPDATE entities SET version = 0",
                    "DELETE FROM modifications",
                    "SELECT * FROM dead_letters",
                    "SELECT * FROM outbox",
                    "SELECT * FROM other_app_orders",
                    "INSERT INTO ingest_schema_migrations (version, name, checksum)"
                    " VALUES (999, 'x', 'x')",
                    "CREATE TABLE sneaky (id int)"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    finally:
        await conn.close()


async def test_payload_refusals_under_the_app_role(cluster: tuple[Postgres, str, str]) -> None:
    """The first refusal of an S3 pointer (migration 006) is upserted by the app role with
    its grants from roles.sql: INSERT, then ON CONFLICT DO UPDATE that keeps
    first_refused_at."""
    from service.adapters.store import Store, create_pool

    pg, _, app_pw = cluster
    pool = await create_pool(role_dsn(pg, "sqs_ingest_app", app_pw), 2)
    uri = f"s3://payloads/{uuid.uuid4().hex}"
    try:
        store = Store(pool)
        first = await store.note_refusals({uri: "AccessDenied"})
        again = await store.note_refusals({uri: "AccessDenied again"})
        assert set(first) == set(again) == {uri}
        assert again[uri] > first[uri] >= 0  # counted from the first refusal, not reset
        async with pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT refusals, last_error FROM payload_refusals WHERE pointer = $1", uri)
        assert (row["refusals"], row["last_error"]) == (2, "AccessDenied again")
    finally:
        await pool.close()


async def test_payload_refusals_are_pruned_under_the_app_role(
    cluster: tuple[Postgres, str, str],
) -> None:
    """The pruner's refusals step (its DELETE ... FOR UPDATE SKIP LOCKED) as the app role:
    the pass completes (no permission error on its last step), a pointer not refused for
    INGEST_RETENTION_DAYS goes, one refused now stays."""
    from service.adapters.prune import prune_once
    from service.adapters.store import Store, create_pool
    from service.settings import Settings

    pg, _, app_pw = cluster
    dsn = role_dsn(pg, "sqs_ingest_app", app_pw)
    old, fresh = (f"s3://payloads/{uuid.uuid4().hex}" for _ in range(2))
    pool = await create_pool(dsn, 2)
    try:
        await Store(pool).note_refusals({old: "AccessDenied", fresh: "AccessDenied"})
        await pool.execute("UPDATE payload_refusals SET first_refused_at = now() - interval"
                           " '41 days', last_refused_at = now() - interval '40 days'"
                           " WHERE pointer = $1", old)
        counts = await prune_once(dsn, Settings(queue_url="http://127.0.0.1:1/q",
                                                database_url=dsn))
        assert counts is not None and counts["payload_refusals"] >= 1
        left = await pool.fetch("SELECT pointer FROM payload_refusals WHERE pointer = ANY($1)",
                                [old, fresh])
        assert [r[0] for r in left] == [fresh]
    finally:
        await pool.close()


async def test_grants_older_than_the_refusals_step_fail_the_pass_after_the_rest(
    cluster: tuple[Postgres, str, str],
) -> None:
    """A database whose grants predate the refusals step (roles.sql not run again after the
    upgrade: no DELETE on payload_refusals): the pass fails on that step, its last, so every
    other table was pruned first; the daemon logs it as ``prune_failed`` and goes on."""
    from service.adapters.prune import prune_once
    from service.errors import DatabaseError
    from service.settings import Settings

    pg, _, app_pw = cluster
    dsn = role_dsn(pg, "sqs_ingest_app", app_pw)
    rid = f"{uuid.uuid4().hex[:8]}-old"
    admin = await asyncpg.connect(pg.dsn(DB))
    try:
        await admin.execute(
            "INSERT INTO modifications (request_id, request_type, payload, payload_sha256,"
            " status, sqs_message_id, completed_at) VALUES ($1, 'x', '{}', 'h', 'COMPLETED',"
            " $1, now() - interval '40 days')", rid)
        await admin.execute("REVOKE DELETE ON payload_refusals FROM sqs_ingest_app")
        with pytest.raises(DatabaseError) as failed:
            await prune_once(dsn, Settings(queue_url="http://127.0.0.1:1/q", database_url=dsn))
        assert isinstance(failed.value.__cause__, asyncpg.InsufficientPrivilegeError)
        assert await admin.fetchval(
            "SELECT count(*) FROM modifications WHERE request_id = $1", rid) == 0
    finally:
        await admin.execute("GRANT DELETE ON payload_refusals TO sqs_ingest_app")
        await admin.close()


async def test_old_runs_are_pruned_by_the_reconcile_role_not_the_app(
    cluster: tuple[Postgres, str, str],
) -> None:
    """The app role's prune pass skips reconciliation_* (it may not write them) and still
    prunes the rest; the reconcile job deletes its runs past the retention itself."""
    from datetime import UTC, date, datetime, timedelta

    from service.adapters.prune import prune_once
    from service.reconcile import io
    from service.settings import Settings

    pg, _, app_pw = cluster
    rec = await asyncpg.connect(role_dsn(pg, "sqs_ingest_reconcile", RECONCILE_PW))
    try:
        old = datetime.now(UTC) - timedelta(days=200)
        await io.write_results(rec, io.RunRecord(
            run_date=date(2020, 2, 2), window_start=old, window_end=old, status="clean",
            counts={}, started_at=old, finished_at=old,
            discrepancies=[("missing_in_peer", "r-old", None, "peer1", "{}")]))
        dsn = role_dsn(pg, "sqs_ingest_app", app_pw)
        counts = await prune_once(dsn, Settings(queue_url="http://127.0.0.1:1/q",
                                                database_url=dsn))
        assert counts is not None and counts["reconciliation_runs"] == 0
        assert await io.run_exists(rec, date(2020, 2, 2))
        assert await io.prune_runs(rec, 90) >= 1
        assert not await io.run_exists(rec, date(2020, 2, 2))
        su = await asyncpg.connect(pg.dsn(DB))  # the reconcile role may not read them
        try:
            assert await su.fetchval("SELECT count(*) FROM reconciliation_discrepancies"
                                     " WHERE request_id = 'r-old'") == 0
        finally:
            await su.close()
    finally:
        await rec.close()


def test_roles_sql_refuses_a_cleartext_password(cluster: tuple[Postgres, str, str]) -> None:
    pg, _, _ = cluster
    cleartext = "clear-" + uuid.uuid4().hex
    res = subprocess.run([_pg_bin("psql"), "-v", "ON_ERROR_STOP=1", "-q", "-d", pg.dsn(DB),
                          "-f", str(ROLES_SQL)], capture_output=True, text=True,
                         env={**os.environ,
                              "PGOPTIONS": f"-c sqs_ingest.app_password={cleartext}"})
    assert res.returncode != 0 and "SCRAM-SHA-256 verifier" in res.stderr, res.stderr
    assert cleartext not in res.stderr + res.stdout


def test_the_migrate_job_gives_the_app_role_a_handler_packages_table(
    cluster: tuple[Postgres, str, str], tmp_path: Path,
) -> None:
    """deploy/k8s/migrate-job.yaml's steps, in its order, as ``sqs_ingest_owner`` on a fresh
    database (roles.sql applied) with a handler package installed: afterwards the daemon's
    role may write the package's table (without it ``run`` stops on ``db_privilege``)."""
    pg, owner_pw, _ = cluster
    db = "job_" + uuid.uuid4().hex[:8]
    for target, args in ((pg.dsn(), ["-c", f"CREATE DATABASE {db}"]),
                         (pg.dsn(db), ["-f", str(ROLES_SQL)])):
        res = subprocess.run([_pg_bin("psql"), "-v", "ON_ERROR_STOP=1", "-q", "-d", target,
                              *args], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
    site = tmp_path / "site"
    (tmp_path / "acme-orders").mkdir()
    install(write_package(tmp_path / "acme-orders"), site)
    (job,) = yaml.safe_load_all((REPO / "deploy/k8s/migrate-job.yaml").read_text())
    spec = job["spec"]["template"]["spec"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           "INGEST_DATABASE_URL": role_dsn(pg, "sqs_ingest_owner", owner_pw, db),
           "INGEST_QUEUE_URL": "http://127.0.0.1:9/q",
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    for step in spec.get("initContainers", []) + spec["containers"]:
        res = subprocess.run([sys.executable, "-m", "service", *step["args"]], env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, (step["name"], res.stdout, res.stderr)

    async def privileges() -> tuple[bool, bool]:
        conn = await asyncpg.connect(pg.dsn(db))
        try:
            row = await conn.fetchrow(
                "SELECT has_table_privilege('sqs_ingest_app', 'acme_orders', 'INSERT'),"
                " has_sequence_privilege('sqs_ingest_app', 'acme_orders_id_seq', 'USAGE')")
            return bool(row[0]), bool(row[1])
        finally:
            await conn.close()

    assert asyncio.run(privileges()) == (True, True)

"""The whole job against two real PostgreSQL databases, through ``cli.main``.

Rows are inserted in the shape the daemon writes them; the tampering below plants one
known discrepancy of each kind and the test expects exactly those, as literals.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from service.core.messages import payload_hash
from service.reconcile import io, job
from service.reconcile.cli import main
from service.reconcile.job import JobOptions, compared_buckets

pytestmark = pytest.mark.spark

RUN_DATE = "2024-05-01"
T0 = datetime(2024, 5, 1, 10, 0, tzinfo=UTC)
PASSWORD = "s3cret-pw"  # trust auth ignores it; it must never be printed


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


# (request_id, type, payload, received_at); all COMPLETED one second after receipt.
BASE_MODIFICATIONS: list[tuple[str, str, dict[str, Any], datetime]] = [
    # History outside the window still defines ent-05's state.
    (
        "u-05-1",
        "entity.upsert",
        {"entity_id": "ent-05", "version": 1, "data": {"n": 1}},
        datetime(2024, 4, 1, 9, 0, tzinfo=UTC),
    ),
    ("u-01-1", "entity.upsert", {"entity_id": "ent-01", "version": 1, "data": {"n": 1}}, at(0)),
    ("u-01-2", "entity.upsert", {"entity_id": "ent-01", "version": 2, "data": {"n": 2}}, at(1)),
    ("u-02-1", "entity.upsert", {"entity_id": "ent-02", "version": 1, "data": {"n": 1}}, at(2)),
    ("u-03-1", "entity.upsert", {"entity_id": "ent-03", "version": 1, "data": {"n": 1}}, at(3)),
    ("d-03-2", "entity.delete", {"entity_id": "ent-03", "version": 2}, at(4)),
    # A stale upsert: completed, but never applied.
    ("u-01-0", "entity.upsert", {"entity_id": "ent-01", "version": 0, "data": {"n": 0}}, at(5)),
    *[
        (f"inv-{i}", "invoice.created", {"invoice": i, "amount": 10 * i}, at(10 + i))
        for i in range(1, 6)
    ],
    ("req-status", "invoice.created", {"invoice": 99, "amount": 1}, at(20)),
]
# entity_id -> (version, deleted, data, request_id, updated_at)
BASE_ENTITIES = {
    "ent-01": (2, False, {"n": 2}, "u-01-2", at(1)),
    "ent-02": (1, False, {"n": 1}, "u-02-1", at(2)),
    "ent-03": (2, True, None, "d-03-2", at(4)),
    "ent-05": (1, False, {"n": 1}, "u-05-1", datetime(2024, 4, 1, 9, 0, 1, tzinfo=UTC)),
}

EXPECTED_TAMPERED = [
    ("stuck_in_progress", "req-stuck", None, "primary"),
    ("stuck_in_progress", "req-stuck", None, "peer1"),
    ("stuck_in_progress", "req-status", None, "peer1"),
    ("status_mismatch", "req-status", None, "peer1"),
    ("missing_in_peer", "inv-3", None, "peer1"),
    ("missing_in_primary", "only-peer", None, "peer1"),
    ("payload_mismatch", "inv-4", None, "peer1"),
    ("entity_drift", "u-01-2", "ent-01", "primary"),
    ("entity_drift", "u-02-1", "ent-02", "primary"),
    ("entity_drift", "ghost-req", "ghost", "primary"),
    ("entity_drift", "u-05-1", "ent-05", "peer1"),
]
EXPECTED_COUNTS = {
    "stuck_in_progress": 3,
    "missing_in_peer": 1,
    "missing_in_primary": 1,
    "status_mismatch": 1,
    "payload_mismatch": 1,
    "entity_drift": 4,
}


async def insert_modification(
    conn: asyncpg.Connection,
    request_id: str,
    rtype: str,
    payload: dict[str, Any],
    received_at: datetime,
    status: str = "COMPLETED",
) -> None:
    completed = received_at + timedelta(seconds=1) if status == "COMPLETED" else None
    await conn.execute(
        "INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,"
        " sqs_message_id, owner, received_at, completed_at, result)"
        " VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7, $8, $9, $10::jsonb)",
        request_id,
        rtype,
        json.dumps(payload),
        payload_hash(payload),
        status,
        f"msg-{request_id}",
        "worker-a",
        received_at,
        completed,
        None if completed is None else '{"applied": true}',
    )


async def seed(dsn: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for rid, rtype, payload, received in BASE_MODIFICATIONS:
            await insert_modification(conn, rid, rtype, payload, received)
        for entity_id, (version, deleted, data, rid, updated) in BASE_ENTITIES.items():
            await conn.execute(
                "INSERT INTO entities (entity_id, version, deleted, data, request_id, updated_at)"
                " VALUES ($1, $2, $3, $4::jsonb, $5, $6)",
                entity_id,
                version,
                deleted,
                None if data is None else json.dumps(data),
                rid,
                updated,
            )
    finally:
        await conn.close()


async def tamper(primary: str, peer: str) -> None:
    p = await asyncpg.connect(primary)
    q = await asyncpg.connect(peer)
    try:
        stuck = {"invoice": 42, "amount": 1}
        for conn in (p, q):
            await insert_modification(
                conn, "req-stuck", "invoice.created", stuck, at(120), "IN_PROGRESS"
            )
        await p.execute("UPDATE entities SET data = '{\"n\": 999}' WHERE entity_id = 'ent-01'")
        await p.execute("DELETE FROM entities WHERE entity_id = 'ent-02'")
        await p.execute(
            "INSERT INTO entities (entity_id, version, deleted, data, request_id, updated_at)"
            " VALUES ('ghost', 1, false, '{\"g\": 1}', 'ghost-req', $1)",
            at(121),
        )
        await q.execute(
            "UPDATE modifications SET status = 'IN_PROGRESS', completed_at = NULL, result = NULL"
            " WHERE request_id = 'req-status'"
        )
        await q.execute("DELETE FROM modifications WHERE request_id = 'inv-3'")
        await insert_modification(q, "only-peer", "invoice.created", {"invoice": 7}, at(30))
        forged = {"invoice": 4, "amount": 4000}
        await q.execute(
            "UPDATE modifications SET payload = $1::jsonb, payload_sha256 = $2"
            " WHERE request_id = 'inv-4'",
            json.dumps(forged),
            payload_hash(forged),
        )
        await q.execute("UPDATE entities SET version = 7 WHERE entity_id = 'ent-05'")
    finally:
        await p.close()
        await q.close()


def with_password(dsn: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(
        parts._replace(netloc=f"{parts.username}:{PASSWORD}@{parts.hostname}:{parts.port}")
    )


async def reconcile(primary: str, peer: str, *extra: str) -> int:
    argv = [
        "--date",
        RUN_DATE,
        "--database-url",
        with_password(primary),
        "--peer-url",
        with_password(peer),
        "--partitions",
        "3",
        # 2024's dates lie past any retention: these databases are never pruned.
        "--retention-days",
        "0",
        *extra,
    ]
    return await asyncio.to_thread(main, argv)


async def stored(dsn: str) -> tuple[list[Any], list[tuple[Any, ...]]]:
    conn = await asyncpg.connect(dsn)
    try:
        runs = await conn.fetch(
            "SELECT run_id, run_date, status, counts, window_start, window_end"
            " FROM reconciliation_runs ORDER BY run_id"
        )
        disc = await conn.fetch(
            "SELECT run_id, kind, request_id, entity_id, source, details"
            " FROM reconciliation_discrepancies"
        )
    finally:
        await conn.close()
    return list(runs), [tuple(r) for r in disc]


class _Pushgateway(BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def _record(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append((self.command, self.path, body))
        self.send_response(200)
        self.end_headers()

    do_PUT = do_POST = _record

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def pushgateway() -> Iterator[tuple[str, list[tuple[str, str, bytes]]]]:
    received: list[tuple[str, str, bytes]] = []
    handler = type("Handler", (_Pushgateway,), {"received": received})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


async def test_clean_databases_exit_zero(
    spark,
    database_url: str,
    peer_url: str,
    pushgateway,
    capfd,
) -> None:
    await seed(database_url)
    await seed(peer_url)
    gateway, pushes = pushgateway

    assert await reconcile(database_url, peer_url, "--pushgateway", gateway) == 0

    out, err = capfd.readouterr()
    assert PASSWORD not in out and PASSWORD not in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "clean"
    assert summary["counts"] == dict.fromkeys(EXPECTED_COUNTS, 0)
    assert summary["window_start"] == "2024-04-30T00:00:00+00:00"
    assert summary["window_end"] == "2024-05-02T00:00:00+00:00"
    # 12 of the 13 base rows were received in the window (u-05-1 is a month older).
    assert summary["modifications"] == {"primary": 12, "peer1": 12}
    assert summary["databases"]["primary"] == database_url  # the password left out

    runs, disc = await stored(database_url)
    assert [(r["run_date"], r["status"]) for r in runs] == [(date(2024, 5, 1), "clean")]
    assert disc == []
    # Results go to the primary only; the peer is only read.
    assert await stored(peer_url) == ([], [])

    [(method, path, body)] = pushes
    assert (method, path) == ("PUT", "/metrics/job/sqs_ingest_reconcile")
    assert b'sqs_ingest_reconcile_runs_total{outcome="clean"} 1.0' in body


@pytest.fixture
async def tampered(database_url: str, peer_url: str) -> None:
    """Both databases seeded alike, then the planted discrepancies (EXPECTED_TAMPERED)."""
    await seed(database_url)
    await seed(peer_url)
    await tamper(database_url, peer_url)


@pytest.mark.usefixtures("tampered")
async def test_tampered_databases_report_exactly_the_planted_discrepancies(
    spark, database_url: str, peer_url: str, capfd
) -> None:
    assert await reconcile(database_url, peer_url) == 1

    out, err = capfd.readouterr()
    assert PASSWORD not in out and PASSWORD not in err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "discrepancies"
    assert summary["counts"] == EXPECTED_COUNTS
    assert summary["total"] == 11

    runs, disc = await stored(database_url)
    assert len(runs) == 1 and runs[0]["status"] == "discrepancies"
    first_run = runs[0]["run_id"]
    assert sorted((k, r or "", e or "", s) for _, k, r, e, s, _ in disc) == sorted(
        (k, r or "", e or "", s) for k, r, e, s in EXPECTED_TAMPERED
    )
    details = {(k, r, e, s): json.loads(d) for _, k, r, e, s, d in disc}
    assert details[("payload_mismatch", "inv-4", None, "peer1")] == {
        # Computed here, not by the code under test: SHA-256 of the key-sorted compact JSON.
        "primary_sha256": hashlib.sha256(b'{"amount":40,"invoice":4}').hexdigest(),
        "peer_sha256": hashlib.sha256(b'{"amount":4000,"invoice":4}').hexdigest(),
    }
    assert details[("entity_drift", "u-02-1", "ent-02", "primary")]["problem"] == "missing_entity"
    assert details[("entity_drift", "u-01-2", "ent-01", "primary")]["fields"] == ["data_md5"]
    assert details[("entity_drift", "u-05-1", "ent-05", "peer1")]["fields"] == ["version"]

    # Rerunning the same date replaces that date's results instead of adding to them.
    assert await reconcile(database_url, peer_url) == 1
    runs, disc = await stored(database_url)
    assert len(runs) == 1 and runs[0]["run_id"] != first_run
    assert {d[0] for d in disc} == {runs[0]["run_id"]}
    assert len(disc) == 11


async def buckets_of(dsn: str, request_ids: list[str]) -> frozenset[int]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT hashtext(r) & ($2::int - 1) AS b FROM unnest($1::text[]) AS r",
            request_ids,
            io.DIGEST_BUCKETS,
        )
    finally:
        await conn.close()
    return frozenset(r["b"] for r in rows)


@pytest.mark.usefixtures("tampered")
async def test_only_the_buckets_of_differing_requests_are_compared_row_by_row(
    spark, database_url: str, peer_url: str
) -> None:
    opts = JobOptions(
        run_date=date(2024, 5, 1),
        primary=io.Database("primary", database_url),
        peers=(io.Database("peer1", peer_url),),
    )
    # req-stuck is IN_PROGRESS on both sides alike: no bucket of its own.
    tampered = ["req-status", "inv-3", "only-peer", "inv-4"]
    assert await asyncio.to_thread(compared_buckets, spark, opts) == {
        "peer1": await buckets_of(database_url, tampered)
    }


@pytest.mark.usefixtures("tampered")
async def test_past_max_compared_buckets_the_whole_window_is_compared(
    spark, database_url: str, peer_url: str, capfd, monkeypatch
) -> None:
    monkeypatch.setattr(job, "MAX_COMPARED_BUCKETS", 3)  # 4 differ
    assert await reconcile(database_url, peer_url) == 1
    out, _ = capfd.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["counts"] == EXPECTED_COUNTS
    _, disc = await stored(database_url)
    assert sorted((k, r or "", e or "", s) for _, k, r, e, s, _ in disc) == sorted(
        (k, r or "", e or "", s) for k, r, e, s in EXPECTED_TAMPERED
    )


@pytest.mark.usefixtures("tampered")
async def test_max_discrepancies_stores_the_first_in_order_and_counts_them_all(
    spark, database_url: str, peer_url: str, capfd
) -> None:
    # In (kind, source, request_id, entity_id) order the four entity_drift rows come first.
    first_four = [
        ("entity_drift", "u-05-1", "ent-05", "peer1"),
        ("entity_drift", "ghost-req", "ghost", "primary"),
        ("entity_drift", "u-01-2", "ent-01", "primary"),
        ("entity_drift", "u-02-1", "ent-02", "primary"),
    ]

    # Fewer than found (4; 10, one short): truncated, the counts still cover all 11;
    # exactly as many (11): not truncated.
    for limit, stored_rows, truncated in ((4, 4, True), (10, 10, True), (11, 11, False)):
        assert await reconcile(database_url, peer_url, "--max-discrepancies", str(limit)) == 1
        out, _ = capfd.readouterr()
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["counts"] == EXPECTED_COUNTS, limit
        assert (summary["total"], summary["stored"], summary["truncated"]) == (
            11,
            stored_rows,
            truncated,
        ), limit
        _, disc = await stored(database_url)
        assert len(disc) == stored_rows, limit
        if limit == 4:
            assert sorted((k, r, e, s) for _, k, r, e, s, _ in disc) == sorted(first_four)


async def test_a_peer_lagging_past_the_skew_margin_is_not_missing(
    spark, database_url: str, peer_url: str, capfd
) -> None:
    """A peer-region outage: requests of the primary's window reached the peer two hours
    after the window's end (past --skew-minutes); the peer holds them when the job runs."""
    await seed(database_url)
    await seed(peer_url)
    late = datetime(2024, 5, 2, 2, 0, tzinfo=UTC)  # window end + 2 h
    q = await asyncpg.connect(peer_url)
    try:
        await q.execute(
            "UPDATE modifications SET received_at = $1::timestamptz,"
            " completed_at = $1::timestamptz + interval '1 second'"
            " WHERE request_id IN ('inv-1', 'inv-2')",
            late,
        )
    finally:
        await q.close()

    assert await reconcile(database_url, peer_url) == 0
    out, _ = capfd.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["counts"] == dict.fromkeys(EXPECTED_COUNTS, 0)


async def test_a_one_sided_prune_at_the_window_s_edge_is_not_missing(
    spark, database_url: str, peer_url: str, capfd
) -> None:
    """A retention of 2 days and yesterday's window: its start (48 h ago at the latest,
    minus the lookback) lies past the retention, where each database prunes on its own
    phase. A request of that edge that the peer already pruned is not missing; one of the
    checked part that the peer lacks still is; the run's record says what was skipped."""
    now = datetime.now(UTC)
    day = (now - timedelta(days=1)).date()
    window_start = datetime.combine(day, datetime.min.time(), tzinfo=UTC) - timedelta(days=1)
    edge, checked = window_start + timedelta(minutes=10), now - timedelta(hours=25)
    for dsn in (database_url, peer_url):
        conn = await asyncpg.connect(dsn)
        try:
            await insert_modification(conn, "edge-pruned", "invoice.created", {"i": 1}, edge)
            await insert_modification(conn, "gone", "invoice.created", {"i": 2}, checked)
            if dsn == peer_url:  # the peer pruned the edge; it lost "gone" for real
                await conn.execute(
                    "DELETE FROM modifications WHERE request_id IN ('edge-pruned', 'gone')")
        finally:
            await conn.close()

    argv = ["--date", day.isoformat(), "--database-url", database_url, "--peer-url", peer_url,
            "--partitions", "2", "--retention-days", "2"]
    assert await asyncio.to_thread(main, argv) == 1
    out, _ = capfd.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["counts"] == {**dict.fromkeys(EXPECTED_COUNTS, 0), "missing_in_peer": 1}
    runs, disc = await stored(database_url)
    assert [(k, r) for _, k, r, *_ in disc] == [("missing_in_peer", "gone")]
    skipped = json.loads(runs[0]["counts"])["skipped"]
    assert skipped["checks"] == ["missing_in_peer", "missing_in_primary"]
    assert skipped["retention_days"] == 2
    horizon = datetime.fromisoformat(skipped["received_before"])
    assert edge < horizon < checked
    assert skipped["requests"] == {"primary": 1, "peer1": 0}
    assert summary["skipped"] == skipped


async def _lock_holders(dsn: str, *, terminate: bool) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        pids = await conn.fetch(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND ((classid::bigint << 32) | objid::bigint) = $1",
            io.RECONCILE_LOCK_KEY,
        )
        for row in pids if terminate else []:
            # With a timeout, pg_terminate_backend waits for the backend to exit, so its
            # advisory lock is free when this returns (without one it only sends the
            # signal, and a rival's pg_try_advisory_lock can still find the lock held).
            assert await conn.fetchval(
                "SELECT pg_terminate_backend($1, 30000)", row["pid"])
        return len(pids)
    finally:
        await conn.close()


@pytest.mark.timeout(900)
async def test_a_lock_dropped_mid_run_is_taken_again_before_writing(
    spark, database_url: str, peer_url: str, capfd, monkeypatch
) -> None:
    """The reconcile lock's session ends while Spark runs (an idle timeout, a failover:
    here pg_terminate_backend). Nobody else took it: the run takes it again and writes.
    Another run took it meanwhile: the first fails clearly (exit 3) and writes nothing,
    so two runs never write one date concurrently."""
    await seed(database_url)
    await seed(peer_url)
    original = job.run
    rival: list[asyncpg.Connection] = []

    def run_losing_the_lock(spark, opts, as_of):
        async def drop() -> None:
            assert await _lock_holders(database_url, terminate=True) == 1
            if rival:
                assert await rival[0].fetchval(
                    "SELECT pg_try_advisory_lock($1)", io.RECONCILE_LOCK_KEY)

        asyncio.run_coroutine_threadsafe(drop(), loop).result(timeout=60)
        return original(spark, opts, as_of)

    loop = asyncio.get_running_loop()
    monkeypatch.setattr(job, "run", run_losing_the_lock)

    assert await reconcile(database_url, peer_url) == 0
    runs, _ = await stored(database_url)
    assert [r["status"] for r in runs] == ["clean"]
    assert await _lock_holders(database_url, terminate=False) == 0  # given back

    capfd.readouterr()
    rival.append(await asyncpg.connect(database_url))
    try:
        assert await reconcile(database_url, peer_url) == 3
        _, err = capfd.readouterr()
        assert '"event": "reconcile_failed"' in err or '"event":"reconcile_failed"' in err
        assert "lock" in err
        assert [r["run_id"] for r in (await stored(database_url))[0]] == [runs[0]["run_id"]]
    finally:
        await rival[0].close()


async def test_entity_history_partitions_are_not_skewed_by_old_checkpoint_ids(
    spark, database_url: str
) -> None:
    """A checkpoint keeps the id of a long-pruned modification: one id range over both
    would put the whole remaining history into its last partition."""
    from pyspark.sql import functions as F

    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO entity_checkpoints (entity_id, modification_id, request_id,"
            " request_type, version, data_md5, completed_at)"
            " VALUES ('old', 1, 'old-1', 'entity.upsert', 1, 'x', $1)", at(-60 * 24 * 40))
        await conn.execute("SELECT setval('modifications_id_seq', 10000000)")
    finally:
        await conn.close()
    await seed(database_url)
    db = io.Database("primary", database_url)
    opts = JobOptions(run_date=date(2024, 5, 1), primary=db)
    extent = (await asyncio.to_thread(job.read_extents, spark, opts, T0))["primary"]
    df = io.read_entity_modifications(spark, db, 8, extent)
    sizes = [r["count"] for r in df.groupBy(F.spark_partition_id()).count().collect()]
    assert sum(sizes) == 8  # 7 entity modifications + the checkpoint
    # One range over both: [7, 1] (everything but the checkpoint in the last partition).
    assert max(sizes) < 7 and len(sizes) > 2, sizes

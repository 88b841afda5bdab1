"""The real ``sqs-ingest run`` process over a few hundred messages, then SIGTERM."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import asyncpg

from tests.acceptance.harness import (
    REPO,
    Daemon,
    Workload,
    check_invariants,
    counted,
    daemon_env,
    send_all,
    wait_drained,
)
from tests.servers import wait_until


async def test_daemon_ingests_exactly_once_and_stops_cleanly(
    sqs_client: Any, sqs_endpoint: str, queue_url: str, database_url: str, tmp_path: Path
) -> None:
    w = Workload(seed=1)
    bodies = w.bodies(300)
    send_all(sqs_client, queue_url, bodies)
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint), tmp_path).start()
    try:
        d.wait_ready()
        wait_drained(sqs_client, queue_url, [d])
        # Reused keys go in once their originals are on record.
        send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:15]))
        wait_drained(sqs_client, queue_url, [d])
        sent = len(bodies) + 15
        dead = len(w.poison) + 15
        outcomes = counted(d, {"completed": 300, "dead_lettered": dead,
                               "duplicate": sent - 300 - dead, "retried": 0})
        received = d.metric("sqs_ingest_messages_received_total")
        # Every request completes once, every poison/reused body is dead-lettered once.
        assert (outcomes["completed"], outcomes["dead_lettered"], outcomes["retried"]) == (
            300, dead, 0), outcomes
        # Each delivery beyond the first of a request_id is acked as a duplicate. The
        # emulator (like SQS) may deliver a message twice; only such extra deliveries may
        # add duplicates beyond the ones sent.
        extra_deliveries = received - sent
        assert 0 <= outcomes["duplicate"] - (sent - 300 - dead) <= extra_deliveries, (
            outcomes, received, sent)
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0, d.logs()
    finally:
        if not d.exited():
            d.kill9()
    counts = await check_invariants(database_url, w, sqs_client, queue_url)
    assert counts["completed"] == 300
    assert counts["poison"] > 0 and counts["reused"] == 15
    conn = await asyncpg.connect(database_url)
    try:
        stopped = await conn.fetchval("SELECT count(*) FROM workers WHERE stopped_at IS NOT NULL")
        assert stopped == 1
    finally:
        await conn.close()


async def test_json_logs_carry_message_and_request_ids(
    sqs_client: Any, sqs_endpoint: str, queue_url: str, database_url: str, tmp_path: Path
) -> None:
    send_all(sqs_client, queue_url, ['{"request_id": "r-x", "type": "nope", "payload": {}}'])
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint,
                          INGEST_DATABASE_URL=database_url.replace("postgres@", "postgres:hunter2@")),
               tmp_path).start()
    try:
        wait_until(lambda: "poison_message" in d.full_logs(), 30, "poison logged")
    finally:
        assert d.stop() == 0
    lines = [json.loads(line) for line in d.full_logs().splitlines() if line.startswith("{")]
    poison = [entry for entry in lines if entry["event"] == "poison_message"]
    assert poison and poison[0]["request_id"] == "r-x" and poison[0]["message_id"]
    assert all("level" in entry and "timestamp" in entry for entry in lines)
    assert "hunter2" not in d.full_logs()


STARTUP_GATE = '''
"""Imported through INGEST_HANDLERS, i.e. during start-up before the event loop runs:
holds the process there until the test lets it go (bounded)."""
import os
import pathlib
import time

GATE = pathlib.Path(os.environ["TEST_GATE_DIR"])
(GATE / "importing").touch()
deadline = time.monotonic() + 30
while not (GATE / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.02)
'''


def test_sigterm_during_startup_still_exits_0(
    sqs_endpoint: str, queue_url: str, database_url: str, tmp_path: Path
) -> None:
    """SIGTERM while the process is provably inside start-up (importing INGEST_HANDLERS,
    before the event loop and its signal handlers exist): it still stops cleanly, exit 0."""
    mods, gate = tmp_path / "mods", tmp_path / "gate"
    mods.mkdir()
    gate.mkdir()
    (mods / "startup_gate.py").write_text(STARTUP_GATE)
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint,
                          INGEST_HANDLERS="startup_gate", TEST_GATE_DIR=str(gate),
                          PYTHONPATH=os.pathsep.join([str(mods), str(REPO)])), tmp_path).start()
    try:
        wait_until(lambda: (gate / "importing").exists() or d.exited(), 30, "start-up reached")
        assert not d.exited(), d.logs()
        assert not d.ready()  # nothing listening yet: this is start-up
        d.signal(signal.SIGTERM)
        (gate / "release").touch()
        assert d.wait(30) == 0, d.logs()
    finally:
        (gate / "release").touch()
        if not d.exited():
            d.kill9()


def test_sigterm_while_waiting_for_the_database_exits_0(
    sqs_endpoint: str, queue_url: str, tmp_path: Path
) -> None:
    """Start-up with the database unreachable: the daemon waits (not ready, no crash loop)
    and a SIGTERM in that phase stops it cleanly."""
    from tests.servers import free_port

    dsn = f"postgresql://postgres@127.0.0.1:{free_port()}/postgres"  # nothing listens there
    d = Daemon(daemon_env(dsn, queue_url, sqs_endpoint), tmp_path).start()
    try:
        wait_until(lambda: "database_unavailable" in d.full_logs() or d.exited(), 30,
                   "start-up retrying the database")
        status, body = d.get("/readyz")
        assert (status, json.loads(body)["phase"]) == (503, "starting"), body
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0, d.logs()
    finally:
        if not d.exited():
            d.kill9()

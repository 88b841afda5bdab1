"""The real ``sqs-ingest run`` process over a few hundred messages, then SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import asyncpg

from tests.acceptance.harness import (
    Daemon,
    Workload,
    check_invariants,
    daemon_env,
    send_all,
    wait_drained,
)
from tests.servers import wait_until


async def test_daemon_ingests_exactly_once_and_stops_cleanly(
    sqs_client: Any, sqs_endpoint: str, queue_url: str, database_url: str, tmp_path: Path
) -> None:
    w = Workload(seed=1)
    send_all(sqs_client, queue_url, w.bodies(300))
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint), tmp_path).start()
    try:
        d.wait_ready()
        wait_drained(sqs_client, queue_url, [d])
        # Reused keys go in once their originals are on record.
        send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:15]))
        wait_drained(sqs_client, queue_url, [d])
        received = d.metric("sqs_ingest_messages_received_total")
        assert received >= 300
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
    import json

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


def test_sigterm_during_startup_still_exits_0(
    sqs_endpoint: str, queue_url: str, database_url: str, tmp_path: Path
) -> None:
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint), tmp_path).start()
    wait_until(lambda: (tmp_path / "daemon.1.log").exists(), 10, "process spawned")
    import time

    time.sleep(0.3)  # inside imports / connecting: before the event loop is up
    d.signal(signal.SIGTERM)
    assert d.wait(30) == 0, d.logs()

"""`sqs-ingest gc`: one pass by hand, printing what it released — never a live claim."""

from __future__ import annotations

import os
import subprocess
import sys

import asyncpg


async def test_gc_cli_releases_only_dead_owners(database_url: str, db: asyncpg.Connection) -> None:
    await db.execute("""
        INSERT INTO workers (worker_id, worker_name, hostname, pid, heartbeat_at) VALUES
          ('dead-1', 'a', 'h', 1, now() - interval '1 hour'),
          ('live-1', 'b', 'h', 2, now())""")
    await db.execute("""
        INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,
                                   sqs_message_id, owner) VALUES
          ('orphan', 'entity.upsert', '{}', 'x', 'IN_PROGRESS', 'm1', 'dead-1'),
          ('busy',   'entity.upsert', '{}', 'x', 'IN_PROGRESS', 'm2', 'live-1'),
          ('done',   'entity.upsert', '{}', 'x', 'COMPLETED',   'm3', 'dead-1')""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env["INGEST_DATABASE_URL"] = database_url
    proc = subprocess.run([sys.executable, "-m", "service", "gc"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "released request_id=orphan owner=dead-1" in proc.stdout
    assert "released 1 orphaned claim(s)" in proc.stdout
    rows = {r["request_id"] for r in await db.fetch("SELECT request_id FROM modifications")}
    assert rows == {"busy", "done"}

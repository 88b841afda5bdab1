"""Reconcile two databases filled by the daemon's own worker (not hand-written rows).

Catches any mismatch between what the daemon writes (payload hashes, entities.data as
JSON objects, tombstones) and what the job replays: untouched, the job must find nothing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from service.reconcile.cli import main
from tests.acceptance.harness import Workload, queue_depth, send_all
from tests.integration.conftest import eventually, make_settings, running_worker

pytestmark = pytest.mark.spark


async def fill(sqs: Any, endpoint: str, dsn: str, bodies: list[str]) -> None:
    url = sqs.create_queue(QueueName="rec-" + uuid.uuid4().hex[:10])["QueueUrl"]
    send_all(sqs, url, bodies)
    async with running_worker(make_settings(url, dsn, endpoint)):
        async def drained() -> bool:
            return await asyncio.to_thread(queue_depth, sqs, url) == 0
        await eventually(drained, "queue drained", timeout=120)
    conn = await asyncpg.connect(dsn)
    try:
        # Move the day's work to yesterday, so it is outside the in-flight margin.
        await conn.execute("UPDATE modifications SET received_at = received_at - interval '1 day',"
                           " completed_at = completed_at - interval '1 day'")
        await conn.execute("UPDATE entities SET updated_at = updated_at - interval '1 day'")
    finally:
        await conn.close()


async def run(primary: str, peer: str) -> int:
    day = (datetime.now(UTC) - timedelta(days=1)).date().isoformat()
    return await asyncio.to_thread(main, ["--date", day, "--database-url", primary,
                                          "--peer-url", peer, "--partitions", "2"])


# Two fills by the daemon and two Spark runs: minutes on a loaded 2-core machine.
@pytest.mark.timeout(600)
async def test_daemon_filled_databases_reconcile_clean_then_drift_is_found(
    sqs_client: Any, sqs_endpoint: str, database_url: str, peer_url: str
) -> None:
    w = Workload(seed=21, entities=15, ledger_share=0)  # in-process worker: entity types only
    bodies = w.bodies(120, prefix="rc")
    await fill(sqs_client, sqs_endpoint, database_url, bodies)
    await fill(sqs_client, sqs_endpoint, peer_url, bodies)

    assert await run(database_url, peer_url) == 0

    conn = await asyncpg.connect(database_url)
    try:
        eid = await conn.fetchval(
            "SELECT entity_id FROM entities WHERE NOT deleted ORDER BY entity_id LIMIT 1")
        await conn.execute("UPDATE entities SET data = $1::jsonb WHERE entity_id = $2",
                           json.dumps({"tampered": True}), eid)
    finally:
        await conn.close()
    assert await run(database_url, peer_url) == 1
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT kind, entity_id, source FROM reconciliation_discrepancies d"
            " JOIN reconciliation_runs r USING (run_id)"
            " WHERE r.run_id = (SELECT max(run_id) FROM reconciliation_runs)")
    finally:
        await conn.close()
    assert [(r["kind"], r["entity_id"]) for r in rows] == [("entity_drift", eid)]

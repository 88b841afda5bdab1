"""Reconciliation stays exact on pruned tables (issue 12).

Two databases filled by the daemon's own worker with an old round (past the retention) and
a young one, pruned with different batch sizes (so the entity checkpoints are built from
different batch splits), reconciled: nothing is found, though every entity of the old round
lost its modifications and two entities are explained by their checkpoint alone. A drift
planted on such an entity is found, and only it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import pytest

from service.adapters.prune import prune_once
from service.settings import Settings
from tests.acceptance.harness import delete, queue_depth, send_all, upsert
from tests.integration.conftest import eventually, make_settings, running_worker
from tests.reconcile.test_daemon_filled import run

pytestmark = pytest.mark.spark


def old_round() -> list[str]:
    bodies = []
    for e in range(10):
        eid = f"p-e{e}"
        bodies += [upsert(f"o-{e}-1", eid, 1), upsert(f"o-{e}-3", eid, 3),
                   upsert(f"o-{e}-2", eid, 2)]  # a stale version: never lands
    bodies += [delete("o-7-del", "p-e7", 4)]  # a tombstone that only the checkpoint keeps
    return bodies


def young_round() -> list[str]:
    bodies = [upsert(f"y-{e}-9", f"p-e{e}", 9) for e in range(5)]  # newer than the old round
    bodies += [upsert(f"y-{e}-2", f"p-e{e}", 2) for e in (5, 6)]  # older than the checkpoint
    bodies += [upsert(f"y-new-{e}", f"p-n{e}", 1) for e in range(3)]  # entities never pruned
    return bodies


async def fill(sqs: Any, endpoint: str, dsn: str, bodies: list[str]) -> None:
    url = sqs.create_queue(QueueName="prn-" + uuid.uuid4().hex[:10])["QueueUrl"]
    send_all(sqs, url, bodies)
    async with running_worker(make_settings(url, dsn, endpoint)):
        async def drained() -> bool:
            return await asyncio.to_thread(queue_depth, sqs, url) == 0
        await eventually(drained, "queue drained", timeout=120)


async def shift(dsn: str, days: int) -> None:
    """Move what was written in the last hour ``days`` back in time."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            "UPDATE modifications SET received_at = received_at - make_interval(days => $1),"
            " completed_at = completed_at - make_interval(days => $1)"
            " WHERE received_at > now() - interval '1 hour'", days)
        await conn.execute(
            "UPDATE entities SET updated_at = updated_at - make_interval(days => $1)"
            " WHERE updated_at > now() - interval '1 hour'", days)
    finally:
        await conn.close()


# Two fills by the daemon and two Spark runs: minutes on a loaded 2-core machine.
@pytest.mark.timeout(600)
async def test_pruned_databases_reconcile_clean_then_drift_is_found(
    sqs_client: Any, sqs_endpoint: str, database_url: str, peer_url: str
) -> None:
    for dsn, batch in ((database_url, 4), (peer_url, 1000)):
        await fill(sqs_client, sqs_endpoint, dsn, old_round())
        await shift(dsn, 40)
        await fill(sqs_client, sqs_endpoint, dsn, young_round())
        await shift(dsn, 1)
        s = Settings(queue_url="http://127.0.0.1:1/q", database_url=dsn,
                     prune_batch_size=batch)
        counts = await prune_once(dsn, s)
        assert counts is not None and counts["modifications"] == len(old_round())

    assert await run(database_url, peer_url) == 0

    conn = await asyncpg.connect(database_url)
    try:
        # p-e8: its whole history is pruned; only the checkpoint says what it must be.
        assert await conn.fetchval(
            "SELECT count(*) FROM modifications WHERE payload->>'entity_id' = 'p-e8'") == 0
        await conn.execute("UPDATE entities SET data = $1::jsonb WHERE entity_id = 'p-e8'",
                           json.dumps({"tampered": True}))
    finally:
        await conn.close()
    assert await run(database_url, peer_url) == 1
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT kind, entity_id, details FROM reconciliation_discrepancies"
            " WHERE run_id = (SELECT max(run_id) FROM reconciliation_runs)")
    finally:
        await conn.close()
    assert [(r["kind"], r["entity_id"]) for r in rows] == [("entity_drift", "p-e8")]
    assert json.loads(rows[0]["details"])["expected"]["request_id"] == "o-8-3"

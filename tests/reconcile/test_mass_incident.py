"""A mass incident must not crash the run that reports it (issue 43).

A peer holding nothing against thousands of requests, with a ``spark.driver.maxResultSize``
far below the discrepancies' size: the run still finishes, counts every one exactly,
stores the first ``--max-discrepancies`` in order and writes the full set to ``--output``.
Its own process: the result-size limit is a setting of the SparkContext.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest

from tests.reconcile.test_job import stored

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]
ROWS = 8_000
STORED = 5_000


@pytest.mark.timeout(900)
async def test_an_empty_peer_with_a_small_max_result_size_is_counted_exactly(
    database_url: str, peer_url: str, tmp_path: Path
) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute(
            "INSERT INTO modifications (request_id, request_type, payload, payload_sha256,"
            " status, sqs_message_id, owner, received_at, completed_at, result)"
            " SELECT 'mass-' || lpad(i::text, 6, '0'), 'invoice.created',"
            "  jsonb_build_object('i', i), md5(i::text), 'COMPLETED', 'm-' || i, 'w',"
            "  t, t + interval '1 second', '{\"applied\": true}'"
            " FROM generate_series(1, $1) AS i,"
            "  LATERAL (SELECT timestamptz '2024-05-01 00:00:00+00' + i * interval '1 second') s(t)",
            ROWS,
        )
    finally:
        await conn.close()
    out_dir = tmp_path / "out"
    env = {
        **os.environ,
        "PYSPARK_SUBMIT_ARGS": "--conf spark.driver.maxResultSize=1m pyspark-shell",
        "INGEST_LOG_FORMAT": "json",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "service.reconcile.cli", "--date", "2024-05-01",
         "--database-url", database_url, "--peer-url", peer_url, "--retention-days", "0",
         "--partitions", "2", "--max-discrepancies", str(STORED), "--output", str(out_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["counts"]["missing_in_peer"] == ROWS
    assert (summary["total"], summary["stored"], summary["truncated"]) == (ROWS, STORED, True)

    _, disc = await stored(database_url)
    expected = [f"mass-{i:06d}" for i in range(1, ROWS + 1)]
    assert sorted(r for _, _, r, *_ in disc) == expected[:STORED]  # the first, in order
    written = [
        json.loads(line)["request_id"]
        for f in out_dir.rglob("*.json")
        for line in f.read_text().splitlines()
    ]
    assert sorted(written) == expected

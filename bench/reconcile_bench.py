"""Benchmark of the reconciliation job: 1,000,000 modifications in each of two databases.

    .venv/bin/python bench/reconcile_bench.py [--rows 1000000] [--master local[2]]

Starts a throwaway PostgreSQL on loopback, fills a primary and a peer server-side
(``INSERT … SELECT generate_series``) with the same stream, plants a few discrepancies,
then runs ``sqs-ingest reconcile`` as a subprocess and reports its wall time and the peak
resident memory of its whole process tree (the Python driver plus the Spark JVM), sampled
from /proc. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.migrate import migrate  # noqa: E402
from tests.servers import postgres_server  # noqa: E402

RUN_DATE = "2024-05-01"
ENTITIES = 100_000

# 70% entity upserts (ENTITIES entities, versions increasing with i), 30% another type;
# received over the run date, all COMPLETED one second later.
FILL = f"""
INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,
                           sqs_message_id, owner, received_at, completed_at, result)
SELECT 'req-' || i, t.type, t.payload,
       encode(sha256(convert_to(t.payload::text, 'UTF8')), 'hex'),
       'COMPLETED', 'msg-' || i, 'worker-bench', t.received, t.received + interval '1 second',
       '{{"applied": true}}'
  FROM generate_series(1, $1::int) AS i,
  LATERAL (SELECT
      CASE WHEN i % 10 < 7 THEN 'entity.upsert' ELSE 'invoice.created' END AS type,
      CASE WHEN i % 10 < 7
           THEN jsonb_build_object('entity_id', 'ent-' || (i % {ENTITIES}),
                                   'version', i / {ENTITIES},
                                   'data', jsonb_build_object('i', i, 'tag', md5(i::text)))
           ELSE jsonb_build_object('invoice', i, 'amount', i % 997) END AS payload,
      timestamptz '{RUN_DATE} 00:00:00+00' + (i::float8 / $1 * 86000) * interval '1 second'
        AS received) AS t
"""
# The state the reference handlers leave: per entity, the highest version.
ENTITY_STATE = """
INSERT INTO entities (entity_id, version, deleted, data, request_id, updated_at)
SELECT DISTINCT ON (payload->>'entity_id')
       payload->>'entity_id', (payload->>'version')::bigint, false, payload->'data',
       request_id, completed_at
  FROM modifications WHERE request_type = 'entity.upsert'
 ORDER BY payload->>'entity_id', (payload->>'version')::bigint DESC, completed_at
"""
# Planted in the peer: 100 missing, 10 payload mismatches, 5 stuck claims, 3 drifted entities.
TAMPER_PEER = [
    # Only invoice rows (i % 10 >= 7), so that no entity's replay changes with them.
    "DELETE FROM modifications WHERE request_id IN"
    " (SELECT 'req-' || (g * 10 + 7) FROM generate_series(100, 199) g)",
    "UPDATE modifications SET payload_sha256 = 'forged'"
    " WHERE request_id IN (SELECT 'req-' || (g * 10 + 8) FROM generate_series(200, 209) g)",
    "UPDATE modifications SET status = 'IN_PROGRESS', completed_at = NULL"
    " WHERE request_id IN (SELECT 'req-' || (g * 10 + 9) FROM generate_series(300, 304) g)",
    "UPDATE entities SET version = version + 100 WHERE entity_id IN ('ent-1', 'ent-2', 'ent-3')",
]
EXPECTED_TOTAL = 100 + 10 + 5 * 2 + 3  # stuck claims are also status mismatches


async def prepare(admin_dsn: str, dsn_of, rows: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    timings: dict[str, float] = {}
    conn = await asyncpg.connect(admin_dsn)
    try:
        for name in ("bench_primary", "bench_peer"):
            await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    for name in ("bench_primary", "bench_peer"):
        t0 = time.monotonic()
        await migrate(dsn_of(name))
        db = await asyncpg.connect(dsn_of(name))
        try:
            await db.execute(FILL, rows)
            await db.execute(ENTITY_STATE)
            if name == "bench_peer":
                for sql in TAMPER_PEER:
                    await db.execute(sql)
            await db.execute("ANALYZE")
        finally:
            await db.close()
        timings[f"fill_{name}_seconds"] = round(time.monotonic() - t0, 1)
    return timings


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def tree_rss_bytes(root: int) -> int:
    """Resident memory of ``root`` and all its descendants."""
    tree, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def run_job(primary: str, peer: str, master: str, partitions: int) -> dict[str, object]:
    cmd = [
        sys.executable,
        "-m",
        "service.reconcile.cli",
        "--date",
        RUN_DATE,
        "--database-url",
        primary,
        "--peer-url",
        peer,
        "--master",
        master,
        "--partitions",
        str(partitions),
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_bytes(proc.pid))
        time.sleep(0.2)
    wall = time.monotonic() - t0
    out = proc.stdout.read() if proc.stdout else ""
    lines = out.strip().splitlines()
    return {
        "exit_code": proc.returncode,
        "wall_seconds": round(wall, 1),
        "peak_rss_mib": round(peak / 2**20),
        "summary": json.loads(lines[-1]) if lines else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions", type=int, default=8)
    args = parser.parse_args()
    with postgres_server() as pg:
        timings = asyncio.run(prepare(pg.dsn(), pg.dsn, args.rows))
        if os.environ.get("BENCH_KEEP"):
            print(pg.dsn("bench_primary"), pg.dsn("bench_peer"), flush=True)
            input("press enter to run the job")
        result = run_job(
            pg.dsn("bench_primary"), pg.dsn("bench_peer"), args.master, args.partitions
        )
    summary = result.get("summary") or {}
    report = {
        "rows_per_database": args.rows,
        "master": args.master,
        "partitions": args.partitions,
        **timings,
        "job_wall_seconds": result["wall_seconds"],
        "job_peak_rss_mib": result["peak_rss_mib"],
        "exit_code": result["exit_code"],
        "discrepancies": summary.get("counts") if isinstance(summary, dict) else None,
        "expected_total": EXPECTED_TOTAL,
    }
    print(json.dumps(report))
    ok = isinstance(summary, dict) and summary.get("total") == EXPECTED_TOTAL
    return 0 if ok and result["exit_code"] == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())

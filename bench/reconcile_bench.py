"""Benchmark of the reconciliation job against its read-only floor: 1,000,000
modifications in each of two databases.

    .venv/bin/python bench/reconcile_bench.py [--rows 1000000] [--master local[2]]
        [--partitions 8] [--baseline COMMIT] [--variant NAME=COMMIT ...]
        [--order floor,job,job,floor]

Starts a throwaway PostgreSQL on loopback, fills a primary and a peer server-side
(``INSERT … SELECT generate_series``) with the same stream, plants a few discrepancies,
then, against those same two databases, runs in ``--order``:

* ``floor``: bench/reconcile_floor.py — the same Spark session reading every row and column
  the job reads over JDBC (the job's own ``io`` reads: same SQL, options, partitioning),
  materialised through Spark's ``noop`` sink, nothing else;
* ``job``: ``sqs-ingest reconcile`` from this worktree, as a subprocess;
* ``base``: the same from ``--baseline``'s ``service/`` (old vs new in one run), and any
  ``--variant NAME=COMMIT`` likewise under its NAME.

Each run is a fresh process (Python + JVM). For each it reports the wall time (process
start to exit), the Spark part (the job's ``duration_seconds``: ``job.run``; the floor's
reads), and the peak resident memory of its whole process tree (the Python driver plus the
Spark JVM), sampled from /proc. Every job run must find exactly the planted discrepancies
and write the same rows (details included) as the first job run. Prints one JSON line per
run on stderr, then the report (means and ratios to the floor) on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.adapters.migrate import migrate  # noqa: E402
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
# Interleaved so that drift over the run (caches warming, other load) hits both sides alike.
DEFAULT_ORDER = {False: "floor,job,job,floor", True: "floor,base,job,job,base,floor"}


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


def run_child(cmd: list[str], cwd: Path) -> dict[str, Any]:
    """Run one child to its end: wall time, peak RSS of its process tree, last stdout line."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
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


#: The run date lies years back, past any retention: the bench's databases are never
#: pruned, so the missing checks must run on the whole window (an environment variable, not
#: --retention-days, so that a --baseline without that option runs too).
os.environ.setdefault("INGEST_RETENTION_DAYS", "36500")


def job_args(primary: str, peer: str, master: str, partitions: int) -> list[str]:
    """The arguments of ``sqs-ingest reconcile`` the job and the floor both get."""
    return [
        "--date", RUN_DATE, "--database-url", primary, "--peer-url", peer,
        "--master", master, "--partitions", str(partitions),
    ]  # fmt: skip


def run_job(argv: list[str], code: Path) -> dict[str, Any]:
    """``sqs-ingest reconcile`` as a subprocess, from the ``service/`` under ``code``."""
    result = run_child([sys.executable, "-m", "service.reconcile.cli", *argv], code)
    summary = result.pop("summary") or {}
    result["spark_seconds"] = summary.get("duration_seconds")
    result["counts"] = summary.get("counts")
    result["total"] = summary.get("total")
    return result


def run_floor(argv: list[str]) -> dict[str, Any]:
    """bench/reconcile_floor.py as a subprocess: the job's reads and nothing else."""
    result = run_child([sys.executable, str(ROOT / "bench" / "reconcile_floor.py"), *argv], ROOT)
    summary = result.pop("summary") or {}
    result["spark_seconds"] = summary.get("reads_seconds")
    result["reads"] = summary.get("reads")
    result["rows"] = summary.get("rows")
    return result


async def stored_discrepancies(dsn: str) -> list[tuple[Any, ...]]:
    """What the last run wrote, in a fixed order: compared between runs."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT kind, request_id, entity_id, source, details"
            " FROM reconciliation_discrepancies ORDER BY 1, 2, 3, 4, 5"
        )
    finally:
        await conn.close()
    return [tuple(r) for r in rows]


@contextlib.contextmanager
def checkout(commit: str) -> Iterator[Path]:
    """``service/`` of ``commit`` in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="reconcile-base-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", commit, "service"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        yield Path(tmp)


def ratios(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Mean ``key`` of each kind of run, each job kind's mean over the floor's mean, and
    the working tree's job over each other code's."""
    means: dict[str, float] = {}
    for kind in sorted({r["run"] for r in runs}):
        values = [r[key] for r in runs if r["run"] == kind and r.get(key) is not None]
        if values:
            means[kind] = round(sum(values) / len(values), 2)
    out: dict[str, Any] = {"mean": means}
    for kind, value in means.items():
        if kind != "floor" and "floor" in means:
            out[f"{kind}_over_floor"] = round(value / means["floor"], 3)
    for kind, value in means.items():
        if kind not in ("floor", "job") and "job" in means:
            out[f"job_over_{kind}"] = round(means["job"] / value, 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument(
        "--baseline", default=None, help="also run the job of this commit's service/ (as 'base')"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=COMMIT",
        help="also run the job of COMMIT's service/ as NAME in --order (repeatable)",
    )
    parser.add_argument(
        "--order",
        default=None,
        help="comma-separated runs of floor, job and the --baseline/--variant names (default"
        " floor,job,job,floor; with --baseline floor,base,job,job,base,floor)",
    )
    args = parser.parse_args()
    order = (args.order or DEFAULT_ORDER[args.baseline is not None]).split(",")
    commits = dict(v.split("=", 1) for v in args.variant)
    if args.baseline:
        commits["base"] = args.baseline
    unknown = set(order) - {"floor", "job", *commits}
    if unknown:
        parser.error(f"--order names no --baseline/--variant: {sorted(unknown)}")
    runs: list[dict[str, Any]] = []
    results: dict[str, list[tuple[Any, ...]]] = {}
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(postgres_server())
        code = {name: stack.enter_context(checkout(c)) for name, c in commits.items()}
        code["job"] = ROOT
        timings = asyncio.run(prepare(pg.dsn(), pg.dsn, args.rows))
        argv = job_args(pg.dsn("bench_primary"), pg.dsn("bench_peer"), args.master, args.partitions)
        if os.environ.get("BENCH_KEEP"):
            print(pg.dsn("bench_primary"), pg.dsn("bench_peer"), flush=True)
            input("press enter to run the job")
        for i, kind in enumerate(order):
            if kind == "floor":
                result = run_floor(argv)
            else:
                result = run_job(argv, code[kind])
                written = asyncio.run(stored_discrepancies(pg.dsn("bench_primary")))
                result["same_results_as_first_job"] = results.setdefault("first", written) == written
            runs.append({"i": i, "run": kind, **result})
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    jobs = [r for r in runs if r["run"] != "floor"]
    report = {
        "rows_per_database": args.rows,
        "master": args.master,
        "partitions": args.partitions,
        "commits": commits,
        "order": order,
        **timings,
        "wall_seconds": ratios(runs, "wall_seconds"),
        "spark_seconds": ratios(runs, "spark_seconds"),
        "runs": runs,
        "expected_total": EXPECTED_TOTAL,
    }
    print(json.dumps(report))
    ok = all(
        r["exit_code"] == 1 and r["total"] == EXPECTED_TOTAL and r["same_results_as_first_job"]
        for r in jobs
    ) and all(r["exit_code"] == 0 for r in runs if r["run"] == "floor")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

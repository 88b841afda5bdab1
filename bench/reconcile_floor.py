"""The read-only floor of the reconciliation job: Spark reading over JDBC every row and
column the job reads, and doing nothing else.

    .venv/bin/python bench/reconcile_floor.py --date D --database-url P --peer-url Q \
        [--master local[2]] [--partitions 8]

It takes the arguments of ``sqs-ingest reconcile`` and turns them into the same
``JobOptions`` with the job's own parser, opens the same Spark session
(``service.reconcile.session.spark_session`` with the job's master, jars and shuffle
partitions), and builds the job's own DataFrames with ``service.reconcile.io``
(``read_extent``, the one query per database that gives the partitioned reads their
bounds, then ``read_modifications`` over the window plus margin,
``read_entity_modifications``, ``read_entities``: the same SQL, JDBC properties, fetch
size, bounds and partitioning). Each is materialised through Spark's ``noop`` sink, which
fetches and converts every column of every row (nothing is pruned and no ``COUNT(*)`` is pushed to
PostgreSQL, as ``DataFrame.count()`` would allow), one after the other. No cache, no
shuffle, no join, no write. Prints one JSON line: the seconds of each read, their sum and
the session start-up.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.reconcile import io  # noqa: E402
from service.reconcile.parser import Args, build_parser  # noqa: E402
from service.reconcile.session import spark_session  # noqa: E402


def main(argv: list[str]) -> int:
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    args = Args(build_parser().parse_args(argv))
    if args.ns.date is None:
        raise SystemExit("--date is required")
    opts = args.options(args.ns.date)
    t0 = time.monotonic()
    # Exactly what Runner._run_spark opens.
    spark, owned = spark_session(args.ns.master, args.ns.jars, shuffle_partitions=opts.partitions)
    session_seconds = time.monotonic() - t0
    lo, hi = io.window_range(opts.window, opts.skew_margin)
    reads: dict[str, dict[str, float]] = {}
    rows: dict[str, dict[str, int]] = {}
    try:
        t_reads = time.monotonic()
        for db in opts.databases:
            # The job's one query per database for its reads' bounds (and the window's
            # count, which rides along in the same statement).
            t = time.monotonic()
            extent = io.read_extent(spark, db, opts.window, lo, hi)
            extent_seconds = round(time.monotonic() - t, 2)
            frames = {
                "modifications": lambda db=db, e=extent: io.read_modifications(
                    spark, db, lo, hi, opts.partitions, e.modifications
                ),
                "entity_modifications": lambda db=db, e=extent: io.read_entity_modifications(
                    spark, db, opts.partitions, e
                ),
                "entities": lambda db=db: io.read_entities(spark, db, opts.partitions),
            }
            reads[db.label], rows[db.label] = {"extent": extent_seconds}, {}
            for name, frame in frames.items():
                t = time.monotonic()
                df = frame()  # the JDBC schema lookup runs here, as in the job
                # The row count rides along in the same pass (no second scan).
                seen = Observation(f"{db.label}_{name}")
                df.observe(seen, F.count(F.lit(1)).alias("rows")).write.format("noop").mode(
                    "overwrite"
                ).save()
                reads[db.label][name] = round(time.monotonic() - t, 2)
                rows[db.label][name] = int(seen.get["rows"])
        reads_seconds = time.monotonic() - t_reads
    finally:
        if owned:
            spark.stop()
    print(
        json.dumps(
            {
                "finished_at": datetime.now(UTC).isoformat(),
                "session_seconds": round(session_seconds, 2),
                "reads_seconds": round(reads_seconds, 2),
                "reads": reads,
                "rows": rows,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""Wiring: extract (io) → check (transforms) → collect the small result.

The only things brought back to the driver are the request buckets whose digests differ
between the primary and a peer (at most ``io.DIGEST_BUCKETS`` numbers per
peer), per-kind counts and at most ``max_discrepancies`` discrepancy rows, fetched in
chunks that fit ``spark.driver.maxResultSize``; the tables themselves stay distributed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from datetime import time as dtime
from functools import reduce
from typing import TYPE_CHECKING, Any

from service.reconcile import KINDS, io, transforms
from service.reconcile.transforms import Window

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

Discrepancy = tuple[str, str | None, str | None, str | None, str | None]
#: Past this many differing buckets the comparison reads the whole window row by row.
MAX_COMPARED_BUCKETS = io.DIGEST_BUCKETS // 8
#: The order of the stored (and printed) discrepancies.
ORDER = ("kind", "source", "request_id", "entity_id")
#: Bytes a discrepancy row is budgeted when sizing the chunks fetched to the driver (a
#: serialized row measured ~250 bytes; entity_drift details are the longest).
ROW_BUDGET_BYTES = 1_024
#: Rows per shuffle partition: the shuffle's partitions are sized from the rows read.
ROWS_PER_SHUFFLE_PARTITION = 1_000_000
MAX_SHUFFLE_PARTITIONS = 4_000


@dataclass(frozen=True)
class JobOptions:
    """What one run checks.

    Attributes:
        run_date: the UTC day checked; the window is ``[run_date - lookback, run_date + 1)``.
        primary: the database whose ``reconciliation_*`` tables receive the results.
        peers: other databases ingesting the same stream, compared with the primary.
        lookback: how far before the day the window starts (late IN_PROGRESS, re-checks).
        stuck_after: age past which an IN_PROGRESS claim is stuck; also the grace during
            which anything younger counts as in flight.
        skew_margin: extra range read on both sides for the cross-database lookups.
        partitions: JDBC read partitions per table.
        retention: how long the databases keep completed modifications (the smallest
            INGEST_RETENTION_DAYS among them); ``None``: they are never pruned.
        max_discrepancies: rows collected and stored; counts always cover all of them.
        output: optional directory receiving every discrepancy as JSON lines.
    """

    run_date: date
    primary: io.Database
    peers: tuple[io.Database, ...] = ()
    lookback: timedelta = timedelta(hours=24)
    stuck_after: timedelta = timedelta(minutes=60)
    skew_margin: timedelta = timedelta(hours=1)
    retention: timedelta | None = timedelta(days=30)
    partitions: int = 8
    max_discrepancies: int = 100_000
    output: str | None = None

    @property
    def window(self) -> Window:
        return window_for(self.run_date, self.lookback)

    @property
    def databases(self) -> tuple[io.Database, ...]:
        return (self.primary, *self.peers)

    def horizon(self, as_of: datetime) -> datetime | None:
        """Requests received before this may be pruned on one side already (each database
        prunes on its own phase, and may while we read): the retention before ``as_of``,
        plus the skew margin for the clocks and the run's own duration. ``None``: no
        retention, nothing pruned."""
        if self.retention is None:
            return None
        return as_of - self.retention + self.skew_margin


@dataclass
class JobResult:
    window: Window
    as_of: datetime
    counts: dict[str, int]
    discrepancies: list[Discrepancy]
    modifications: dict[str, int]
    duration_seconds: float
    truncated: bool = False
    databases: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, Any] | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def status(self) -> str:
        return "discrepancies" if self.total else "clean"

    def counts_json(self) -> dict[str, Any]:
        """What goes into ``reconciliation_runs.counts``."""
        return {
            **self.counts,
            "total": self.total,
            "stored": len(self.discrepancies),
            "truncated": self.truncated,
            "modifications": self.modifications,
            "databases": self.databases,
            "skipped": self.skipped,
            "as_of": self.as_of.isoformat(),
            "duration_seconds": round(self.duration_seconds, 3),
        }


def window_for(run_date: date, lookback: timedelta) -> Window:
    start = datetime.combine(run_date, dtime(0), tzinfo=UTC)
    return Window(start=start - lookback, end=start + timedelta(days=1))


def read_extents(
    spark: SparkSession, opts: JobOptions, as_of: datetime
) -> dict[str, io.Extent]:
    """Per database, the window's count and the reads' bounds (one query each)."""
    lo, hi = io.window_range(opts.window, opts.skew_margin)
    horizon = opts.horizon(as_of)
    return {
        db.label: io.read_extent(spark, db, opts.window, lo, hi, horizon)
        for db in opts.databases
    }


def skipped_checks(
    opts: JobOptions, as_of: datetime, extents: dict[str, io.Extent]
) -> dict[str, Any] | None:
    """What the run's record says about the part of the window it could not check: the
    missing checks before the pruning horizon (None when the window is younger)."""
    horizon = opts.horizon(as_of)
    if horizon is None or not opts.peers or horizon <= opts.window.start:
        return None
    return {
        "checks": ["missing_in_peer", "missing_in_primary"],
        "received_before": horizon.isoformat(),
        "retention_days": opts.retention.total_seconds() / 86400 if opts.retention else None,
        "reason": "older than the retention: either database may have pruned it already",
        "requests": {label: e.unchecked for label, e in extents.items()},
    }


def compared_buckets(
    spark: SparkSession, opts: JobOptions
) -> dict[str, frozenset[int] | None]:
    """Per peer, the buckets of ``request_id`` (:func:`io.read_digests`) whose requests
    the comparison with the primary reads row by row; ``None``: all of them, when more
    than :data:`MAX_COMPARED_BUCKETS` differ (the filter would save little)."""
    from pyspark.sql import functions as F

    if not opts.peers:
        return {}
    lo, hi = io.window_range(opts.window, opts.skew_margin)
    digests = {db.label: io.read_digests(spark, db, lo, hi) for db in opts.databases}
    frames = [
        transforms.differing_buckets(digests[opts.primary.label], digests[peer.label])
        .withColumn("peer", F.lit(peer.label))
        for peer in opts.peers
    ]
    found: dict[str, set[int]] = {peer.label: set() for peer in opts.peers}
    for row in reduce(lambda a, b: a.unionByName(b), frames).collect():
        found[row["peer"]].add(int(row["bucket"]))
    return {
        label: frozenset(b) if len(b) <= MAX_COMPARED_BUCKETS else None
        for label, b in found.items()
    }


def build_discrepancies(
    spark: SparkSession,
    opts: JobOptions,
    as_of: datetime,
    extents: dict[str, io.Extent],
    buckets: dict[str, frozenset[int] | None],
) -> DataFrame:
    """Every check over every database, as one lazy DataFrame (``extents`` from
    :func:`read_extents`, ``buckets`` from :func:`compared_buckets`)."""
    window = opts.window
    cutoff = as_of - opts.stuck_after
    lo, hi = io.window_range(window, opts.skew_margin)
    frames: list[DataFrame] = []
    for db in opts.databases:
        extent = extents[db.label]
        # One partition: the check's filters go to PostgreSQL, which finds the few
        # IN_PROGRESS rows through its partial index.
        m = io.read_modifications(spark, db, lo, hi, 1, extent.modifications)
        frames.append(
            transforms.stuck_in_progress(m, window=window, inflight_cutoff=cutoff, source=db.label)
        )
        frames.append(
            transforms.entity_drift(
                io.read_entities(spark, db, opts.partitions),
                io.read_entity_modifications(spark, db, opts.partitions, extent),
                inflight_cutoff=cutoff,
                source=db.label,
            )
        )
    frames += [_compared(spark, opts, peer, extents, buckets[peer.label], window, cutoff,
                         as_of) for peer in opts.peers]
    return transforms.union_discrepancies(frames)


def _compared(spark: SparkSession, opts: JobOptions, peer: Any, extents: dict[str, io.Extent],
              only: frozenset[int] | None, window: Any, cutoff: datetime,
              as_of: datetime) -> DataFrame:
    """The cross-database checks of the primary against ``peer``."""
    # A few buckets: one scan each side returns their rows.
    history = extents[opts.primary.label].history, extents[peer.label].history
    parts = (
        io.read_partitions(max(io.span(h) for h in history), opts.partitions)
        if only is None
        else 1
    )
    # Without a time bound: a request of the window the other side received late
    # (or early) is looked up by request_id over all it holds.
    sides = [
        io.read_compared(spark, db, parts, extents[db.label].history, only)
        for db in (opts.primary, peer)
    ]
    return transforms.compare_databases(
        *sides,
        window=window,
        inflight_cutoff=cutoff,
        peer_label=peer.label,
        checked_from=opts.horizon(as_of),
    )


def shuffle_partitions(opts: JobOptions, extents: dict[str, io.Extent]) -> int:
    """Shuffle partitions for the rows this run reads: the largest table read whole (a
    database's ``modifications`` plus checkpoints, by ``id`` span) over
    :data:`ROWS_PER_SHUFFLE_PARTITION`, at least ``--partitions``. Adaptive execution
    coalesces what turns out smaller; the joins are Spark's choice (a sort-merge join
    spills where a hash table cannot)."""
    rows = 0
    for e in extents.values():
        lo, hi = e.entity_modifications
        if lo is not None and hi is not None:
            rows = max(rows, int(hi) - int(lo) + 1)
    return max(opts.partitions, min(MAX_SHUFFLE_PARTITIONS, -(-rows // ROWS_PER_SHUFFLE_PARTITION)))


def chunk_rows(spark: SparkSession) -> int:
    """Rows per fetch to the driver, so that no fetch nears ``spark.driver.maxResultSize``
    (0 = unlimited)."""
    limit = spark.sparkContext.getConf().get("spark.driver.maxResultSize", "1g")
    jvm: Any = spark.sparkContext._jvm
    try:
        size = int(jvm.org.apache.spark.network.util.JavaUtils.byteStringAsBytes(limit))
    except Exception:  # no JVM to ask (e.g. Spark Connect): Spark's default
        size = 1 << 30
    if size <= 0:
        size = 1 << 30
    return max(100, min(50_000, size // 2 // ROW_BUDGET_BYTES))


def first_in_order(spark: SparkSession, disc: DataFrame, n: int) -> list[Any]:
    """The first ``n`` discrepancies in :data:`ORDER`, globally sorted, brought to the
    driver in chunks of :func:`chunk_rows` rows.

    ``orderBy().limit(n).collect()`` would bring each partition's own first ``n`` to the
    driver at once (gigabytes past ``spark.driver.maxResultSize`` in a mass incident).
    Here the top ``n`` are merged on an executor, numbered, cached, and fetched a chunk
    at a time."""
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    if n <= 0:
        return []
    numbered = (
        disc.orderBy(*ORDER)
        .limit(n)
        .withColumn("_n", F.row_number().over(W.orderBy(*ORDER)))
        .persist()
    )
    try:
        step = chunk_rows(spark)
        rows: list[Any] = []
        for first in range(1, n + 1, step):
            chunk = numbered.where(F.col("_n").between(first, first + step - 1)).collect()
            rows += sorted(chunk, key=lambda r: int(r["_n"]))
        return rows
    finally:
        numbered.unpersist()


def run(spark: SparkSession, opts: JobOptions, as_of: datetime) -> JobResult:
    """Run every check; ``as_of`` is the primary database's clock at the start."""
    t0 = time.monotonic()
    window = opts.window
    extents = read_extents(spark, opts, as_of)
    modifications = {label: e.window_count for label, e in extents.items()}
    saved = spark.conf.get("spark.sql.shuffle.partitions") or "200"
    spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions(opts, extents)))
    try:
        buckets = compared_buckets(spark, opts)
        disc = build_discrepancies(spark, opts, as_of, extents, buckets).persist()
        try:
            # Count first (a handful of rows whatever the volume), then fetch a bounded,
            # globally sorted sample; the full set goes to --output.
            counts = {kind: 0 for kind in KINDS}
            for row in transforms.count_by_kind(disc).collect():
                counts[row["kind"]] = int(row["n"])
            total = sum(counts.values())
            rows = first_in_order(spark, disc, min(total, opts.max_discrepancies))
            if opts.output:
                disc.write.mode("overwrite").json(
                    f"{opts.output.rstrip('/')}/run_date={opts.run_date}"
                )
        finally:
            disc.unpersist()
            spark.catalog.clearCache()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", saved)
    return JobResult(
        window=window,
        as_of=as_of,
        counts=counts,
        discrepancies=[
            (r["kind"], r["request_id"], r["entity_id"], r["source"], r["details"]) for r in rows
        ],
        modifications=modifications,
        duration_seconds=time.monotonic() - t0,
        truncated=total > len(rows),
        databases={db.label: db.redacted for db in opts.databases},
        skipped=skipped_checks(opts, as_of, extents),
    )

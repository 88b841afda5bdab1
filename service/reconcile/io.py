"""The thin I/O of the job: partitioned JDBC reads (extract) and the results write (load).

Reads run in read-only sessions (the job never changes the data it checks) and stream
with a fetch size instead of materialising whole partitions in the driver. Credentials
travel as JDBC properties, never inside the URL, so neither Spark's plans nor our logs
can print them; :func:`service.secrets.redact_dsn` is the only form of a DSN we output.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

from service.reconcile.transforms import (
    DELETE,
    ENTITY_MODIFICATIONS_SCHEMA,
    MODIFICATIONS_SCHEMA,
    UPSERT,
    Window,
)
from service.secrets import redact_dsn

if TYPE_CHECKING:
    import asyncpg
    from pyspark.sql import DataFrame, SparkSession


# Distinct from the migration lock: two sidecars contend for this one, per database.
RECONCILE_LOCK_KEY = 0x5151_2EC0
FETCH_SIZE = 10_000
#: The cross-database comparison splits ``request_id`` into this many buckets (a power of
#: two) and reads row by row only the buckets whose digests differ (:func:`read_digests`).
DIGEST_BUCKETS = 4_096
_BUCKET = f"(hashtext(request_id) & {DIGEST_BUCKETS - 1})"
#: Rows per JDBC read partition of the entity history (:func:`read_partitions`).
ROWS_PER_READ_PARTITION = 250_000


class DsnError(ValueError):
    """A database URL the job cannot turn into a JDBC connection."""


@dataclass(frozen=True)
class Database:
    """One database to read: ``primary`` or ``peerN``, with its JDBC coordinates."""

    label: str
    dsn: str = field(repr=False)

    @property
    def redacted(self) -> str:
        return redact_dsn(self.dsn)

    @property
    def jdbc_url(self) -> str:
        return jdbc_target(self.dsn)[0]

    def properties(self) -> dict[str, str]:
        props = jdbc_target(self.dsn)[1]
        props.update(
            driver="org.postgresql.Driver",
            fetchsize=str(FETCH_SIZE),
            # Belt and braces for "read-only on the data it checks".
            sessionInitStatement="SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
            ApplicationName="sqs-ingest-reconcile",
        )
        return props


def jdbc_target(dsn: str) -> tuple[str, dict[str, str]]:
    """``postgresql://user:pass@host:port/db?sslmode=…`` → (JDBC URL, properties).

    User and password go to the properties; query parameters (``sslmode``…) too, since
    pgJDBC accepts the libpq names for the ones that matter.
    """
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise DsnError(f"not a postgresql:// URL: {redact_dsn(dsn)}")
    if not parts.hostname:
        raise DsnError(f"database URL needs a host: {redact_dsn(dsn)}")
    host = parts.hostname
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    port = parts.port or 5432
    db = unquote(parts.path.lstrip("/")) or unquote(parts.username or "postgres")
    props: dict[str, str] = dict(parse_qsl(parts.query))
    if parts.username:
        props["user"] = unquote(parts.username)
    if parts.password is not None:
        props["password"] = unquote(parts.password)
    return f"jdbc:postgresql://{host}:{port}/{db}", props


def _ts(value: datetime) -> str:
    """A timestamptz literal; values come from our own datetimes, never from user text."""
    return f"'{value.isoformat()}'::timestamptz"


def _read_one(spark: SparkSession, db: Database, sql: str) -> Any:
    return (
        spark.read.format("jdbc")
        .option("url", db.jdbc_url)
        .options(**db.properties())
        .option("query", sql)
        .load()
        .first()
    )


def _partitioned(
    spark: SparkSession,
    db: Database,
    subquery: str,
    bounds: tuple[int | None, int | None],
    partitions: int,
    schema: str,
) -> DataFrame:
    """Read ``subquery`` split on ``id`` into ``partitions`` ranges between ``bounds``."""
    lo, hi = bounds
    if lo is None or hi is None:  # nothing in range: an empty frame of the right shape
        return spark.createDataFrame([], schema)
    return spark.read.jdbc(
        db.jdbc_url,
        f"({subquery}) AS src",
        column="id",
        lowerBound=int(lo),
        upperBound=int(hi) + 1,
        numPartitions=max(1, min(partitions, int(hi) - int(lo) + 1)),
        properties=db.properties(),
    )


@dataclass(frozen=True)
class Extent:
    """What the reads of one database need to know first, from one statement: the rows
    received in the window (the summary's count) and the ``id`` bounds that split the
    partitioned reads.

    Attributes:
        window_count: ``modifications`` received in the window.
        modifications: min/max ``id`` of the rows received in the read range (the window
            plus the skew margin); ``(None, None)`` when there are none.
        entity_modifications: min/max ``id`` over ``modifications`` and the checkpoints'
            ``modification_id`` (primary-key indexes; checkpoints keep their older ids).
        history: min/max ``id`` of the whole ``modifications`` table (the bounds of
            :func:`read_compared`).
        unchecked: ``modifications`` received in the window before the pruning horizon
            (their missing checks are skipped).
        checkpoints: min/max ``modification_id`` of ``entity_checkpoints``.
        checkpoint_count: its rows.
    """

    window_count: int
    modifications: tuple[int | None, int | None]
    entity_modifications: tuple[int | None, int | None]
    history: tuple[int | None, int | None] = (None, None)
    unchecked: int = 0
    checkpoints: tuple[int | None, int | None] = (None, None)
    checkpoint_count: int = 0


def _in_range(start: datetime, end: datetime) -> str:
    return f"received_at >= {_ts(start)} AND received_at < {_ts(end)}"


def read_extent(
    spark: SparkSession,
    db: Database,
    window: Window,
    start: datetime,
    end: datetime,
    horizon: datetime | None = None,
) -> Extent:
    """The window's count and both partitioned reads' bounds in one query (one JDBC schema
    lookup and one Spark job instead of three of each). ``[start, end)`` is the range
    :func:`read_modifications` reads; the scan covers it and the window alike."""
    scan = _in_range(min(start, window.start), max(end, window.end))
    read = _in_range(start, end)
    in_window = _in_range(window.start, window.end)
    old = f"{in_window} AND received_at < {_ts(horizon)}" if horizon else "FALSE"
    sql = (
        "SELECT w.n, w.lo, w.hi, least(m.lo, c.lo) AS e_lo, greatest(m.hi, c.hi) AS e_hi,"
        " m.lo AS m_lo, m.hi AS m_hi, w.old, c.lo AS c_lo, c.hi AS c_hi, c.n AS c_n FROM"
        f" (SELECT count(*) FILTER (WHERE {in_window}) AS n,"
        f"  count(*) FILTER (WHERE {old}) AS old,"
        f"  min(id) FILTER (WHERE {read}) AS lo, max(id) FILTER (WHERE {read}) AS hi"
        f"  FROM modifications WHERE {scan}) w,"
        " (SELECT min(id) AS lo, max(id) AS hi FROM modifications) m,"
        " (SELECT min(modification_id) AS lo, max(modification_id) AS hi, count(*) AS n"
        "  FROM entity_checkpoints) c"
    )
    row = _read_one(spark, db, sql)
    return Extent(
        window_count=int(row[0]),
        modifications=(row[1], row[2]),
        entity_modifications=(row[3], row[4]),
        history=(row[5], row[6]),
        unchecked=int(row[7]),
        checkpoints=(row[8], row[9]),
        checkpoint_count=int(row[10]),
    )


def read_modifications(
    spark: SparkSession,
    db: Database,
    start: datetime,
    end: datetime,
    partitions: int,
    bounds: tuple[int | None, int | None],
    buckets: Collection[int] | None = None,
) -> DataFrame:
    """``modifications`` received in ``[start, end)``, columns of MODIFICATIONS_SCHEMA;
    ``bounds`` from :func:`read_extent` over the same range. With ``buckets``, only the
    requests in those buckets of :func:`read_digests` (none: an empty frame, no query)."""
    where = _in_range(start, end)
    if buckets is not None:
        if not buckets:
            bounds = (None, None)
        where += f" AND {_BUCKET} = ANY ('{{{','.join(map(str, sorted(buckets)))}}}'::int[])"
    sub = (
        "SELECT id, request_id, request_type, status, payload_sha256, owner, received_at,"
        f" completed_at FROM modifications WHERE {where}"
    )
    return _partitioned(spark, db, sub, bounds, partitions, MODIFICATIONS_SCHEMA)


def read_compared(
    spark: SparkSession,
    db: Database,
    partitions: int,
    bounds: tuple[int | None, int | None],
    buckets: Collection[int] | None = None,
) -> DataFrame:
    """The rows the cross-database comparison joins: ``modifications`` of the given
    buckets of :func:`read_digests` (``None``: every row), whenever received; ``bounds``:
    :attr:`Extent.history`.

    No time bound: the side that lacks a request of the window is looked up by
    ``request_id`` over everything it holds, so a peer that received it hours after the
    window (a regional outage, a backlog) is not reported missing. The buckets keep this
    small: only those whose digests over the read range differ are read row by row.
    """
    where = "TRUE"
    if buckets is not None:
        if not buckets:
            bounds = (None, None)
        where = f"{_BUCKET} = ANY ('{{{','.join(map(str, sorted(buckets)))}}}'::int[])"
    sub = (
        "SELECT id, request_id, request_type, status, payload_sha256, owner, received_at,"
        f" completed_at FROM modifications WHERE {where}"
    )
    return _partitioned(spark, db, sub, bounds, partitions, MODIFICATIONS_SCHEMA)


def read_digests(spark: SparkSession, db: Database, start: datetime, end: datetime) -> DataFrame:
    """Per bucket of ``request_id``, the ``modifications`` received in ``[start, end)``
    summed up by PostgreSQL in one scan: ``bucket int, n bigint, digest string`` (the sum
    of a 64-bit hash of each row's ``request_id``, ``status`` and ``payload_sha256``).

    Two databases holding the same requests with the same status and payload in a bucket
    have the same ``n`` and ``digest`` there, so none of the cross-database checks can fail
    for those requests, and only the other buckets need reading row by row. Unequal
    digests for equal rows (``hashtext`` differs between platforms) only cost reading
    more; equal digests for unequal rows take a collision of the 64-bit sums.
    """
    row = "request_id || chr(31) || status || chr(31) || coalesce(payload_sha256, chr(30))"
    sql = (
        f"SELECT {_BUCKET} AS bucket, count(*) AS n,"
        f" sum(hashtextextended({row}, 0))::text AS digest"
        f" FROM modifications WHERE {_in_range(start, end)} GROUP BY 1"
    )
    return spark.read.jdbc(db.jdbc_url, f"({sql}) AS src", properties=db.properties())


def read_partitions(rows: int, at_least: int = 1) -> int:
    """JDBC read partitions for about ``rows`` rows: one per :data:`ROWS_PER_READ_PARTITION`
    (each partition is one transaction on the database: a short one holds back vacuum
    for less), at least ``at_least``."""
    return max(at_least, -(-rows // ROWS_PER_READ_PARTITION))


def span(bounds: tuple[int | None, int | None]) -> int:
    """Rows an ``id`` range may hold (0 when there is none)."""
    lo, hi = bounds
    return 0 if lo is None or hi is None else int(hi) - int(lo) + 1


def read_entity_modifications(spark: SparkSession, db: Database, partitions: int,
                              extent: Extent) -> DataFrame:
    """Every ``COMPLETED`` entity modification (all history: the state depends on all of it),
    plus, per entity, the checkpoint the pruner left for the ones it deleted; ``extent``
    from :func:`read_extent`.

    Two reads, each split by its own ``id`` range and sized from its rows: checkpoints keep
    the old ids of what was pruned, so one range over both would put most rows in a few
    partitions. ``modifications`` get at least ``partitions``.

    ``data`` travels as an md5 of its jsonb text: jsonb prints canonically (sorted keys, no
    whitespace), so equal documents hash equal, and the shuffle stays small.

    A checkpoint row is the winner of replay_entities' order among the entity's pruned
    modifications (service/adapters/prune.py writes it in the transaction that deletes them, under
    its original id). The winner of a union is the winner of the winners, so the replay
    over checkpoints plus what remains equals the replay over the whole history.
    """
    types = f"('{UPSERT}', '{DELETE}')"
    mods = (
        "SELECT id, request_id, request_type, payload->>'entity_id' AS entity_id,"
        " CASE WHEN jsonb_typeof(payload->'version') = 'number'"
        "      THEN (payload->>'version')::numeric::bigint END AS version,"
        " md5((payload->'data')::text) AS data_md5, completed_at,"
        " CASE WHEN jsonb_typeof(result->'applied') = 'boolean'"
        "      THEN (result->>'applied')::boolean END AS applied"
        f" FROM modifications WHERE status = 'COMPLETED' AND request_type IN {types}"
    )
    checkpoints = (
        "SELECT modification_id AS id, request_id, request_type, entity_id, version,"
        " data_md5, completed_at, applied FROM entity_checkpoints"
    )
    return _partitioned(
        spark, db, mods, extent.history,
        read_partitions(span(extent.history), partitions), ENTITY_MODIFICATIONS_SCHEMA,
    ).unionByName(_partitioned(
        spark, db, checkpoints, extent.checkpoints,
        read_partitions(extent.checkpoint_count), ENTITY_MODIFICATIONS_SCHEMA,
    ))


def read_entities(spark: SparkSession, db: Database, partitions: int) -> DataFrame:
    """All of ``entities``. Its key is text, so partitions are hash buckets of it."""
    n = max(1, partitions)
    predicates = [f"mod(abs(hashtext(entity_id)::bigint), {n}) = {i}" for i in range(n)]
    table = (
        "(SELECT entity_id, version, deleted, md5(data::text) AS data_md5, request_id,"
        " updated_at FROM entities) AS src"
    )
    return spark.read.jdbc(db.jdbc_url, table, predicates=predicates, properties=db.properties())


# --- load: asyncpg on the primary ------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    run_date: date
    window_start: datetime
    window_end: datetime
    status: str
    counts: dict[str, Any]
    started_at: datetime
    finished_at: datetime
    discrepancies: list[tuple[str, str | None, str | None, str | None, str | None]]


async def db_now(conn: asyncpg.Connection) -> datetime:
    """The database clock: cutoffs are compared with timestamps that clock wrote."""
    value: datetime = await conn.fetchval("SELECT now()")
    return value


async def try_lock(conn: asyncpg.Connection) -> bool:
    """Session advisory lock: one reconciliation per primary database at a time."""
    return bool(await conn.fetchval("SELECT pg_try_advisory_lock($1)", RECONCILE_LOCK_KEY))


async def holds_lock(conn: asyncpg.Connection) -> bool:
    """Whether this session still holds the reconcile lock."""
    return bool(await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND pid = pg_backend_pid() AND ((classid::bigint << 32) | objid::bigint) = $1)",
        RECONCILE_LOCK_KEY,
    ))


async def unlock(conn: asyncpg.Connection) -> None:
    await conn.execute("SELECT pg_advisory_unlock($1)", RECONCILE_LOCK_KEY)


async def run_exists(conn: asyncpg.Connection, run_date: date) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM reconciliation_runs WHERE run_date = $1)", run_date
        )
    )


async def write_results(conn: asyncpg.Connection, record: RunRecord) -> int:
    """Replace the results of ``record.run_date`` with this run's, atomically; → run_id.

    Readers never see a date with no results or with two runs' worth: the delete of the
    previous runs (discrepancies cascade) and the inserts commit together.
    """
    async with conn.transaction():
        await conn.execute("DELETE FROM reconciliation_runs WHERE run_date = $1", record.run_date)
        run_id: int = await conn.fetchval(
            "INSERT INTO reconciliation_runs"
            " (run_date, window_start, window_end, status, counts, started_at, finished_at)"
            " VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7) RETURNING run_id",
            record.run_date,
            record.window_start,
            record.window_end,
            record.status,
            json.dumps(record.counts),
            record.started_at,
            record.finished_at,
        )
        if record.discrepancies:
            await conn.copy_records_to_table(
                "reconciliation_discrepancies",
                records=[(run_id, *row) for row in record.discrepancies],
                columns=["run_id", "kind", "request_id", "entity_id", "source", "details"],
            )
    return run_id


async def prune_runs(conn: asyncpg.Connection, retention_days: float) -> int:
    """Delete the runs that finished more than ``retention_days`` ago (their discrepancies
    cascade): the reconcile role alone writes these tables, so it prunes them too."""
    status = await conn.execute(
        "DELETE FROM reconciliation_runs WHERE finished_at < now() - make_interval(secs => $1)",
        retention_days * 86_400.0)
    return int(status.split()[-1])


def window_range(window: Window, margin: timedelta) -> tuple[datetime, datetime]:
    """The range read for cross-database checks: the window plus a clock-skew margin."""
    return window.start - margin, window.end + margin

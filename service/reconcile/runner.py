"""One reconciliation run for a date: take the lock, run the Spark job, write and report."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import date, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import asyncpg

from service.reconcile import io, job, log
from service.reconcile.job import JobOptions, JobResult
from service.reconcile.metrics import RunMetrics
from service.reconcile.parser import Args
from service.reconcile.session import spark_session
from service.secrets import safe

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

EXIT_CLEAN, EXIT_DISCREPANCIES, EXIT_FAILED = 0, 1, 3


class _Written(NamedTuple):
    run_id: int
    result: JobResult


class LockLost(RuntimeError):
    """The reconcile lock's session ended during the run and another run holds it now."""


#: The lock's session sits idle for the whole Spark run: the server sends TCP keepalives
#: on it (a NAT or load balancer drops an idle flow silently); a server-wide
#: idle_session_timeout is switched off for it (:func:`connect_for_lock`).
LOCK_SESSION_SETTINGS = {
    "tcp_keepalives_idle": "60",
    "tcp_keepalives_interval": "10",
    "tcp_keepalives_count": "6",
    "application_name": "sqs-ingest-reconcile",
}


async def connect_for_lock(dsn: str) -> asyncpg.Connection:
    conn: asyncpg.Connection = await asyncpg.connect(
        dsn, server_settings=LOCK_SESSION_SETTINGS
    )
    if conn.get_server_version().major >= 14:  # the setting's first release
        await conn.execute("SET idle_session_timeout = 0")
    return conn


def summary(run_id: int | None, opts: JobOptions, result: JobResult) -> dict[str, Any]:
    """The JSON summary printed on stdout at the end of a completed run."""
    return {
        "run_id": run_id,
        "run_date": opts.run_date.isoformat(),
        "status": result.status,
        "window_start": result.window.start.isoformat(),
        "window_end": result.window.end.isoformat(),
        "counts": result.counts,
        "total": result.total,
        "stored": len(result.discrepancies),
        "truncated": result.truncated,
        "modifications": result.modifications,
        "databases": result.databases,
        "skipped": result.skipped,
        "duration_seconds": round(result.duration_seconds, 3),
    }


class Runner:
    """Runs the job once for a date: lock, check, write, report."""

    def __init__(self, args: Args, metrics: RunMetrics) -> None:
        self.args = args
        self.metrics = metrics
        self._spark: SparkSession | None = None
        #: The connections that held the lock in this run (the last one holds it now).
        self._held: list[asyncpg.Connection] = []

    def cancel(self) -> None:
        """SIGTERM during a run: stop the Spark jobs; the run then fails without writing."""
        spark = self._spark
        if spark is not None:
            with contextlib.suppress(Exception):
                spark.sparkContext.cancelAllJobs()

    async def run(self, run_date: date, *, skip_if_done: bool) -> int:
        """Exit code of one run: clean, discrepancies, or failed (skipped counts as clean
        for the sidecar, ``skip_if_done``, and as failed for a one-off run)."""
        opts = self.args.options(run_date)
        bound = log().bind(run_date=run_date.isoformat())
        t0 = time.monotonic()
        try:
            conn = await connect_for_lock(opts.primary.dsn)
        except (OSError, asyncpg.PostgresError) as exc:
            bound.error(
                "reconcile_failed", stage="connect", database=opts.primary.redacted,
                error=_redacted_error(exc, opts)
            )
            self.metrics.observe("failed", time.monotonic() - t0, None)
            return EXIT_FAILED
        try:
            outcome = await self._locked(conn, opts, bound, skip_if_done=skip_if_done)
        except Exception as exc:
            bound.error(
                "reconcile_failed", error=_redacted_error(exc, opts), exc_type=type(exc).__name__
            )
            self.metrics.observe("failed", time.monotonic() - t0, None)
            return EXIT_FAILED
        finally:
            for held in (conn, *self._held):
                with contextlib.suppress(Exception):
                    await held.close()
            self._held = []
        if isinstance(outcome, int):
            return outcome
        return self._report(opts, outcome, time.monotonic() - t0, bound)

    async def _locked(
        self, conn: asyncpg.Connection, opts: JobOptions, bound: Any, *, skip_if_done: bool
    ) -> int | _Written:
        """Under the reconcile lock: the results written, or the exit code of a skip."""
        if not await io.try_lock(conn):
            bound.warning("reconcile_skipped", reason="another reconciliation holds the lock")
            self.metrics.observe("skipped", 0.0, None)
            return EXIT_CLEAN if skip_if_done else EXIT_FAILED
        self._held = [conn]
        try:
            if skip_if_done and await io.run_exists(conn, opts.run_date):
                bound.info("reconcile_skipped", reason="date already reconciled")
                self.metrics.observe("skipped", 0.0, None)
                return EXIT_CLEAN
            return await self._check_and_write(conn, opts, bound)
        finally:
            with contextlib.suppress(Exception):
                await io.unlock(self._held[-1])

    async def _relock(self, conn: asyncpg.Connection, opts: JobOptions, bound: Any
                      ) -> asyncpg.Connection:
        """Before writing: the connection that still holds the lock. Its session may have
        ended during the Spark run (idle timeout, failover, terminated); then the lock is
        taken again on a new one, or, when another run took it meanwhile, the run fails
        (:class:`LockLost`): two runs never write one date concurrently."""
        with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            if not conn.is_closed() and await io.holds_lock(conn):
                return conn
        bound.warning("reconcile_lock_session_lost", action="taking the lock again")
        fresh = await connect_for_lock(opts.primary.dsn)
        self._held.append(fresh)
        if not await io.try_lock(fresh):
            raise LockLost(
                "the reconcile lock's session ended during the run and another"
                " reconciliation holds the lock now: results not written"
            )
        return fresh

    async def _check_and_write(
        self, conn: asyncpg.Connection, opts: JobOptions, bound: Any
    ) -> _Written:
        started_at = await io.db_now(conn)
        bound.info(
            "reconcile_started",
            window_start=opts.window.start.isoformat(),
            window_end=opts.window.end.isoformat(),
            databases={db.label: db.redacted for db in opts.databases},
        )
        result = await asyncio.to_thread(self._run_spark, opts, started_at)
        conn = await self._relock(conn, opts, bound)
        finished_at = await io.db_now(conn)
        run_id = await io.write_results(
            conn,
            io.RunRecord(
                run_date=opts.run_date,
                window_start=result.window.start,
                window_end=result.window.end,
                status=result.status,
                counts=result.counts_json(),
                started_at=started_at,
                finished_at=finished_at,
                discrepancies=result.discrepancies,
            ),
        )
        pruned = await io.prune_runs(conn, self.args.ns.runs_retention_days)
        if pruned:
            bound.info("reconcile_pruned", runs=pruned)
        return _Written(run_id, result)

    def _report(self, opts: JobOptions, written: _Written, duration: float, bound: Any) -> int:
        result = written.result
        self.metrics.observe(result.status, duration, result)
        out = summary(written.run_id, opts, result)
        bound.info(
            "reconcile_finished", **{k: out[k] for k in ("run_id", "status", "total", "counts")}
        )
        print(json.dumps(out), flush=True)
        return EXIT_DISCREPANCIES if result.total else EXIT_CLEAN

    def _run_spark(self, opts: JobOptions, as_of: datetime) -> JobResult:
        spark, owned = spark_session(
            self.args.ns.master, self.args.ns.jars, shuffle_partitions=opts.partitions
        )
        self._spark = spark
        try:
            return job.run(spark, opts, as_of)
        finally:
            self._spark = None
            if owned:
                spark.stop()


def _redacted_error(exc: BaseException, _opts: JobOptions) -> str:
    """The error's first line with every password this process knows blanked (drivers like
    to echo URLs; :func:`service.secrets.safe`)."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return safe(text)[:2000]

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
            conn = await asyncpg.connect(opts.primary.dsn)
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
            with contextlib.suppress(Exception):
                await conn.close()
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
        try:
            if skip_if_done and await io.run_exists(conn, opts.run_date):
                bound.info("reconcile_skipped", reason="date already reconciled")
                self.metrics.observe("skipped", 0.0, None)
                return EXIT_CLEAN
            return await self._check_and_write(conn, opts, bound)
        finally:
            with contextlib.suppress(Exception):
                await io.unlock(conn)

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

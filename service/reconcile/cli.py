"""``sqs-ingest reconcile``: one run (CronJob, ECS task, spark-submit) or a nightly sidecar.

Exit codes: ``0`` clean, ``1`` discrepancies found, ``2`` bad arguments or configuration,
``3`` the run could not complete (database unreachable, Spark failure, another
reconciliation holds the lock). In ``--schedule`` mode the process stays up and exits
``0`` on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Any

import structlog

from service.reconcile import KINDS

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from pyspark.sql import SparkSession

    from service.reconcile.job import JobOptions, JobResult


def _log() -> Any:
    """A fresh logger: one cached at import would keep the stderr of the first configure."""
    return structlog.get_logger("service.reconcile")


EXIT_CLEAN, EXIT_DISCREPANCIES, EXIT_CONFIG, EXIT_FAILED = 0, 1, 2, 3
DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"
PUSH_JOB = "sqs_ingest_reconcile"


class UsageError(Exception):
    """Bad arguments/configuration: one line, exit 2."""


def _date(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a YYYY-MM-DD date: {value!r}") from None


def _positive(kind: type[int] | type[float]):  # type: ignore[no-untyped-def]
    def parse(value: str) -> int | float:
        try:
            n = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0: {value!r}")
        return n

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sqs-ingest reconcile",
        description="Reconcile modifications/entities across databases (PySpark).",
    )
    p.add_argument("--date", type=_date, help="UTC day to check (default: yesterday)")
    p.add_argument(
        "--database-url",
        default=None,
        help="primary database, postgresql://… (default: $INGEST_DATABASE_URL)",
    )
    p.add_argument(
        "--peer-url", action="append", default=[], help="peer database to compare (repeatable)"
    )
    p.add_argument("--lookback-hours", type=_positive(float), default=24.0)
    p.add_argument("--stuck-after", type=_positive(float), default=60.0, help="minutes")
    p.add_argument(
        "--skew-minutes",
        type=_positive(float),
        default=60.0,
        help="margin read around the window when looking a request up in the other database",
    )
    p.add_argument("--master", default=None, help="Spark master (default local[*])")
    p.add_argument("--jars", default=None, help=f"extra jars, comma-separated ({DEFAULT_JDBC_JAR})")
    p.add_argument("--partitions", type=_positive(int), default=8, help="JDBC read partitions")
    p.add_argument("--max-discrepancies", type=_positive(int), default=100_000)
    p.add_argument("--output", default=None, help="directory for all discrepancies (JSON lines)")
    p.add_argument("--pushgateway", default=None, help="Prometheus Pushgateway URL")
    p.add_argument("--schedule", default=None, help='sidecar mode, e.g. "0 3 * * *" (UTC)')
    p.add_argument("--metrics-port", type=_positive(int), default=9103, help="sidecar metrics")
    p.add_argument("--log-format", choices=["json", "console"], default=None)
    return p


@dataclass(frozen=True)
class Args:
    ns: argparse.Namespace

    def options(self, run_date: date) -> JobOptions:
        from service.reconcile.io import Database, DsnError, jdbc_target
        from service.reconcile.job import JobOptions

        primary_dsn = self.ns.database_url or os.environ.get("INGEST_DATABASE_URL")
        if not primary_dsn:
            raise UsageError(
                "configuration error: --database-url or INGEST_DATABASE_URL is required"
            )
        dbs = [Database("primary", primary_dsn)] + [
            Database(f"peer{i}", url) for i, url in enumerate(self.ns.peer_url, start=1)
        ]
        for db in dbs:
            try:
                jdbc_target(db.dsn)
            except DsnError as exc:
                raise UsageError(f"configuration error: {db.label}: {exc}") from None
        return JobOptions(
            run_date=run_date,
            primary=dbs[0],
            peers=tuple(dbs[1:]),
            lookback=timedelta(hours=self.ns.lookback_hours),
            stuck_after=timedelta(minutes=self.ns.stuck_after),
            skew_margin=timedelta(minutes=self.ns.skew_minutes),
            partitions=max(1, self.ns.partitions),
            max_discrepancies=self.ns.max_discrepancies,
            output=self.ns.output,
        )


def yesterday(now: datetime | None = None) -> date:
    return ((now or datetime.now(UTC)).astimezone(UTC) - timedelta(days=1)).date()


# --- Spark -------------------------------------------------------------------------------


def spark_session(
    master: str | None, jars: str | None, shuffle_partitions: int | None = None
) -> tuple[SparkSession, bool]:
    """The session to run on, and whether we own it (and so must stop it).

    Under ``spark-submit`` the master and jars come from the submit command; a session
    that already exists in this process (tests, notebooks) is reused as it is.
    """
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if SparkContext._active_spark_context is not None:
        spark = SparkSession.builder.getOrCreate()
        spark.conf.set("spark.sql.session.timeZone", "UTC")
        return spark, False
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    builder = (
        SparkSession.builder.appName("sqs-ingest-reconcile")
        .config("spark.sql.session.timeZone", "UTC")
        # Progress bars would interleave with the JSON log lines on stderr.
        .config("spark.ui.showConsoleProgress", "false")
    )
    if master or not submitted:
        master = master or "local[*]"
        builder = builder.master(master)
        if master.startswith("local"):
            # Local mode needs no network identity; binding loopback avoids surprises in
            # containers whose hostname does not resolve, and the UI port clashing.
            builder = (
                builder.config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.enabled", "false")
            )
            if shuffle_partitions:
                # The default 200 shuffle partitions cost more in task scheduling than the
                # work itself on a few cores (measured: 47 s → 15 s at 100k rows, local[2]).
                builder = builder.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
    if jars is None and not submitted and os.path.exists(DEFAULT_JDBC_JAR):
        jars = DEFAULT_JDBC_JAR
    if jars:
        builder = builder.config("spark.jars", jars)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark, True


# --- metrics -----------------------------------------------------------------------------


class RunMetrics:
    """The sidecar's own metrics (and what is pushed to a Pushgateway)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry: CollectorRegistry = CollectorRegistry()
        ns = "sqs_ingest_reconcile"
        self.last_run = Gauge(
            f"{ns}_last_run_timestamp_seconds", "End of the last run", registry=self.registry
        )
        self.last_success = Gauge(
            f"{ns}_last_success_timestamp_seconds",
            "End of the last run that completed (clean or not)",
            registry=self.registry,
        )
        self.duration = Gauge(
            f"{ns}_last_duration_seconds", "Duration of the last run", registry=self.registry
        )
        self.discrepancies = Gauge(
            f"{ns}_discrepancies",
            "Discrepancies found by the last completed run",
            ["kind"],
            registry=self.registry,
        )
        self.modifications = Gauge(
            f"{ns}_modifications",
            "Modifications in the last run's window",
            ["database"],
            registry=self.registry,
        )
        self.runs = Counter(
            f"{ns}_runs_total", "Runs by outcome", ["outcome"], registry=self.registry
        )
        for kind in KINDS:
            self.discrepancies.labels(kind=kind)
        for outcome in ("clean", "discrepancies", "failed", "skipped"):
            self.runs.labels(outcome=outcome)

    def observe(self, outcome: str, duration: float, result: JobResult | None) -> None:
        self.runs.labels(outcome=outcome).inc()
        if outcome == "skipped":
            return
        now = time.time()
        self.last_run.set(now)
        self.duration.set(duration)
        if result is not None:
            self.last_success.set(now)
            for kind, n in result.counts.items():
                self.discrepancies.labels(kind=kind).set(n)
            for label, n in result.modifications.items():
                self.modifications.labels(database=label).set(n)

    def push(self, url: str) -> None:
        from prometheus_client import push_to_gateway

        try:
            push_to_gateway(url, job=PUSH_JOB, registry=self.registry, timeout=10)
        except OSError as exc:
            # The run's result is already stored; a monitoring hiccup must not mask it.
            _log().error("pushgateway_failed", error=str(exc))


# --- one run -----------------------------------------------------------------------------


def summary(run_id: int | None, opts: JobOptions, result: JobResult) -> dict[str, Any]:
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
        import asyncpg

        from service.reconcile import io

        opts = self.args.options(run_date)
        bound = _log().bind(run_date=run_date.isoformat())
        t0 = time.monotonic()
        try:
            conn = await asyncpg.connect(opts.primary.dsn)
        except (OSError, asyncpg.PostgresError) as exc:
            bound.error(
                "reconcile_failed", stage="connect", database=opts.primary.redacted, error=str(exc)
            )
            self.metrics.observe("failed", time.monotonic() - t0, None)
            return EXIT_FAILED
        try:
            if not await io.try_lock(conn):
                bound.warning("reconcile_skipped", reason="another reconciliation holds the lock")
                self.metrics.observe("skipped", 0.0, None)
                return EXIT_CLEAN if skip_if_done else EXIT_FAILED
            try:
                if skip_if_done and await io.run_exists(conn, run_date):
                    bound.info("reconcile_skipped", reason="date already reconciled")
                    self.metrics.observe("skipped", 0.0, None)
                    return EXIT_CLEAN
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
                        run_date=run_date,
                        window_start=result.window.start,
                        window_end=result.window.end,
                        status=result.status,
                        counts=result.counts_json(),
                        started_at=started_at,
                        finished_at=finished_at,
                        discrepancies=result.discrepancies,
                    ),
                )
            finally:
                with contextlib.suppress(Exception):
                    await io.unlock(conn)
        except Exception as exc:
            bound.error(
                "reconcile_failed", error=_redacted_error(exc, opts), exc_type=type(exc).__name__
            )
            self.metrics.observe("failed", time.monotonic() - t0, None)
            return EXIT_FAILED
        finally:
            with contextlib.suppress(Exception):
                await conn.close()
        self.metrics.observe(result.status, time.monotonic() - t0, result)
        out = summary(run_id, opts, result)
        bound.info(
            "reconcile_finished", **{k: out[k] for k in ("run_id", "status", "total", "counts")}
        )
        print(json.dumps(out), flush=True)
        return EXIT_DISCREPANCIES if result.total else EXIT_CLEAN

    def _run_spark(self, opts: JobOptions, as_of: datetime) -> JobResult:
        from service.reconcile import job

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


def _redacted_error(exc: BaseException, opts: JobOptions) -> str:
    """The error text with any password of our DSNs blanked (drivers like to echo URLs)."""
    from urllib.parse import unquote, urlsplit

    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    for db in opts.databases:
        password = urlsplit(db.dsn).password
        if password:
            text = text.replace(password, "***").replace(unquote(password), "***")
    return text[:2000]


# --- sidecar -----------------------------------------------------------------------------


def next_fire(schedule: str, after: datetime) -> datetime:
    """The next time ``schedule`` (cron, UTC) fires strictly after ``after``."""
    from croniter import croniter

    fire: datetime = croniter(schedule, after.astimezone(UTC)).get_next(datetime)
    return fire.astimezone(UTC)


def night_date(fired_at: datetime) -> date:
    """A nightly run checks the UTC day before the one it fires on."""
    return yesterday(fired_at)


async def sidecar(args: Args, metrics: RunMetrics) -> int:
    from prometheus_client import start_http_server

    schedule = args.ns.schedule
    try:
        next_fire(schedule, datetime.now(UTC))
    except (ValueError, KeyError) as exc:
        raise UsageError(f"configuration error: --schedule {schedule!r}: {exc}") from None
    args.options(yesterday())  # fail fast on bad DSNs, before waiting a day to find out

    if args.ns.metrics_port:
        start_http_server(args.ns.metrics_port, registry=metrics.registry)
    runner = Runner(args, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        _log().info("reconcile_sidecar_stopping", signal=signame)
        stop.set()
        runner.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    _log().info("reconcile_sidecar_started", schedule=schedule, metrics_port=args.ns.metrics_port)
    try:
        while not stop.is_set():
            fire_at = next_fire(schedule, datetime.now(UTC))
            _log().info("reconcile_next_run", at=fire_at.isoformat())
            delay = (fire_at - datetime.now(UTC)).total_seconds()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, delay))
            if stop.is_set():
                break
            run_date = args.ns.date or night_date(fire_at)
            code = await runner.run(run_date, skip_if_done=True)
            if args.ns.pushgateway:
                metrics.push(args.ns.pushgateway)
            _log().info("reconcile_run_exit", run_date=run_date.isoformat(), exit_code=code)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return EXIT_CLEAN


async def once(args: Args, metrics: RunMetrics) -> int:
    run_date = args.ns.date or yesterday()
    code = await Runner(args, metrics).run(run_date, skip_if_done=False)
    if args.ns.pushgateway:
        metrics.push(args.ns.pushgateway)
    return code


def main(argv: list[str]) -> int:
    """Entry point of ``sqs-ingest reconcile <argv>``; returns the exit code."""
    from service.logs import configure_logging

    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage line
        return EXIT_CLEAN if exc.code == 0 else EXIT_CONFIG
    # The sqs-ingest CLI may have configured logging already; only an explicit flag redoes it.
    if ns.log_format or not structlog.is_configured():
        fmt = ns.log_format or os.environ.get("INGEST_LOG_FORMAT", "json").lower()
        configure_logging("console" if fmt == "console" else "json")
    args = Args(ns)
    metrics = RunMetrics()
    try:
        if ns.schedule:
            return asyncio.run(sidecar(args, metrics))
        return asyncio.run(once(args, metrics))
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

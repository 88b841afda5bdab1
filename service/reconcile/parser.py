"""The command line of ``sqs-ingest reconcile``: its arguments and the job options they map to."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from service import secrets
from service.reconcile.io import Database, DsnError, jdbc_target
from service.reconcile.job import JobOptions
from service.reconcile.session import DEFAULT_JDBC_JAR
from service.settings import (
    ConfigError,
    _read_secret_file,
    check_database_tls,
    database_url_from_env,
    peer_lines,
    reconcile_peers_from_env,
)

EXIT_CONFIG = 2
#: INGEST_RETENTION_DAYS' default (service.settings.Settings.retention_days).
DEFAULT_RETENTION_DAYS = 30.0


class UsageError(Exception):
    """Bad arguments/configuration: one line, exit 2."""


def _date(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a YYYY-MM-DD date: {value!r}") from None


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(value: str) -> int | float:
        try:
            n = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0: {value!r}")
        return n

    return parse


def _retention(value: str) -> float:
    days = _positive(float)(value)
    if not days:  # 0 would delete the run just written
        raise argparse.ArgumentTypeError(f"must be > 0: {value!r}")
    return days


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
        "--peer-url",
        action="append",
        default=[],
        help="peer database to compare (repeatable). Its password shows in `ps` and in pod "
        "specs: prefer --peer-url-file or INGEST_RECONCILE_PEER_URLS(_FILE)",
    )
    p.add_argument(
        "--peer-url-file",
        default=None,
        help="file with one peer database URL per line (# comments); default: "
        "$INGEST_RECONCILE_PEER_URLS_FILE, or $INGEST_RECONCILE_PEER_URLS (one per line)",
    )
    _window_arguments(p)
    p.add_argument(
        "--retention-days",
        type=_positive(float),
        default=None,
        help="the smallest INGEST_RETENTION_DAYS of the databases (default: "
        "$INGEST_RETENTION_DAYS, else 30; 0 = never pruned): requests of the window older "
        "than it are not checked for missing_in_peer/missing_in_primary",
    )
    p.add_argument("--master", default=None, help="Spark master (default local[*])")
    p.add_argument("--jars", default=None, help=f"extra jars, comma-separated ({DEFAULT_JDBC_JAR})")
    p.add_argument("--partitions", type=_positive(int), default=8, help="JDBC read partitions")
    p.add_argument("--max-discrepancies", type=_positive(int), default=100_000)
    p.add_argument("--output", default=None, help="directory for all discrepancies (JSON lines)")
    p.add_argument("--pushgateway", default=None, help="Prometheus Pushgateway URL")
    _sidecar_arguments(p)
    p.add_argument(
        "--runs-retention-days",
        type=_retention,
        default=os.environ.get("INGEST_RECONCILE_RETENTION_DAYS") or "90",
        help="runs (and their discrepancies) finished longer ago are deleted after each run "
        "(default: $INGEST_RECONCILE_RETENTION_DAYS, else 90)",
    )
    p.add_argument("--log-format", choices=["json", "console"], default=None)
    return p


def _window_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lookback-hours", type=_positive(float), default=24.0)
    p.add_argument("--stuck-after", type=_positive(float), default=60.0, help="minutes")
    p.add_argument(
        "--skew-minutes",
        type=_positive(float),
        default=60.0,
        help="margin read around the window when looking a request up in the other database",
    )


def _sidecar_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default=None, help='sidecar mode, e.g. "0 3 * * *" (UTC)')
    p.add_argument("--metrics-port", type=_positive(int), default=9103, help="sidecar metrics")
    p.add_argument(
        "--metrics-host",
        default=os.environ.get("INGEST_RECONCILE_METRICS_HOST") or "127.0.0.1",
        help="address the sidecar metrics bind (default: $INGEST_RECONCILE_METRICS_HOST, "
        "else 127.0.0.1; the image sets 0.0.0.0)",
    )


@dataclass(frozen=True)
class Args:
    """The parsed command line, and the job options it means for one date."""

    ns: argparse.Namespace

    def options(self, run_date: date) -> JobOptions:
        if not self.ns.stuck_after > 0:
            raise UsageError(
                "configuration error: --stuck-after must be > 0 minutes (0 would report"
                " every claim still being applied as stuck)"
            )
        primary_dsn, peer_dsns = self.databases()
        dbs = [Database("primary", primary_dsn)] + [
            Database(f"peer{i}", url) for i, url in enumerate(peer_dsns, start=1)
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
            retention=self.retention(),
            partitions=max(1, self.ns.partitions),
            max_discrepancies=self.ns.max_discrepancies,
            output=self.ns.output,
        )


    def retention(self) -> timedelta | None:
        """How long the databases keep completed modifications: ``--retention-days``, else
        INGEST_RETENTION_DAYS (the daemon's setting), else its default; None: never pruned."""
        days = self.ns.retention_days
        if days is None:
            text = os.environ.get("INGEST_RETENTION_DAYS", "").strip()
            try:
                days = float(text) if text else DEFAULT_RETENTION_DAYS
            except ValueError:
                raise UsageError(
                    f"configuration error: INGEST_RETENTION_DAYS: not a number: {text!r}"
                ) from None
            if not days > 0:
                raise UsageError(
                    f"configuration error: INGEST_RETENTION_DAYS: must be > 0: {text!r}"
                )
        return timedelta(days=days) if days else None

    def databases(self) -> tuple[str, list[str]]:
        """(primary, peers) as canonical URLs, every password remembered for scrubbing.

        The primary: ``--database-url``, else INGEST_DATABASE_URL[_FILE] with
        INGEST_DATABASE_PASSWORD[_FILE] (as the daemon). Peers: ``--peer-url``, then
        ``--peer-url-file``, else INGEST_RECONCILE_PEER_URLS_FILE / _URLS.
        """
        def canonical(label: str, text: str) -> str:
            try:
                dsn = secrets.parse_dsn(text)
            except secrets.DsnError as exc:
                secrets.remember(text)
                raise UsageError(f"configuration error: {label}: {exc}") from None
            secrets.remember_dsn(dsn)
            try:
                check_database_tls(label, dsn, os.environ.get("INGEST_DATABASE_TLS"))
            except ConfigError as exc:
                raise UsageError(str(exc)) from None
            return dsn.url()

        if "PYSPARK_GATEWAY_PORT" in os.environ:  # under spark-submit
            for flag, given in (("--database-url", self.ns.database_url),
                                ("--peer-url", self.ns.peer_url)):
                if given:
                    raise UsageError(
                        f"configuration error: {flag}: the Spark UI and event log show"
                        " spark-submit's arguments; pass database URLs in"
                        " INGEST_DATABASE_URL(_FILE), --peer-url-file or"
                        " INGEST_RECONCILE_PEER_URLS(_FILE)"
                    )
        try:
            primary = (canonical("--database-url", self.ns.database_url)
                       if self.ns.database_url else database_url_from_env())
            peers = list(self.ns.peer_url)
            if self.ns.peer_url_file:
                peers += peer_lines(_read_secret_file("--peer-url-file", self.ns.peer_url_file))
            elif not peers:
                peers = reconcile_peers_from_env()
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if not primary:
            raise UsageError(
                "configuration error: --database-url or INGEST_DATABASE_URL is required"
            )
        return primary, [canonical(f"peer{i}", p) for i, p in enumerate(peers, start=1)]


def yesterday(now: datetime | None = None) -> date:
    """The UTC day before ``now`` (default: the current time)."""
    return ((now or datetime.now(UTC)).astimezone(UTC) - timedelta(days=1)).date()

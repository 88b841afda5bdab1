"""``sqs-ingest reconcile``: one run (CronJob, ECS task, spark-submit) or a nightly sidecar.

Exit codes: ``0`` clean, ``1`` discrepancies found, ``2`` bad arguments or configuration,
``3`` the run could not complete (database unreachable, Spark failure, another
reconciliation holds the lock). In ``--schedule`` mode the process stays up and exits
``0`` on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import os
import sys

import structlog

from service.observe.logs import configure_logging
from service.reconcile import preflight
from service.reconcile.metrics import RunMetrics
from service.reconcile.parser import EXIT_CONFIG, Args, UsageError, build_parser, yesterday
from service.reconcile.runner import EXIT_CLEAN, Runner
from service.reconcile.sidecar import sidecar
from service.secrets import safe


async def once(args: Args, metrics: RunMetrics) -> int:
    """One run for ``--date`` (default: yesterday, UTC), then push the metrics if asked."""
    run_date = args.ns.date or yesterday()
    code = await Runner(args, metrics).run(run_date, skip_if_done=False)
    if args.ns.pushgateway:
        metrics.push(args.ns.pushgateway)
    return code


def main(argv: list[str]) -> int:
    """Entry point of ``sqs-ingest reconcile <argv>``; returns the exit code."""
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage line
        return EXIT_CLEAN if exc.code == 0 else EXIT_CONFIG
    # The sqs-ingest CLI may have configured logging already; only an explicit flag redoes it.
    if ns.log_format or not structlog.is_configured():
        fmt = ns.log_format or os.environ.get("INGEST_LOG_FORMAT", "json").lower()
        configure_logging("console" if fmt == "console" else "json")
    if not preflight.ok(ns.jars):  # no Java, no JDBC driver: say so before Spark fails
        return EXIT_CONFIG
    args = Args(ns)
    metrics = RunMetrics()
    try:
        if ns.schedule:
            return asyncio.run(sidecar(args, metrics))
        return asyncio.run(once(args, metrics))
    except UsageError as exc:
        print(safe(str(exc)), file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

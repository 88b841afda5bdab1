"""The nightly sidecar: sleep until the cron schedule fires, run once, repeat until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from datetime import UTC, date, datetime

from service.reconcile import log
from service.reconcile.metrics import RunMetrics
from service.reconcile.parser import Args, UsageError, yesterday
from service.reconcile.runner import EXIT_CLEAN, Runner


def next_fire(schedule: str, after: datetime) -> datetime:
    """The next time ``schedule`` (cron, UTC) fires strictly after ``after``."""
    from croniter import croniter

    fire: datetime = croniter(schedule, after.astimezone(UTC)).get_next(datetime)
    return fire.astimezone(UTC)


def night_date(fired_at: datetime) -> date:
    """A nightly run checks the UTC day before the one it fires on."""
    return yesterday(fired_at)


def _validate(args: Args) -> None:
    """Fail fast on a bad schedule or bad DSNs, before waiting a day to find out."""
    schedule = args.ns.schedule
    try:
        next_fire(schedule, datetime.now(UTC))
    except (ValueError, KeyError) as exc:
        raise UsageError(f"configuration error: --schedule {schedule!r}: {exc}") from None
    args.options(yesterday())


async def sidecar(args: Args, metrics: RunMetrics) -> int:
    """Run every night on ``--schedule`` until SIGTERM/SIGINT; exit 0 then."""
    from prometheus_client import start_http_server

    _validate(args)
    schedule = args.ns.schedule
    if args.ns.metrics_port:
        start_http_server(args.ns.metrics_port, addr=args.ns.metrics_host,
                          registry=metrics.registry)
    runner = Runner(args, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signame: str) -> None:
        log().info("reconcile_sidecar_stopping", signal=signame)
        stop.set()
        runner.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    log().info("reconcile_sidecar_started", schedule=schedule, metrics_port=args.ns.metrics_port)
    try:
        while not stop.is_set():
            fire_at = next_fire(schedule, datetime.now(UTC))
            log().info("reconcile_next_run", at=fire_at.isoformat())
            delay = (fire_at - datetime.now(UTC)).total_seconds()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=max(0.0, delay))
            if stop.is_set():
                break
            run_date = args.ns.date or night_date(fire_at)
            code = await runner.run(run_date, skip_if_done=True)
            if args.ns.pushgateway:
                metrics.push(args.ns.pushgateway)
            log().info("reconcile_run_exit", run_date=run_date.isoformat(), exit_code=code)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return EXIT_CLEAN

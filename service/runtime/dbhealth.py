"""Database health: the up/down state the pollers obey, and the probe that brings it back
(reconnect with backoff, heartbeat refreshed and schema re-checked before claiming again)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from service.core.retry import Backoff
from service.core.seams import StoreSeam
from service.errors import DB_ERRORS, DatabaseBusy, DatabaseUnavailable, SchemaBehind
from service.observe import metrics

log = structlog.get_logger("sqs_ingest.worker")


class DatabaseHealth:
    """``up`` is set while the database answers and the schema is current. While it is
    clear, nothing is received (don't take messages we cannot persist)."""

    def __init__(
        self,
        store: StoreSeam,
        stop: asyncio.Event,
        on_recovered: Callable[[], Awaitable[None]],
    ) -> None:
        self.store = store
        self.stop = stop
        self.on_recovered = on_recovered
        # This worker's heartbeat, refreshed before receiving again; the worker sets it to
        # Maintenance.beat, which also registers a row pruned during a long outage.
        self.beat: Callable[[], Awaitable[object]] = store.heartbeat
        self.up = asyncio.Event()
        self.up.set()
        self.schema_ok = True
        self._probe: asyncio.Task[None] | None = None

    @property
    def is_up(self) -> bool:
        return self.up.is_set()

    def error(self, exc: BaseException) -> None:
        """A background statement failed: an outage only if the connection is gone (a GC
        pass that meets a table lock or a timeout pauses no batch)."""
        if isinstance(exc, DatabaseUnavailable | OSError) and not isinstance(exc, DatabaseBusy):
            self.down(exc)
        else:
            metrics.db_errors.inc()
            log.warning("database_statement_failed", error=f"{type(exc).__name__}: {exc}")

    def down(self, exc: BaseException) -> None:
        if not self.up.is_set():
            return
        self.up.clear()
        metrics.db_errors.inc()
        log.error("database_unavailable", error=str(exc))
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_until_up(), name="db-probe")

    def cancel(self) -> None:
        if self._probe is not None:
            self._probe.cancel()

    async def _probe_until_up(self) -> None:
        backoff = Backoff(0.5, 10.0)
        while not self.stop.is_set():
            delay = backoff.delay
            if await backoff.wait(self.stop):
                return
            if await self._recovered(delay):
                log.info("database_available")
                self.up.set()
                await self.on_recovered()
                if self.up.is_set():
                    return
                # Down again while on_recovered ran: down() saw this probe still running
                # and started none, so this one probes on (else nothing would ever set up).
                backoff.reset()

    async def _recovered(self, delay: float) -> bool:
        try:
            await self.store.ping()
        except DB_ERRORS as exc:
            metrics.db_errors.inc()
            log.warning("database_still_unavailable", error=str(exc), retry_in=round(delay, 2))
            return False
        try:
            # Refresh our heartbeat before claiming again: after a long outage other
            # replicas would otherwise see our new claims under a stale heartbeat — or,
            # if our row was pruned meanwhile, under no row at all (orphans to their GC).
            await self.beat()
            # A database restored from a backup may be behind this code's migrations.
            await self.store.check_schema()
        except SchemaBehind as exc:
            if self.schema_ok:
                log.error("schema_behind", error=str(exc))
            self.schema_ok = False
            return False
        except DB_ERRORS:
            return False
        self.schema_ok = True
        return True

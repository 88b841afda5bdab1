"""Background upkeep beside the pollers: the worker heartbeat, orphan GC, the queue
gauges from GetQueueAttributes (depth, oldest message age), the results publisher
(``service.runtime.results``) when results are configured, and retention
(``service.adapters.prune``)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Sequence

import structlog

from service.adapters import prune
from service.core import retention
from service.core.messages import Received
from service.core.retry import ReceiveLimit
from service.core.seams import QueueSeam, StoreSeam
from service.errors import DB_ERRORS, RetentionRefused, TransientError
from service.observe import metrics
from service.runtime.dbhealth import DatabaseHealth
from service.runtime.results import Publisher
from service.settings import Settings

log = structlog.get_logger("sqs_ingest.worker")

class Maintenance:
    """Periodic tasks of one worker; every one of them must stay alive (liveness)."""

    def __init__(
        self,
        settings: Settings,
        queue: QueueSeam,
        store: StoreSeam,
        health: DatabaseHealth,
        holding: Iterable[str],
        limit: ReceiveLimit,
        publisher: Publisher | None = None,
    ) -> None:
        self.s = settings
        self.queue = queue
        self.store = store
        self.health = health
        self.holding = holding  # request_ids claimed by batches in flight (service.core.claims)
        self.publisher = publisher
        # The queue's RedrivePolicy, refreshed with the gauges (service.ops.redrive).
        self.limit = limit
        self.sqs_ok = True  # the last SQS call (receive or GetQueueAttributes) worked
        self._oldest_sent: float | None = None
        self._last_oldest_sent: float | None = None

    def start(self) -> list[asyncio.Task[None]]:
        tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._gc_loop(), name="gc"),
            asyncio.create_task(self._queue_attributes_loop(), name="queue-attributes"),
        ]
        if self.publisher is not None:
            tasks += self.publisher.start()
        if self.s.prune_interval > 0:
            tasks.append(asyncio.create_task(self._prune_loop(), name="prune"))
        return tasks

    async def publish_pending(self, seconds: float) -> None:
        """At a graceful stop, after the batches finished: send what is pending."""
        if self.publisher is not None and seconds > 0:
            sent = await self.publisher.drain(seconds)
            log.info("results_published_at_stop", count=sent)

    def note_sent(self, batch: Sequence[Received]) -> None:
        sent = [m.sent_timestamp for m in batch if m.sent_timestamp]
        if sent:
            oldest = min(sent)
            if self._oldest_sent is None or oldest < self._oldest_sent:
                self._oldest_sent = oldest

    async def gc_once(self, startup: bool = False) -> None:
        try:
            rows = await self.store.gc(
                self.s.worker_lease,
                # "My previous incarnation" only makes sense at startup: later passes
                # must never read a same-named live replica as dead.
                (self.s.worker_name or None) if startup else None,
            )
            leaks = await self.store.gc_own_leaks(list(self.holding))
        except DB_ERRORS as exc:
            self.health.error(exc)
            return
        for r in rows:
            log.warning("orphan_released", request_id=r["request_id"], owner=r["owner"],
                        message_id=r["sqs_message_id"])
        if rows:
            metrics.orphans_collected.inc(len(rows))
        if leaks:
            log.info("own_stale_claims_released", count=len(leaks))

    async def _heartbeat_loop(self) -> None:
        interval = max(0.2, self.s.worker_lease / 3)
        while True:
            await asyncio.sleep(interval)
            if not self.health.is_up:
                continue
            try:
                await self.beat()
            except DB_ERRORS as exc:
                self.health.error(exc)

    async def beat(self) -> None:
        """Refresh this worker's heartbeat. A row that is gone — pruned after
        ``INGEST_WORKER_RETENTION_DAYS`` without a heartbeat, while this process was paused
        or cut off from the database — is registered again: else every claim it makes has
        an unknown owner, which every other replica's GC collects at its next pass. A row
        marked stopped (this worker is shutting down) stays stopped."""
        if await self.store.heartbeat():
            return
        await self.store.register_worker(self.s.effective_worker_name)
        if await self.store.heartbeat():
            log.warning("worker_registered_again", worker_id=self.store.worker_id,
                        hint="its row was gone (pruned): claims made meanwhile may have "
                        "been collected by other replicas and are applied once by whoever "
                        "completes them")

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.gc_interval)
            if self.health.is_up:
                await self.gc_once()

    async def _prune_loop(self) -> None:
        """Retention (``service.adapters.prune``): a first pass soon after start (replicas that
        restart more often than the interval still prune), then every interval. Its own
        connection per pass; a replica that finds another pruner at work skips the pass."""
        await asyncio.sleep(min(self.s.prune_interval, 60.0) * (0.5 + random.random()))
        while True:
            if self.health.is_up:
                await self.prune_pass()
            await asyncio.sleep(self.s.prune_interval)

    async def prune_pass(self) -> dict[str, int] | None:
        """One pass, after the safety rule is checked again against the live queue: the
        check at start saw the MessageRetentionPeriod of that moment, and an operator may
        raise it while the daemon runs. A refused pass deletes nothing and logs an error
        (the daemon keeps ingesting); a queue that cannot be asked allows the pass only
        when the retentions exceed SQS's maximum, as ``sqs-ingest prune`` does."""
        try:
            attrs = await self.queue.attributes()
        except TransientError as exc:
            if not retention.safe_without_queue(self.s):
                log.warning("prune_skipped", reason="cannot read the queue's "
                            f"MessageRetentionPeriod: {str(exc)[:300]}")
                return None
        else:
            try:
                retention.check_retention(self.s, retention.queue_retention(attrs))
            except RetentionRefused as exc:
                log.error("prune_refused", error=str(exc))
                return None
        try:
            return await prune.prune_once(self.s.database_dsn, self.s)
        except DB_ERRORS as exc:
            log.warning("prune_failed", error=str(exc)[:500])
            return None

    async def _queue_attributes_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.queue_attributes_interval)
            await self.read_queue_attributes()

    async def read_queue_attributes(self) -> None:
        """One GetQueueAttributes: the depth gauges and the RedrivePolicy (the worker calls
        it once before its pollers start, so the first receive already obeys the policy)."""
        try:
            attrs = await self.queue.attributes()
            self.sqs_ok = True
        except TransientError as exc:
            self.sqs_ok = False
            metrics.sqs_errors.labels("get_queue_attributes").inc()
            log.warning("queue_attributes_failed", error=str(exc))
        else:
            if self.limit.update(attrs):
                metrics.receive_limit.set(self.limit.max_failures)
            self._set_gauges(attrs)

    def _set_gauges(self, attrs: dict[str, str]) -> None:
        visible = int(attrs.get("ApproximateNumberOfMessages", "0"))
        metrics.queue_visible.set(visible)
        metrics.queue_not_visible.set(int(attrs.get("ApproximateNumberOfMessagesNotVisible", "0")))
        if self._oldest_sent is not None:
            self._last_oldest_sent = self._oldest_sent
        elif visible == 0:
            self._last_oldest_sent = None
        # Nothing received but messages waiting (database down, pollers stuck): the last
        # oldest keeps ageing, which is when the age alert must fire.
        metrics.queue_oldest_age.set(
            0 if self._last_oldest_sent is None
            else max(0.0, time.time() - self._last_oldest_sent))
        self._oldest_sent = None

"""The worker's lifecycle: long-poll receivers feeding bounded in-flight batches, health
for the probes, and the drain on SIGTERM. A batch's own path is in ``service.runtime.batch``;
background upkeep in ``service.runtime.maintenance``; the database's up/down in
``service.runtime.dbhealth``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import structlog

from service.adapters.payloads import S3Payloads
from service.core.budget import MemoryBudget
from service.core.labels import INVALID_TYPE_LABEL
from service.core.limits import held_bytes
from service.core.messages import Received
from service.core.retry import Backoff, ReceiveLimit, RetryPolicy, sleep_or_stop, wait_any
from service.core.seams import QueueSeam, StoreSeam
from service.errors import DB_ERRORS, TransientError
from service.handlers import Registry
from service.observe import metrics
from service.runtime.batch import EXIT_ACK_FAILED, BatchProcessor
from service.runtime.dbhealth import DatabaseHealth
from service.runtime.maintenance import Maintenance
from service.runtime.results import Publisher
from service.settings import Settings

log = structlog.get_logger("sqs_ingest.worker")

#: Seconds a poller leaves between the starts of two receives that came back empty.
EMPTY_RECEIVE_INTERVAL = 1.0

EXIT_OK, EXIT_FATAL = 0, 1
__all__ = ["EXIT_ACK_FAILED", "EXIT_FATAL", "EXIT_OK", "INVALID_TYPE_LABEL", "Worker"]


class Worker:
    """Runs ``settings.pollers`` receive loops and processes what they bring.

    Stop semantics (see ``request_stop``): receiving stops at once; batches in flight
    finish and ack within ``shutdown_timeout``; long polls already in flight are allowed
    to return and whatever they bring is released (visibility 0) rather than hidden for
    a whole visibility timeout. Anything still running at the deadline is cancelled and
    released.
    """

    def __init__(
        self,
        settings: Settings,
        queue: QueueSeam,
        store: StoreSeam,
        registry: Registry,
        *,
        visibility_timeout: int = 30,
        rng: Callable[[], float] = random.random,
        publisher: Publisher | None = None,
        payloads: S3Payloads | None = None,
        max_message_bytes: int = 256 * 1024,
    ) -> None:
        self.s = settings
        self.budget, self.receive_reserve = _budget(settings, max_message_bytes, payloads)
        # FIFO: one receive per batch (order within a group is enforced per batch).
        self.follow_ups = FollowUps(queue, self.budget, self.receive_reserve, visibility_timeout,
                                    1 if settings.is_fifo else settings.receives_per_batch)
        self.queue = queue
        self.store = store
        self.registry = registry
        self.visibility_timeout = visibility_timeout
        self.exit_code = EXIT_OK
        self._stop = asyncio.Event()
        self.pacer = ReceivePacer(settings.receive_window, settings.pollers, self._stop)
        self._done = asyncio.Event()
        self._force = asyncio.Event()
        self._stop_requested_at = 0.0
        self._slots = asyncio.Semaphore(settings.inflight_limit)
        self._pollers: list[asyncio.Task[None]] = []
        self._batches: set[asyncio.Task[None]] = set()
        self._background: list[asyncio.Task[None]] = []
        self.policy = RetryPolicy.from_settings(settings, rng)
        # INGEST_MAX_RECEIVE_COUNT lowered by the queue's RedrivePolicy: read by the batch
        # path, kept current by maintenance (service.ops.redrive).
        self.limit = ReceiveLimit(settings.max_receive_count, settings.is_fifo)
        metrics.receive_limit.set(self.limit.max_failures)
        self.health = DatabaseHealth(store, self._stop, self._database_back)
        self.batches = BatchProcessor(
            queue, store, registry, self.policy, self.health, fifo=settings.is_fifo,
            visibility_timeout=visibility_timeout, handler_timeout=settings.handler_timeout,
            fatal=self._fatal, payloads=payloads, limit=self.limit, budget=self.budget,
        )
        self.maintenance = Maintenance(
            settings, queue, store, self.health, self.batches.holding,
            self.limit, publisher,
        )
        self.health.beat = self.maintenance.beat  # a row pruned in an outage: registered again

    # -- lifecycle ---------------------------------------------------------------------

    def request_stop(self) -> None:
        """First SIGTERM/SIGINT: drain. A second one: force."""
        if self._stop.is_set():
            if time.monotonic() - self._stop_requested_at < 1.0:
                return  # one signal delivered twice (process group + child), not a second one
            self._force.set()
            log.warning("forced_shutdown")
            self._done.set()
            return
        self._stop_requested_at = time.monotonic()
        log.info("shutdown_requested", in_flight_batches=len(self._batches))
        self._stop.set()
        self._done.set()

    def _fatal(self, code: int, reason: str, **kw: Any) -> None:
        """The first fatal decides the exit code; every one is logged (a later ack failure
        still names the messages it left on the queue)."""
        if self.exit_code == EXIT_OK:
            self.exit_code = code
            log.error("fatal", reason=reason, exit_code=code, **kw)
        else:
            log.error("fatal", reason=reason, exit_code=self.exit_code, not_exit_code=code,
                      **kw)
        self._stop.set()
        self._done.set()

    async def _database_back(self) -> None:
        # Claims stranded by the outage first: their copies are waiting (service.ops.redrive).
        await self.batches.executor.release_unreleased()
        await self.maintenance.gc_once()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self) -> int:
        metrics.prime(self.registry.types())
        await self.maintenance.gc_once(startup=True)
        await self.maintenance.read_queue_attributes()  # the RedrivePolicy, before any receive
        self._pollers = [
            asyncio.create_task(self._poll_loop(i), name=f"poller-{i}")
            for i in range(self.s.pollers)
        ]
        # A dead heartbeat would let other replicas collect our live claims: fatal too.
        self._background = self.maintenance.start()
        for t in (*self._pollers, *self._background):
            t.add_done_callback(self._task_exited)
        log.info(
            "worker_started", worker_id=self.store.worker_id, pollers=self.s.pollers,
            inflight_batches=self.s.inflight_limit, visibility_timeout=self.visibility_timeout,
            fifo=self.s.is_fifo, handlers=self.registry.types(),
        )
        await self._done.wait()
        await self._shutdown()
        return self.exit_code

    def _task_exited(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # always retrieved, so asyncio never reports it as lost
        if exc is not None and self.stopping:
            log.warning("task_failed_while_stopping", task=task.get_name(), error=repr(exc))
        elif not self.stopping:
            self._fatal(EXIT_FATAL, "task_died", task=task.get_name(), error=repr(exc))

    async def _shutdown(self) -> None:
        # The heartbeat keeps running while we drain: a drain longer than the lease must
        # not let another replica collect the claims we are about to complete.
        await self._drain()
        await _cancel_stuck(self._working())
        drain_deletes = getattr(self.queue, "drain_deletes", None)
        if drain_deletes is not None:
            # A committed batch's delete still lingering (INGEST_DELETE_LINGER) goes out
            # before the client closes; a failure is an ack failure (exit 3) even now.
            try:
                await asyncio.wait_for(drain_deletes(), timeout=10)
            except TimeoutError:
                log.error("deletes_not_drained")
        for t in self._background:
            t.cancel()
        self.health.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.exit_code == EXIT_OK and not self._force.is_set():
            # Results pending at SIGTERM go out within what is left of the drain deadline;
            # after a kill -9 they wait in the outbox for the next process or a replica.
            await self.maintenance.publish_pending(
                self.s.shutdown_timeout - (time.monotonic() - self._stop_requested_at))
        try:
            released = await asyncio.wait_for(self.store.stop_worker(), timeout=5)
            if released:
                log.info("claims_released_at_stop", count=released)
        except DB_ERRORS as exc:
            log.warning("stop_worker_failed", error=str(exc))
        if self._force.is_set() and self.exit_code == EXIT_OK:
            self.exit_code = EXIT_FATAL
        log.info("worker_stopped", exit_code=self.exit_code)

    def _working(self) -> list[asyncio.Task[None]]:
        return [t for t in (*self._pollers, *self._batches) if not t.done()]

    async def _drain(self) -> None:
        """Wait for pollers and batches until the deadline (none after an ack failure or a
        second signal)."""
        deadline = time.monotonic() + self.s.shutdown_timeout
        if self.exit_code != EXIT_OK or self._force.is_set():
            deadline = time.monotonic()
        forced = asyncio.create_task(self._force.wait())
        while True:
            pending = self._working()
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0 or self._force.is_set():
                break
            await asyncio.wait(
                [*pending, forced], timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        forced.cancel()

    # -- health ------------------------------------------------------------------------

    def liveness(self) -> tuple[bool, dict[str, object]]:
        dead = [t.get_name() for t in (*self._pollers, *self._background) if t.done()]
        ok = self.stopping or not dead
        return ok, {"dead_pollers": dead}

    def readiness(self) -> tuple[bool, dict[str, object]]:
        detail: dict[str, object] = {
            "database": self.health.is_up,
            "schema": self.health.schema_ok,
            "sqs": self.maintenance.sqs_ok,
            "draining": self.stopping,
        }
        ok = (self.health.is_up and self.health.schema_ok and self.maintenance.sqs_ok
              and not self.stopping)
        return ok, detail

    # -- receiving ---------------------------------------------------------------------

    async def _poll_loop(self, index: int) -> None:
        backoff = Backoff(0.5, 30.0)
        while not self.stopping:
            if not self.health.is_up:
                # Don't take messages we cannot persist.
                await wait_any(self.health.up, self._stop)
                continue
            await self.pacer.pace()
            if self.stopping:
                break
            await self._slots.acquire()
            if self.stopping:
                self._slots.release()
                break
            poll = object()  # holds the receive's room in the memory budget
            if not await _room(self.budget, self.receive_reserve, poll, self._stop):
                self._slots.release()
                break
            asked = time.monotonic()
            try:
                batch = await self.queue.receive(
                    10, self.s.wait_time_seconds, self.visibility_timeout
                )
            except TransientError as exc:
                self.budget.give_all(poll)
                self._slots.release()
                self.maintenance.sqs_ok = False
                metrics.sqs_errors.labels("receive").inc()
                log.warning("receive_failed", error=str(exc), retry_in=round(backoff.delay, 2))
                await backoff.wait(self._stop)
                continue
            self.maintenance.sqs_ok = True
            backoff.reset()
            owner = object()
            keep_bytes(self.budget, batch, poll, owner)
            await self.follow_ups.gather(batch, owner,
                                         lambda: not self.stopping and self.health.is_up)
            if not await self._dispatch(batch, owner):
                break
            self.pacer.trickle = 0 < len(batch) < 10
            if not batch:
                # An empty answer that came at once (short polling, INGEST_WAIT_TIME_SECONDS=0):
                # at most one receive a second per poller on an empty queue, not a hot loop
                # of billed calls. A long poll's empty answer has waited already.
                await sleep_or_stop(EMPTY_RECEIVE_INTERVAL - (time.monotonic() - asked),
                                    self._stop)

    async def _dispatch(self, batch: list[Received], owner: object | None = None) -> bool:
        """Start a batch task for what a poll brought (it owns the slot, and ``owner``'s
        bytes in the memory budget, from then on). False when the poller must end."""
        if not batch:
            self._slots.release()
            return True
        if owner is not None and (not self.health.is_up or self.stopping):
            self.budget.give_all(owner)  # handed straight back below: nothing held
        metrics.messages_received.inc(len(batch))
        self.maintenance.note_sent(batch)
        if not self.health.is_up and not self.stopping:
            # The database went away while this poll was in flight.
            self._slots.release()
            await self.batches.executor.hand_back(
                [(m, self.policy.hand_back()) for m in batch])
            return True
        if self.stopping:
            # A poll that was in flight at SIGTERM: hand its messages straight back.
            self._slots.release()
            await self.batches.executor.hand_back([(m, 0) for m in batch])
            log.info("released_after_stop", count=len(batch))
            return False
        task = asyncio.create_task(self.batches.run(batch, owner),
                                   name=f"batch-{batch[0].message_id}")
        self._batches.add(task)
        task.add_done_callback(self._batch_done)
        return True

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            # A bug outside the batch's own guard (BatchProcessor.run's set-up or clean-up):
            # never a silent "exception was never retrieved" — the daemon stops, exit 1.
            self._task_exited(task)


class ReceivePacer:
    """INGEST_RECEIVE_WINDOW: while receives come back with fewer than 10 messages (a
    trickle), the pollers' receives start no closer together than window / pollers, so
    that messages gather in the queue and one receive — and one delete — serves several
    (a message waits at most that spacing to be received). A full or an empty receive ends
    it: a backlog is drained flat out, and an idle queue is long-polled by every poller, so
    the first message after a quiet spell is taken at once."""

    def __init__(self, window: float, pollers: int, stop: asyncio.Event) -> None:
        self.spacing = window / pollers
        self.trickle = False  # the last receive brought some, not 10
        self._next = 0.0
        self._stop = stop

    async def pace(self) -> None:
        if not self.trickle or self.spacing <= 0:
            return
        now = time.monotonic()
        at = max(now, self._next)
        self._next = at + self.spacing
        if at > now:
            await sleep_or_stop(at - now, self._stop)


def keep_bytes(budget: MemoryBudget, batch: list[Received], poll: object, owner: object) -> None:
    """The batch keeps the bytes its bodies take — parsed as well as raw
    (``service.core.limits.held_bytes``); the rest of the poll's room goes back."""
    size, room = sum(held_bytes(m.body) for m in batch), budget.holds(poll)
    budget.move(size, poll, owner)
    budget.give_all(poll)
    budget.charge(size - room, owner)


class FollowUps:
    """A backlog: while the last receive came back full, up to INGEST_RECEIVES_PER_BATCH
    receives in all join one batch, so that one claim and one completing transaction cover
    them (the database's round trips per message fall; SQS calls stay 10 messages each).
    Follow-ups do not wait (WaitTimeSeconds=0: an answer of fewer than 10 ends the batch),
    do not wait for room in the memory budget either, and a failed one ends the batch with
    what it has."""

    def __init__(self, queue: QueueSeam, budget: MemoryBudget, reserve: int,
                 visibility_timeout: int, receives: int) -> None:
        self.queue = queue
        self.budget = budget
        self.reserve = reserve
        self.visibility_timeout = visibility_timeout
        self.receives = receives

    async def gather(self, batch: list[Received], owner: object,
                     go_on: Callable[[], bool]) -> None:
        """Extend ``batch`` (the first receive's, 10 or fewer) in place."""
        last = len(batch)
        for _ in range(self.receives - 1):
            if last < 10 or not go_on():
                break
            poll = object()
            if not self.budget.try_take(self.reserve, poll):
                break
            try:
                more = await self.queue.receive(10, 0, self.visibility_timeout)
            except TransientError as exc:
                self.budget.give_all(poll)
                metrics.sqs_errors.labels("receive").inc()
                log.warning("receive_failed", error=str(exc), follow_up=True)
                break
            keep_bytes(self.budget, more, poll, owner)
            batch.extend(more)
            last = len(more)


def _budget(settings: Settings, max_message_bytes: int,
            payloads: S3Payloads | None) -> tuple[MemoryBudget, int]:
    """INGEST_MAX_INFLIGHT_BYTES: bodies and S3 payloads of the messages in flight, and the
    room a poll takes before it asks — a full receive (ten of the queue's largest
    messages), or its share of the budget if that is less, so that INGEST_POLLERS polls fit
    side by side (ten 1 MiB messages would otherwise take the whole default budget and
    serialise the pollers). A poll keeps what the messages it got hold, gives the rest
    back, and is charged what they take beyond its room (``MemoryBudget.charge``)."""
    budget = MemoryBudget(settings.max_inflight_bytes)
    reserve = max(1, min(10 * max_message_bytes,
                         settings.max_inflight_bytes // settings.pollers))
    if payloads is not None:
        payloads.budget = budget
    metrics.inflight_bytes.set_function(lambda: budget.used)
    return budget, reserve


async def _room(budget: MemoryBudget, reserve: int, poll: object,
                stop: asyncio.Event) -> bool:
    """Wait for room for one receive in the memory budget (back-pressure); False when
    the worker stops meanwhile."""
    if budget.try_take(reserve, poll):
        return True
    metrics.budget_waits.inc()
    take = asyncio.ensure_future(budget.take(reserve, poll))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([take, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if take.done() and not stop.is_set():
        return True
    take.cancel()
    await asyncio.gather(take, return_exceptions=True)
    budget.give_all(poll)
    return False


async def _cancel_stuck(stuck: list[asyncio.Task[None]]) -> None:
    if stuck:
        log.warning("shutdown_deadline_cancelling", tasks=[t.get_name() for t in stuck])
        for t in stuck:
            t.cancel()
        # Cancelled batches release their messages (shielded); give that a bound.
        await asyncio.wait(stuck, timeout=10)

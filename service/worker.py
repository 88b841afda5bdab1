"""The loop: long-poll receivers, bounded in-flight batches, ack only after commit.

One batch goes through::

    parse ─► dead-letter poison ─► claim (one statement) ─► apply + complete (one txn)
          ─► record failures ─► DeleteMessageBatch (acks) ─► ChangeMessageVisibilityBatch

Every message of a batch ends in exactly one of: acked (its outcome is committed) or
released (visibility set so it comes back). Nothing is acked before the commit that made
its outcome durable.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg
import structlog

from service import metrics
from service.errors import AckFailed, DatabaseUnavailable, TransientError
from service.handlers import Registry
from service.handlers import _request_id as request_id_var
from service.messages import Message, Poison, Received, parse
from service.settings import SQS_MAX_VISIBILITY, Settings
from service.sqs import QueueSeam
from service.store import CONNECTION_ERRORS, DB_ERRORS, ApplyResult, ClaimResult, DeadLetter, Store

log = structlog.get_logger("sqs_ingest.worker")

EXIT_OK, EXIT_FATAL, EXIT_ACK_FAILED = 0, 1, 3
INVALID_TYPE_LABEL = "_invalid"


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
        store: Store,
        registry: Registry,
        *,
        visibility_timeout: int = 30,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.s = settings
        self.queue = queue
        self.store = store
        self.registry = registry
        self.visibility_timeout = visibility_timeout
        self.rng = rng
        self.started_at = time.time()
        self.exit_code = EXIT_OK
        self.schema_ok = True
        self._stop = asyncio.Event()
        self._done = asyncio.Event()
        self._db_up = asyncio.Event()
        self._db_up.set()
        self._sqs_ok = True
        self._slots = asyncio.Semaphore(settings.inflight_limit)
        self._pollers: list[asyncio.Task[None]] = []
        self._batches: set[asyncio.Task[None]] = set()
        self._background: list[asyncio.Task[None]] = []
        self._probe: asyncio.Task[None] | None = None
        self._holding: collections.Counter[str] = collections.Counter()
        self._oldest_sent: float | None = None
        self._last_oldest_sent: float | None = None
        self._forced = False
        self._force = asyncio.Event()
        self._stop_requested_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------

    def request_stop(self) -> None:
        """First SIGTERM/SIGINT: drain. A second one: force."""
        if self._stop.is_set():
            if time.monotonic() - self._stop_requested_at < 1.0:
                return  # one signal delivered twice (process group + child), not a second one
            self._forced = True
            self._force.set()
            log.warning("forced_shutdown")
            self._done.set()
            return
        self._stop_requested_at = time.monotonic()
        log.info("shutdown_requested", in_flight_batches=len(self._batches))
        self._stop.set()
        self._done.set()

    def _fatal(self, code: int, reason: str, **kw: Any) -> None:
        if self.exit_code == EXIT_OK:
            self.exit_code = code
            log.error("fatal", reason=reason, exit_code=code, **kw)
        self._stop.set()
        self._done.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def run(self) -> int:
        await self._gc_once(startup=True)
        self._pollers = [
            asyncio.create_task(self._poll_loop(i), name=f"poller-{i}")
            for i in range(self.s.pollers)
        ]
        for t in self._pollers:
            t.add_done_callback(self._poller_exited)
        self._background = [
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._gc_loop(), name="gc"),
            asyncio.create_task(self._queue_attributes_loop(), name="queue-attributes"),
        ]
        for t in self._background:
            # A dead heartbeat would let other replicas collect our live claims: fatal.
            t.add_done_callback(self._poller_exited)
        log.info(
            "worker_started", worker_id=self.store.worker_id, pollers=self.s.pollers,
            inflight_batches=self.s.inflight_limit, visibility_timeout=self.visibility_timeout,
            fifo=self.s.is_fifo, handlers=self.registry.types(),
        )
        await self._done.wait()
        await self._shutdown()
        return self.exit_code

    def _poller_exited(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # always retrieved, so asyncio never reports it as lost
        if exc is not None and self.stopping:
            log.warning("task_failed_while_stopping", task=task.get_name(), error=repr(exc))
        elif not self.stopping:
            self._fatal(EXIT_FATAL, "task_died", task=task.get_name(), error=repr(exc))

    async def _shutdown(self) -> None:
        deadline = time.monotonic() + self.s.shutdown_timeout
        if self.exit_code != EXIT_OK or self._forced:
            deadline = time.monotonic()  # ack failure or second signal: no drain
        # The heartbeat keeps running while we drain: a drain longer than the lease must
        # not let another replica collect the claims we are about to complete.
        forced = asyncio.create_task(self._force.wait())
        while True:
            pending = [t for t in (*self._pollers, *self._batches) if not t.done()]
            remaining = deadline - time.monotonic()
            if not pending or remaining <= 0 or self._forced:
                break
            await asyncio.wait(
                [*pending, forced], timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
        forced.cancel()
        stuck = [t for t in (*self._pollers, *self._batches) if not t.done()]
        if stuck:
            log.warning("shutdown_deadline_cancelling", tasks=[t.get_name() for t in stuck])
            for t in stuck:
                t.cancel()
            # Cancelled batches release their messages (shielded); give that a bound.
            await asyncio.wait(stuck, timeout=10)
        for t in self._background:
            t.cancel()
        if self._probe:
            self._probe.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        try:
            released = await asyncio.wait_for(self.store.stop_worker(), timeout=5)
            if released:
                log.info("claims_released_at_stop", count=released)
        except DB_ERRORS as exc:
            log.warning("stop_worker_failed", error=str(exc))
        if self._forced and self.exit_code == EXIT_OK:
            self.exit_code = EXIT_FATAL
        log.info("worker_stopped", exit_code=self.exit_code)

    # -- health ------------------------------------------------------------------------

    def liveness(self) -> tuple[bool, dict[str, object]]:
        dead = [t.get_name() for t in (*self._pollers, *self._background) if t.done()]
        ok = self.stopping or not dead
        return ok, {"dead_pollers": dead}

    def readiness(self) -> tuple[bool, dict[str, object]]:
        detail: dict[str, object] = {
            "database": self._db_up.is_set(),
            "schema": self.schema_ok,
            "sqs": self._sqs_ok,
            "draining": self.stopping,
        }
        return (self._db_up.is_set() and self.schema_ok and self._sqs_ok and not self.stopping,
                detail)

    # -- receiving ---------------------------------------------------------------------

    async def _poll_loop(self, index: int) -> None:
        backoff = 0.5
        while not self.stopping:
            if not self._db_up.is_set():
                # Don't take messages we cannot persist.
                await _wait_any(self._db_up, self._stop)
                continue
            await self._slots.acquire()
            if self.stopping:
                self._slots.release()
                break
            try:
                batch = await self.queue.receive(
                    10, self.s.wait_time_seconds, self.visibility_timeout
                )
            except TransientError as exc:
                self._slots.release()
                self._sqs_ok = False
                metrics.sqs_errors.labels("receive").inc()
                log.warning("receive_failed", error=str(exc), retry_in=round(backoff, 2))
                await _sleep_or_stop(backoff, self._stop)
                backoff = min(backoff * 2, 30.0)
                continue
            self._sqs_ok = True
            backoff = 0.5
            if not batch:
                self._slots.release()
                continue
            metrics.messages_received.inc(len(batch))
            self._note_sent(batch)
            if not self._db_up.is_set() and not self.stopping:
                # The database went away while this poll was in flight.
                self._slots.release()
                await self._change_visibility(
                    [(m, self._jittered(self.s.retry_base_seconds)) for m in batch])
                continue
            if self.stopping:
                # A poll that was in flight at SIGTERM: hand its messages straight back.
                self._slots.release()
                await self._change_visibility([(m, 0) for m in batch])
                log.info("released_after_stop", count=len(batch))
                break
            task = asyncio.create_task(self._run_batch(batch), name=f"batch-{batch[0].message_id}")
            self._batches.add(task)
            task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batches.discard(task)
        self._slots.release()

    def _note_sent(self, batch: Sequence[Received]) -> None:
        sent = [m.sent_timestamp for m in batch if m.sent_timestamp]
        if sent:
            oldest = min(sent)
            if self._oldest_sent is None or oldest < self._oldest_sent:
                self._oldest_sent = oldest

    # -- one batch ---------------------------------------------------------------------

    async def _run_batch(self, batch: list[Received]) -> None:
        started = time.monotonic()
        unresolved: dict[str, Received] = {m.message_id: m for m in batch}
        claimed: list[Message] = []
        metrics.in_flight.inc(len(batch))
        extender = asyncio.create_task(self._extend_visibility(unresolved), name="extender")

        async def stop_extender() -> None:
            # Before acks and releases: a late extension must not undo a release to 0.
            extender.cancel()
            await asyncio.gather(extender, return_exceptions=True)

        try:
            await self._process(batch, unresolved, claimed, stop_extender)
        except AckFailed as exc:
            metrics.ack_failures.inc(len(exc.message_ids))
            # Exit 3 on purpose: the outcome is committed but the message stays on the
            # queue. Carrying on would leave an orphan whose redelivery could double-apply;
            # a restart runs orphan GC and redelivery resolves as a duplicate.
            self._fatal(EXIT_ACK_FAILED, "ack_failed", message_ids=exc.message_ids,
                        error=exc.detail)
        except DatabaseUnavailable as exc:
            self._db_down(exc)
            await stop_extender()
            await self._abandon(unresolved, claimed, self._jittered(self.s.retry_base_seconds))
        except asyncio.CancelledError:
            async def release_all() -> None:
                await stop_extender()  # a late extension must not re-hide what we release
                await self._abandon(unresolved, claimed, 0)

            await asyncio.shield(release_all())
            raise
        except TransientError as exc:
            log.warning("batch_retry_later", error=str(exc))
            await stop_extender()
            await self._abandon(unresolved, claimed, self._jittered(self.s.retry_base_seconds))
        except Exception as exc:
            log.exception("batch_failed", error=repr(exc))
            await stop_extender()
            try:
                await self._give_up_on_repeat_offenders(unresolved, claimed, repr(exc))
            except AckFailed as ack:
                metrics.ack_failures.inc(len(ack.message_ids))
                self._fatal(EXIT_ACK_FAILED, "ack_failed", message_ids=ack.message_ids,
                            error=ack.detail)
            await self._abandon(unresolved, claimed, self._jittered(self.s.retry_base_seconds))
        finally:
            extender.cancel()
            for m in claimed:
                self._holding[m.request_id] -= 1
                if self._holding[m.request_id] <= 0:
                    del self._holding[m.request_id]
            metrics.in_flight.dec(len(batch))
            metrics.batch_duration.observe(time.monotonic() - started)

    async def _process(
        self,
        batch: list[Received],
        unresolved: dict[str, Received],
        claimed: list[Message],
        stop_extender: Callable[[], Awaitable[None]],
    ) -> None:
        acks: list[Received] = []
        releases: list[tuple[Received, int]] = []
        outcomes: list[tuple[str, str]] = []
        letters: list[DeadLetter] = []

        primaries: dict[str, Message] = {}
        twins: list[Message] = []
        for raw in batch:
            item = parse(raw, self.registry)
            if isinstance(item, Poison):
                letters.append(DeadLetter.of_poison(item))
                log.warning("poison_message", message_id=raw.message_id,
                            request_id=item.request_id, reason=item.reason, error=item.error)
            elif item.request_id in primaries:
                twins.append(item)
            else:
                primaries[item.request_id] = item

        if primaries:
            for m in primaries.values():
                self._holding[m.request_id] += 1
                claimed.append(m)
            claims = await self.store.claim(list(primaries.values()))
            to_apply, unclaim = self._classify(
                primaries, claims, letters, acks, releases, outcomes)
            if unclaim:
                await self.store.release(unclaim)
        else:
            to_apply = []

        # Poison and reused keys are durable before anything is acked.
        if letters:
            await self.store.dead_letter(letters)
            by_id = {m.message_id: m for m in batch}
            for d in letters:
                acks.append(by_id[d.sqs_message_id])
                outcomes.append((self._label(d.request_type), "dead_lettered"))
                metrics.dead_letters.labels(d.reason).inc()

        if to_apply:
            res = await self.store.apply(
                to_apply, self._call_handler, fifo=self.s.is_fifo,
                batch=(self._batch_key, self._call_many),
            )
            await self._settle(res, acks, releases, outcomes)

        for m in twins:
            # Same request_id twice in one batch: decide on it after the first copy's
            # outcome is on record, i.e. on its next delivery.
            releases.append((m.raw, self._contention_delay()))

        await stop_extender()
        if acks:
            await self.queue.delete_batch(acks)
            for r in acks:
                unresolved.pop(r.message_id, None)
        for type_, outcome in outcomes:
            metrics.messages_processed.labels(type_, outcome).inc()
        # One line per batch, at debug only (a no-op call at info).
        log.debug("batch_processed", received=len(batch), released=len(releases),
                  **collections.Counter(o for _, o in outcomes))
        if releases:
            await self._change_visibility(releases)
            for r, _ in releases:
                unresolved.pop(r.message_id, None)

    def _classify(
        self,
        primaries: dict[str, Message],
        claims: dict[str, ClaimResult],
        letters: list[DeadLetter],
        acks: list[Received],
        releases: list[tuple[Received, int]],
        outcomes: list[tuple[str, str]],
    ) -> tuple[list[Message], list[Message]]:
        """Sort claim results into apply / duplicate / conflict / defer.

        Returns the messages to apply and the claims to give back at once (FIFO messages
        claimed behind a message of their group that has to wait).
        """
        to_apply: list[Message] = []
        unclaim: list[Message] = []
        blocked_groups: set[str] = set()
        fifo = self.s.is_fifo
        for m in primaries.values():  # batch order: FIFO order within a group
            c = claims[m.request_id]
            group = m.raw.group_id
            if fifo and group is not None and group in blocked_groups:
                releases.append((m.raw, 0))
                if c.claimed:
                    unclaim.append(m)
                continue
            if c.dead_lettered:
                # Dead-lettered on an earlier delivery whose ack never happened.
                acks.append(m.raw)
                outcomes.append((m.type, "dead_lettered"))
                continue
            if c.claimed:
                m.failures = c.failures
                to_apply.append(m)
                continue
            if c.status is not None and (
                c.payload_sha256 != m.payload_sha256 or c.request_type != m.type
            ):
                letters.append(DeadLetter.of_message(
                    m, "idempotency_key_reused",
                    f"request_id already used with payload_sha256={c.payload_sha256} "
                    f"type={c.request_type}",
                ))
                log.warning("idempotency_key_reused", message_id=m.raw.message_id,
                            request_id=m.request_id)
            elif c.status == "COMPLETED":
                acks.append(m.raw)
                outcomes.append((m.type, "duplicate"))
            else:
                # IN_PROGRESS under another owner (or committed after our snapshot): come
                # back after it finished. Not a failure: does not count towards the limit.
                releases.append((m.raw, self._contention_delay()))
                metrics.contention_deferrals.inc()
                if fifo and group is not None:
                    blocked_groups.add(group)
        return to_apply, unclaim

    async def _call_handler(self, m: Message, conn: asyncpg.Connection) -> dict[str, Any] | None:
        spec = self.registry.get(m.type)
        assert spec is not None  # parse() guarantees it
        token = request_id_var.set(m.request_id)
        try:
            with structlog.contextvars.bound_contextvars(
                message_id=m.raw.message_id, request_id=m.request_id
            ):
                async with asyncio.timeout(self.s.handler_timeout or None):
                    return await spec.fn(m.payload, conn)
        finally:
            request_id_var.reset(token)

    def _batch_key(self, m: Message) -> object:
        spec = self.registry.get(m.type)
        return spec.batch_fn if spec is not None else None

    async def _call_many(
        self, ms: list[Message], conn: asyncpg.Connection
    ) -> list[dict[str, Any] | None] | None:
        spec = self.registry.get(ms[0].type)
        assert spec is not None and spec.batch_fn is not None
        async with asyncio.timeout(self.s.handler_timeout or None):
            return await spec.batch_fn([(m.request_id, m.payload) for m in ms], conn)

    async def _settle(
        self,
        res: ApplyResult,
        acks: list[Received],
        releases: list[tuple[Received, int]],
        outcomes: list[tuple[str, str]],
    ) -> None:
        for m, _ in res.completed:
            acks.append(m.raw)
            outcomes.append((m.type, "completed"))
            if m.raw.sent_timestamp:
                metrics.message_lag.observe(max(0.0, res.committed_at - m.raw.sent_timestamp))
        for m in res.lost:
            log.warning("claim_lost", message_id=m.raw.message_id, request_id=m.request_id)
            releases.append((m.raw, self._contention_delay()))
        if res.blocked:
            await self.store.release(res.blocked)
            releases.extend((m.raw, 0) for m in res.blocked)
        if res.failed:
            failures = [(m, _describe(exc)) for m, exc in res.failed]
            counts = await self.store.record_failures(failures, self.s.max_receive_count)
            for m, err in failures:
                n = counts[m.request_id]
                if n >= self.s.max_receive_count:
                    acks.append(m.raw)
                    outcomes.append((m.type, "dead_lettered"))
                    metrics.dead_letters.labels("max_receives_exceeded").inc()
                    log.error("dead_lettered_after_retries", message_id=m.raw.message_id,
                              request_id=m.request_id, failures=n, error=err)
                else:
                    delay = self._backoff(m.raw.receive_count)
                    releases.append((m.raw, delay))
                    outcomes.append((m.type, "retried"))
                    log.warning("handler_failed", message_id=m.raw.message_id,
                                request_id=m.request_id, failures=n, retry_in=delay, error=err)

    # -- visibility --------------------------------------------------------------------

    def _backoff(self, receive_count: int) -> int:
        base = self.s.retry_base_seconds * (2 ** min(30, max(0, receive_count - 1)))
        return self._jittered(min(self.s.retry_max_seconds, base))

    def _contention_delay(self) -> int:
        return max(1, self._jittered(self.s.contention_delay))

    def _jittered(self, seconds: float) -> int:
        # "Equal jitter": half fixed, half random, so replicas spread out but never retry at 0.
        return min(SQS_MAX_VISIBILITY, math.ceil(seconds / 2 + self.rng() * seconds / 2))

    async def _change_visibility(self, changes: Sequence[tuple[Received, int]]) -> None:
        failed = await self.queue.change_visibility_batch(changes)
        if failed:
            # Not fatal: the message reappears when its current visibility runs out.
            metrics.sqs_errors.labels("change_visibility").inc(len(failed))
            log.warning("change_visibility_failed", message_ids=failed)

    async def _extend_visibility(self, unresolved: dict[str, Received]) -> None:
        vt = self.visibility_timeout
        total = vt
        while True:
            await asyncio.sleep(vt / 2)
            if not unresolved:
                return
            if total + vt > SQS_MAX_VISIBILITY:
                log.warning("visibility_cap_reached", message_ids=list(unresolved))
                return
            # From now, the message stays hidden for another full timeout.
            changes = [(m, vt) for m in list(unresolved.values())]
            await self._change_visibility(changes)
            total += vt // 2
            metrics.visibility_extensions.inc(len(changes))
            log.info("visibility_extended", count=len(changes), seconds=vt)

    async def _give_up_on_repeat_offenders(
        self, unresolved: dict[str, Received], claimed: list[Message], error: str
    ) -> None:
        """Safety net for a batch that keeps failing outside any handler (a bug, a value
        the database refuses): a message received far more often than the retry limit is
        dead-lettered so it cannot stall its neighbours forever."""
        ceiling = self.s.max_receive_count * 3
        doomed = [m for m in unresolved.values() if m.receive_count > ceiling]
        if not doomed or not self._db_up.is_set():
            return
        doomed_ids = {m.message_id for m in doomed}
        try:
            await self.store.release([m for m in claimed if m.raw.message_id in doomed_ids])
            await self.store.dead_letter([
                DeadLetter(m.message_id, m.body, "processing_error", error[:2000], None, None,
                           m.receive_count) for m in doomed])
        except DB_ERRORS as exc:
            log.warning("dead_letter_failed", error=str(exc))
            return
        await self.queue.delete_batch(doomed)  # AckFailed propagates: exit 3
        for m in doomed:
            unresolved.pop(m.message_id, None)
            metrics.dead_letters.labels("processing_error").inc()
            log.error("dead_lettered_processing_error", message_id=m.message_id,
                      receive_count=m.receive_count, error=error)

    async def _abandon(
        self, unresolved: dict[str, Received], claimed: list[Message], delay: int
    ) -> None:
        """Give back what this batch could not finish: claims released, messages visible."""
        if not unresolved:
            return
        mine = [m for m in claimed if m.raw.message_id in unresolved]
        if mine and self._db_up.is_set():
            try:
                await self.store.release(mine)
            except DB_ERRORS as exc:
                # The periodic own-leak GC releases them once the database is back.
                log.warning("release_failed", error=str(exc))
        try:
            await self._change_visibility([(m, delay) for m in unresolved.values()])
        except Exception as exc:  # the message comes back by itself after the timeout
            log.warning("abandon_visibility_failed", error=repr(exc))
        unresolved.clear()

    # -- database outages --------------------------------------------------------------

    def _db_error(self, exc: BaseException) -> None:
        """A background statement failed: an outage only if the connection is gone."""
        if isinstance(exc, (DatabaseUnavailable, *CONNECTION_ERRORS)):
            self._db_down(exc)
        else:
            metrics.db_errors.inc()
            log.warning("database_statement_failed", error=f"{type(exc).__name__}: {exc}")

    def _db_down(self, exc: BaseException) -> None:
        if not self._db_up.is_set():
            return
        self._db_up.clear()
        metrics.db_errors.inc()
        log.error("database_unavailable", error=str(exc))
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._probe_db(), name="db-probe")

    async def _probe_db(self) -> None:
        delay = 0.5
        while not self.stopping:
            await _sleep_or_stop(delay, self._stop)
            try:
                await self.store.ping()
            except DB_ERRORS as exc:
                metrics.db_errors.inc()
                log.warning("database_still_unavailable", error=str(exc),
                            retry_in=round(delay, 2))
                delay = min(delay * 2, 10.0)
                continue
            try:
                # Refresh our heartbeat before claiming again: after a long outage other
                # replicas would otherwise see our new claims under a stale heartbeat.
                await self.store.heartbeat()
            except DB_ERRORS:
                continue
            log.info("database_available")
            self._db_up.set()
            await self._gc_once()
            return

    # -- background loops --------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = max(0.2, self.s.worker_lease / 3)
        while True:
            await asyncio.sleep(interval)
            if not self._db_up.is_set():
                continue
            try:
                await self.store.heartbeat()
            except DB_ERRORS as exc:
                self._db_error(exc)

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.gc_interval)
            if self._db_up.is_set():
                await self._gc_once()

    async def _gc_once(self, startup: bool = False) -> None:
        try:
            rows = await self.store.gc(
                self.s.worker_lease,
                # "My previous incarnation" only makes sense at startup: later passes
                # must never read a same-named live replica as dead.
                (self.s.worker_name or None) if startup else None,
                _utc(self.started_at),
            )
            leaks = await self.store.gc_own_leaks(list(self._holding))
        except DB_ERRORS as exc:
            self._db_error(exc)
            return
        for r in rows:
            log.warning("orphan_released", request_id=r["request_id"], owner=r["owner"],
                        message_id=r["sqs_message_id"])
        if rows:
            metrics.orphans_collected.inc(len(rows))
        if leaks:
            log.info("own_stale_claims_released", count=len(leaks))

    async def _queue_attributes_loop(self) -> None:
        while True:
            try:
                attrs = await self.queue.attributes()
                self._sqs_ok = True
            except TransientError as exc:
                self._sqs_ok = False
                metrics.sqs_errors.labels("get_queue_attributes").inc()
                log.warning("queue_attributes_failed", error=str(exc))
            else:
                visible = int(attrs.get("ApproximateNumberOfMessages", "0"))
                metrics.queue_visible.set(visible)
                metrics.queue_not_visible.set(
                    int(attrs.get("ApproximateNumberOfMessagesNotVisible", "0")))
                if self._oldest_sent is not None:
                    self._last_oldest_sent = self._oldest_sent
                elif visible == 0:
                    self._last_oldest_sent = None
                # Nothing received but messages waiting (database down, pollers stuck):
                # the last oldest keeps ageing, which is when the age alert must fire.
                metrics.queue_oldest_age.set(
                    0 if self._last_oldest_sent is None
                    else max(0.0, time.time() - self._last_oldest_sent))
                self._oldest_sent = None
            await asyncio.sleep(self.s.queue_attributes_interval)

    def _label(self, type_: str | None) -> str:
        return type_ if type_ is not None and type_ in self.registry else INVALID_TYPE_LABEL


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _utc(ts: float) -> Any:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ts, UTC)


async def _wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


async def _sleep_or_stop(seconds: float, stop: asyncio.Event) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass

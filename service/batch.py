"""One received batch from parse to ack::

    triage (parse) ─► claim (one statement) ─► apply + complete (one txn)
          ─► record failures ─► plan carried out: dead letters → deletes → visibility

Every message ends in exactly one of: acked (its outcome is committed) or released
(visibility set so it comes back). Nothing is acked before the commit that made its
outcome durable. The visibility heartbeat keeps a slow batch hidden meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable

import structlog

from service import metrics, tracing
from service.dbhealth import DatabaseHealth
from service.errors import AckFailed, DatabaseUnavailable, TransientError
from service.executor import InFlight, PlanExecutor
from service.handlers import Registry
from service.handlers.invoke import Invoker
from service.messages import Message, Received
from service.plan import Plan, classify, describe, settle, settle_failures, triage
from service.retry import RetryPolicy
from service.seams import DeadLetter, QueueSeam, StoreSeam
from service.settings import SQS_MAX_VISIBILITY
from service.store import DB_ERRORS

log = structlog.get_logger("sqs_ingest.worker")

EXIT_ACK_FAILED = 3
Fatal = Callable[..., None]


class BatchProcessor:
    """Processes batches for one worker; ``run(batch)`` never raises (but CancelledError)."""

    def __init__(
        self,
        queue: QueueSeam,
        store: StoreSeam,
        registry: Registry,
        policy: RetryPolicy,
        health: DatabaseHealth,
        *,
        fifo: bool,
        visibility_timeout: int,
        handler_timeout: float,
        fatal: Fatal,
    ) -> None:
        self.store = store
        self.registry = registry
        self.policy = policy
        self.health = health
        self.fifo = fifo
        self.visibility_timeout = visibility_timeout
        self.invoker = Invoker(registry, handler_timeout)
        self.executor = PlanExecutor(queue, store)
        self.fatal = fatal
        # request_ids claimed by batches in flight (the own-leak GC spares them)
        self.holding: collections.Counter[str] = collections.Counter()

    async def run(self, batch: list[Received]) -> None:
        started = time.monotonic()
        flight = InFlight(batch)
        metrics.in_flight.inc(len(batch))
        flight.extender = asyncio.create_task(self._extend_visibility(flight), name="extender")
        try:
            with tracing.batch(batch):
                await self._run_guarded(flight)
        except AckFailed as exc:
            metrics.ack_failures.inc(len(exc.message_ids))
            # Exit 3 on purpose: the outcome is committed but the message stays on the
            # queue. Carrying on would leave an orphan whose redelivery could double-apply;
            # a restart runs orphan GC and redelivery resolves as a duplicate.
            self.fatal(EXIT_ACK_FAILED, "ack_failed", message_ids=exc.message_ids,
                       error=exc.detail)
        finally:
            flight.extender.cancel()
            for m in flight.claimed:
                self.holding[m.request_id] -= 1
                if self.holding[m.request_id] <= 0:
                    del self.holding[m.request_id]
            metrics.in_flight.dec(len(batch))
            metrics.batch_duration.observe(time.monotonic() - started)

    async def _run_guarded(self, flight: InFlight) -> None:
        """Process; on any failure give back what is unresolved (AckFailed propagates)."""
        try:
            await self._process(flight)
        except DatabaseUnavailable as exc:
            self.health.down(exc)
            await self._give_back(flight, self.policy.hand_back())
        except asyncio.CancelledError:
            # Shielded: a late extension must not re-hide what we release.
            await asyncio.shield(self._give_back(flight, 0))
            raise
        except TransientError as exc:
            log.warning("batch_retry_later", error=str(exc))
            await self._give_back(flight, self.policy.hand_back())
        except Exception as exc:
            log.exception("batch_failed", error=repr(exc))
            try:
                await flight.stop_extender()
                await self._give_up_on_repeat_offenders(flight, repr(exc))
            finally:
                await self._give_back(flight, self.policy.hand_back())

    async def _give_back(self, flight: InFlight, delay: int) -> None:
        await flight.stop_extender()
        await self.executor.give_back(flight, delay, self.health.is_up)

    async def _process(self, flight: InFlight) -> None:
        t = triage(flight.batch, self.registry, self.policy)
        plan = t.plan
        if t.primaries:
            for m in t.primaries:
                self.holding[m.request_id] += 1
                flight.claimed.append(m)
            with tracing.step("claim", t.primaries):
                claims = await self.store.claim(t.primaries)
            c = classify(t.primaries, claims, self.policy, self.fifo)
            if c.unclaim:
                await self.store.release(c.unclaim)
            plan.merge(c.plan)
            if c.to_apply:
                plan.merge(await self._apply(c.to_apply))
        with tracing.step("settle", [*plan.acks, *(r for r, _ in plan.releases)]):
            await self.executor.carry_out(plan, flight)

    async def _apply(self, to_apply: list[Message]) -> Plan:
        with tracing.step("commit", to_apply):
            res = await self.store.apply(
                to_apply, self.invoker.one, fifo=self.fifo, batch=self.invoker.batching
            )
        plan = settle(res, self.policy)
        if res.blocked:
            await self.store.release(res.blocked)
        if res.failed:
            failures = [(m, describe(exc)) for m, exc in res.failed]
            counts = await self.store.record_failures(failures, self.policy.max_failures)
            plan.merge(settle_failures(failures, counts, self.policy))
        return plan

    async def _extend_visibility(self, flight: InFlight) -> None:
        vt = self.visibility_timeout
        total = vt
        while True:
            await asyncio.sleep(vt / 2)
            if not flight.unresolved:
                return
            if total + vt > SQS_MAX_VISIBILITY:
                log.warning("visibility_cap_reached", message_ids=list(flight.unresolved))
                return
            # From now, the message stays hidden for another full timeout.
            changes = [(m, vt) for m in list(flight.unresolved.values())]
            await self.executor.change_visibility(changes)
            total += vt // 2
            metrics.visibility_extensions.inc(len(changes))
            log.info("visibility_extended", count=len(changes), seconds=vt)

    async def _give_up_on_repeat_offenders(self, flight: InFlight, error: str) -> None:
        """Safety net for a batch that keeps failing outside any handler (a bug, a value
        the database refuses): a message received far more often than the retry limit is
        dead-lettered so it cannot stall its neighbours forever."""
        doomed = [m for m in flight.unresolved.values()
                  if self.policy.repeat_offender(m.receive_count)]
        if not doomed or not self.health.is_up:
            return
        doomed_ids = {m.message_id for m in doomed}
        try:
            await self.store.release([m for m in flight.claimed
                                      if m.raw.message_id in doomed_ids])
            await self.store.dead_letter([
                DeadLetter.of_received(m, "processing_error", error[:2000]) for m in doomed])
        except DB_ERRORS as exc:
            log.warning("dead_letter_failed", error=str(exc))
            return
        await self.executor.queue.delete_batch(doomed)  # AckFailed propagates: exit 3
        flight.resolve(doomed)
        for m in doomed:
            metrics.dead_letters.labels("processing_error").inc()
            log.error("dead_lettered_processing_error", message_id=m.message_id,
                      receive_count=m.receive_count, error=error)

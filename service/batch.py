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
from service.budget import MemoryBudget
from service.crashpoint import AFTER_COMMIT_BEFORE_DELETE, crash_point
from service.dbhealth import DatabaseHealth
from service.errors import AckFailed, DatabaseUnavailable, DataRejected, TransientError
from service.executor import InFlight, PlanExecutor
from service.handlers import Registry
from service.handlers.invoke import Invoker
from service.labels import INVALID_TYPE_LABEL
from service.messages import Message, Received, parse
from service.payloads import S3Payloads
from service.plan import (
    Plan,
    classify,
    describe,
    settle,
    settle_failures,
    triage,
)
from service.resolve import resolve_batch
from service.retry import ReceiveLimit, RetryPolicy
from service.seams import DeadLetter, QueueSeam, StoreSeam
from service.settings import SQS_MAX_VISIBILITY

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
        payloads: S3Payloads | None = None,
        limit: ReceiveLimit,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.store = store
        self.registry = registry
        self.policy = policy
        self.health = health
        self.fifo = fifo
        self.visibility_timeout = visibility_timeout
        self.invoker = Invoker(registry, handler_timeout)
        # The live dead-letter limit: maintenance updates it from the queue's RedrivePolicy.
        self.limit = limit
        self.executor = PlanExecutor(queue, store, self.limit)
        self.fatal = fatal
        self.budget = budget  # INGEST_MAX_INFLIGHT_BYTES (None: nothing counted)
        self.payloads = payloads  # S3-offloaded payloads (None: pointers are not resolved)
        # request_ids claimed by batches in flight (the own-leak GC spares them)
        self.holding: collections.Counter[str] = collections.Counter()

    async def run(self, batch: list[Received], owner: object | None = None) -> None:
        """``owner``: who holds the batch's bytes in the memory budget (its bodies, taken by
        the poll that received it); everything it holds is given back at the end."""
        started = time.monotonic()
        flight = InFlight(batch)
        if owner is not None:
            flight.budget_owner = owner
            if self.budget is not None:
                flight.body_bytes = self.budget.holds(owner)
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
            if self.budget is not None:
                self.budget.give_all(flight.budget_owner)
            flight.extender.cancel()
            for m in flight.claimed:
                self._drop_holding(m.request_id)
            metrics.in_flight.dec(len(batch))
            metrics.batch_duration.observe(time.monotonic() - started)

    async def _run_guarded(self, flight: InFlight) -> None:
        """Process; on any failure give back what is unresolved (AckFailed propagates)."""
        try:
            await self._settle_part(flight, flight.batch)
        except AckFailed:
            raise  # exit 3 (run): never handled like a failed batch
        except DatabaseUnavailable as exc:
            self.health.down(exc)
            await self._give_back(flight, self.policy.hand_back(), deferral=True)
        except asyncio.CancelledError:
            # Shielded: a late extension must not re-hide what we release.
            await asyncio.shield(self._give_back(flight, 0, deferral=True))
            raise
        except TransientError as exc:
            log.warning("batch_retry_later", error=str(exc))
            await self._give_back(flight, self.policy.hand_back())
        except Exception as exc:
            log.exception("batch_failed", error=repr(exc))
            await self._give_back(flight, self.policy.hand_back())

    async def _give_back(self, flight: InFlight, delay: int, deferral: bool = False) -> None:
        await flight.stop_extender()
        await self.executor.give_back(flight, delay, self.health.is_up, deferral)

    async def _settle_part(
        self, flight: InFlight, part: list[Received], bisecting: bool = False
    ) -> None:
        """Process ``part``. When it fails on a value the database refuses (or while one of
        its messages keeps failing far beyond the retry limit), split it and run the halves
        until the message at fault is found alone: only that one is dead-lettered, its
        neighbours go on in the same receive."""
        part = await self._hold_back_groups(flight, part)
        try:
            await self._process(flight, part)
        except (TransientError, AckFailed):
            raise
        except Exception as exc:
            left = [m for m in part if m.message_id in flight.unresolved]
            if not left or not (bisecting or self._worth_bisecting(exc, left)):
                raise
            await self._unclaim(flight, left)
            if len(left) == 1:
                await self._blame(flight, left[0], exc)
                return
            log.warning("batch_bisected", size=len(left), error=describe(exc))
            mid = len(left) // 2
            for half in (left[:mid], left[mid:]):
                self._ensure_extender(flight)
                await self._settle_part(flight, half, bisecting=True)

    def _worth_bisecting(self, exc: BaseException, left: list[Received]) -> bool:
        return (
            isinstance(exc, DataRejected)
            or any(self._offender(m.receive_count) for m in left)
        )

    def _offender(self, receive_count: int) -> bool:
        # Far beyond the retry limit, or on the last receive before SQS's own redrive.
        return self.policy.repeat_offender(receive_count) or self.limit.last_receive(receive_count)

    async def _unclaim(self, flight: InFlight, part: list[Received]) -> None:
        """Give back the claims made for ``part`` so that its halves can claim afresh."""
        ids = {m.message_id for m in part}
        mine = [m for m in flight.claimed if m.raw.message_id in ids]
        await self.store.release(mine)
        flight.claimed = [m for m in flight.claimed if m.raw.message_id not in ids]
        for m in mine:
            self._drop_holding(m.request_id)

    async def _blame(self, flight: InFlight, m: Received, exc: BaseException) -> None:
        """A message that fails alone: dead-letter it if the database refuses one of its
        values, or if it has failed far beyond the retry limit; else hand it back."""
        if isinstance(exc, DataRejected):
            reason = "rejected_by_database"
        elif self._offender(m.receive_count):
            reason = "processing_error"
        else:
            log.warning("batch_retry_later", message_id=m.message_id, error=describe(exc))
            delay = self.policy.hand_back()
            if self.fifo and m.group_id is not None:
                # Not before an earlier message of its group handed back in this batch.
                delay = max(delay, flight.held_groups.get(m.group_id, 0))
            await flight.stop_extender()
            await self.executor.change_visibility([(m, delay)])
            flight.resolve([m])
            if self.fifo:
                flight.hold([(m, delay)])  # its group's later messages wait as long
            return
        log.error("dead_lettered_at_fault", message_id=m.message_id, reason=reason,
                  receive_count=m.receive_count, error=describe(exc))
        plan = Plan()
        item = parse(m, self.registry)
        if isinstance(item, Message):  # keep its request_id and type (dlq list, results)
            plan.letter(m, DeadLetter.of_message(item, reason, describe(exc)), item.type)
        else:
            plan.letter(m, DeadLetter.of_received(m, reason, describe(exc)), INVALID_TYPE_LABEL)
        await self.executor.carry_out(plan, flight)  # AckFailed propagates: exit 3

    async def _hold_back_groups(self, flight: InFlight, part: list[Received]) -> list[Received]:
        """FIFO: a message handed back during a bisection holds back the later messages of
        its group (visible again when it is, not before); returns the rest of ``part``."""
        if not flight.held_groups:  # every batch but a FIFO bisection's: nothing to scan
            return part
        held = [m for m in part if m.group_id is not None and m.group_id in flight.held_groups]
        if not held:
            return part
        await flight.stop_extender()
        await self.executor.change_visibility(
            [(m, flight.held_groups[m.group_id]) for m in held if m.group_id is not None])
        flight.resolve(held)
        self._ensure_extender(flight)  # the rest of the part is still to be processed
        return [m for m in part if m not in held]

    def _ensure_extender(self, flight: InFlight) -> None:
        # A finished half stopped the heartbeat before its acks; the next half needs it.
        if flight.extender is None or flight.extender.done():
            flight.extender = asyncio.create_task(
                self._extend_visibility(flight), name="extender")

    def _drop_holding(self, request_id: str) -> None:
        self.holding[request_id] -= 1
        if self.holding[request_id] <= 0:
            del self.holding[request_id]

    async def _process(self, flight: InFlight, part: list[Received]) -> None:
        owner = flight.budget_owner if self.budget is not None else None
        rest, fetched, unread, later = await resolve_batch(
            self.payloads, self.store, self.policy, part, self.fifo, owner)
        t = triage(rest, self.registry, self.policy, fetched)
        del fetched  # parsed: the payloads' bytes are not held through the commit
        plan = t.plan if unread is None else t.plan.merge(unread)
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
            if plan.letters and c.to_apply:
                # Durable before any handler runs: a letter the database refuses must fail
                # (and bisect) this part before its handlers' work is done and counted.
                await self.executor.commit_letters(plan.letters, flight)
            if c.to_apply:
                plan.merge(await self._apply(c.to_apply))
        if self.fifo:
            plan.hold_followers({m.message_id: i for i, m in enumerate(flight.batch)})
        back = [*plan.releases, *plan.deferrals]
        with tracing.step("settle", [*plan.acks, *(r for r, _ in back)]):
            await self.executor.carry_out(plan, flight)
        if plan.offloaded and self.payloads is not None and self.payloads.delete_after_ack:
            await self.payloads.delete(plan.offloaded)  # committed and acked: opt-in cleanup
        if self.fifo:
            # Within a bisection, a message handed back for any reason holds back the later
            # messages of its group in the halves still to come.
            flight.hold(back)
        if later:
            # Payloads that did not fit the memory budget: this round's are committed now,
            # their bytes go back, and the rest of the batch is resolved in another round.
            del t, plan
            assert self.budget is not None
            self.budget.give(self.budget.holds(owner) - flight.body_bytes, owner)
            await self._process(flight, later)

    async def _apply(self, to_apply: list[Message]) -> Plan:
        with tracing.step("commit", to_apply):
            res = await self.store.apply(
                to_apply, self.invoker.one, fifo=self.fifo, batch=self.invoker.batching
            )
        if res.completed:
            crash_point(AFTER_COMMIT_BEFORE_DELETE)  # tests only (service.crashpoint)
        plan = settle(res, self.policy)
        if res.blocked:
            await self.store.release(res.blocked)
        if res.failed:
            failures = [(m, describe(exc)) for m, exc in res.failed]
            # On SQS's last receive a failure is final whatever the count: the store
            # dead-letters those at one failure (ReceiveLimit.exhausted, service.redrive).
            last = [f for f in failures if self.limit.last_receive(f[0].raw.receive_count)]
            counts = await self.store.record_failures(
                [f for f in failures if f not in last], self.limit.max_failures)
            if last:
                counts.update(await self.store.record_failures(last, 1))
            plan.merge(settle_failures(failures, counts, self.policy, self.limit))
        return plan

    async def _extend_visibility(self, flight: InFlight) -> None:
        vt = self.visibility_timeout
        flight.hidden_for = flight.hidden_for or vt  # kept across restarts (bisection)
        while True:
            await asyncio.sleep(vt / 2)
            if not flight.unresolved:
                return
            if flight.hidden_for + vt > SQS_MAX_VISIBILITY:
                log.warning("visibility_cap_reached", message_ids=list(flight.unresolved))
                return
            # From now, the message stays hidden for another full timeout.
            changes = [(m, vt) for m in list(flight.unresolved.values())]
            await self.executor.change_visibility(changes)
            flight.hidden_for += vt // 2
            metrics.visibility_extensions.inc(len(changes))
            log.info("visibility_extended", count=len(changes), seconds=vt)

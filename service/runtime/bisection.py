"""Bisection of a failing part of a batch: when a part fails on a value the database
refuses (or while one of its messages keeps failing far beyond the retry limit), its halves
run again until the message at fault is found alone. Only that one is dead-lettered (or,
short of the limit, handed back); its neighbours go on in the same receive."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from service.core.claims import ClaimsRegistry
from service.core.labels import INVALID_TYPE_LABEL
from service.core.messages import Message, Received, parse
from service.core.plan import Plan, describe
from service.core.retry import ReceiveLimit, RetryPolicy
from service.core.seams import DeadLetter, StoreSeam
from service.errors import AckFailed, DataRejected, TransientError
from service.handlers import Registry
from service.runtime.executor import InFlight, PlanExecutor
from service.runtime.visibility import VisibilityHeartbeat

log = structlog.get_logger("sqs_ingest.worker")

#: One round over a part; returns the messages left for a later round (memory budget).
Process = Callable[[InFlight, list[Received]], Awaitable[list[Received]]]


class Bisection:
    """Runs ``process`` over a part of a batch, splitting it on the failures above."""

    def __init__(
        self,
        process: Process,
        *,
        executor: PlanExecutor,
        store: StoreSeam,
        registry: Registry,
        policy: RetryPolicy,
        limit: ReceiveLimit,
        fifo: bool,
        claims: ClaimsRegistry,
        heartbeat: VisibilityHeartbeat,
    ) -> None:
        self.process = process
        self.executor = executor
        self.store = store
        self.registry = registry
        self.policy = policy
        self.limit = limit
        self.fifo = fifo
        self.claims = claims
        self.heartbeat = heartbeat

    async def settle(
        self, flight: InFlight, part: list[Received], bisecting: bool = False
    ) -> None:
        """Process ``part``. When it fails on a value the database refuses (or while one of
        its messages keeps failing far beyond the retry limit), split it and run the halves
        until the message at fault is found alone: only that one is dead-lettered, its
        neighbours go on in the same receive."""
        if flight.held_groups:  # a FIFO bisection's: every other batch skips the call
            part = await self._hold_back_groups(flight, part)
        try:
            later = await self.process(flight, part)
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
            flight.bisected = True
            mid = len(left) // 2
            for half in (left[:mid], left[mid:]):
                self.heartbeat.ensure(flight)
                await self.settle(flight, half, bisecting=True)
            return
        if later:
            # The payloads that did not fit the memory budget: a later round, under the
            # heartbeat again (this round's acks stopped it) and behind what this round
            # handed back of their FIFO groups, like a bisection's next half.
            self.heartbeat.ensure(flight)
            await self.settle(flight, later, bisecting)

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
            self.claims.drop(m.request_id)

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
        self.heartbeat.ensure(flight)  # the rest of the part is still to be processed
        return [m for m in part if m not in held]

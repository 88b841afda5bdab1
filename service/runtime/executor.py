"""Carries a batch's plan out against the queue and the store, in the one safe order:
dead letters committed → deletes (acks) → visibility changes; and gives back what a
batch could not finish."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from service.core.messages import Message, Received
from service.core.plan import Plan
from service.core.retry import ReceiveLimit
from service.core.seams import DeadLetter, QueueSeam, StoreSeam
from service.errors import DB_ERRORS
from service.observe import metrics

log = structlog.get_logger("sqs_ingest.worker")


@dataclass(slots=True)
class InFlight:
    """One batch between receive and ack: what is still unresolved and which claims it
    made. Every received message ends acked or released, never both, never neither."""

    batch: list[Received]
    unresolved: dict[str, Received] = field(default_factory=dict)
    claimed: list[Message] = field(default_factory=list)
    extender: asyncio.Task[None] | None = None
    # FIFO groups that must wait (bisection): group → the longest delay handed back in it.
    held_groups: dict[str, int] = field(default_factory=dict)
    # The visibility heartbeat's clock (service.runtime.visibility): when the batch started (the
    # 12-hour cap counts from the receive), and how long after that its unresolved
    # messages stay hidden (kept across a bisection's halves).
    received_at: float | None = None
    hidden_until: float = 0.0
    budget_owner: object = field(default_factory=object)  # its bytes in the memory budget
    # Dead letters already committed (by message id): carry_out does not write them again.
    lettered: set[str] = field(default_factory=set)
    body_bytes: int = 0  # of which its bodies (the rest: payloads of the current round)
    # Split by a bisection: its parts complete through the completing transaction of
    # ``Store.apply`` only, never the fused statement of the reference handlers.
    bisected: bool = False

    def __post_init__(self) -> None:
        self.unresolved = {m.message_id: m for m in self.batch}

    def hold(self, back: Sequence[tuple[Received, int]]) -> None:
        """Remember the FIFO groups of messages handed back and how long they wait."""
        for r, delay in back:
            if r.group_id is not None:
                self.held_groups[r.group_id] = max(delay, self.held_groups.get(r.group_id, 0))

    def resolve(self, messages: Sequence[Received]) -> None:
        for m in messages:
            self.unresolved.pop(m.message_id, None)

    def mine(self) -> list[Message]:
        """The claims this batch made for messages it has not resolved."""
        return [m for m in self.claimed if m.raw.message_id in self.unresolved]

    async def stop_extender(self) -> None:
        # Before acks and releases: a late extension must not undo a release to 0.
        task = self.cancel_extender()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def cancel_extender(self) -> asyncio.Task[None] | None:
        """Cancel the heartbeat task and forget it (returned, to wait for). Kept, it is a
        reference cycle: the task's CancelledError holds the traceback, whose frame of
        ``_extend`` holds this flight, so the whole batch (messages, bodies, claims) would
        wait for the cyclic GC's rare full collection instead of going when the batch ends
        (BENCHMARKS.md, peak RSS)."""
        task, self.extender = self.extender, None
        if task is not None:
            task.cancel()
        return task


class PlanExecutor:
    """Applies plans: the only place that deletes messages or changes their visibility."""

    def __init__(
        self, queue: QueueSeam, store: StoreSeam, limit: ReceiveLimit
    ) -> None:
        self.queue = queue
        self.store = store
        self.limit = limit  # the queue's RedrivePolicy as last read (service.ops.redrive)
        # Claims of batches given back while the database was down (release_unreleased).
        self.unreleased: list[Message] = []

    async def carry_out(self, plan: Plan, flight: InFlight) -> None:
        """Letters durable first, then acks (AckFailed propagates: exit 3), then releases."""
        letters = [d for d in plan.letters if d.sqs_message_id not in flight.lettered]
        if letters:
            await self.commit_letters(letters, flight)
        for reason in plan.dead_letter_reasons:
            metrics.dead_letters.labels(reason).inc()
        for lag in plan.lags:
            metrics.message_lag.observe(lag)
        if plan.contention:
            metrics.contention_deferrals.inc(plan.contention)
        await flight.stop_extender()
        if plan.acks:
            await self.queue.delete_batch(plan.acks)
            flight.resolve(plan.acks)
        # Counted per batch: one increment per (type, outcome), not one per message.
        for (type_, outcome), n in collections.Counter(plan.outcomes).items():
            metrics.messages_processed.labels(type_, outcome).inc(n)
        # One line per batch, at debug only (a no-op call at info).
        log.debug("batch_processed", received=len(flight.batch), released=len(plan.releases),
                  **collections.Counter(outcome for _, outcome in plan.outcomes))
        # Releases and the deferrals that need no fresh copy: one ChangeMessageVisibility
        # call, as before deferrals had a name of their own (_copy of none calls nothing).
        back = [*plan.releases, *await self._copy(plan.deferrals)]
        if back:
            await self.change_visibility(back)
        if plan.releases or plan.deferrals:
            flight.resolve([r for r, _ in (*plan.releases, *plan.deferrals)])

    async def commit_letters(self, letters: Sequence[DeadLetter], flight: InFlight) -> None:
        """Make ``letters`` durable now (before a batch's handlers run); ``carry_out`` then
        does not write them again."""
        await self.store.dead_letter(letters)
        flight.lettered.update(d.sqs_message_id for d in letters)

    async def change_visibility(self, changes: Sequence[tuple[Received, int]]) -> None:
        failed = await self.queue.change_visibility_batch(changes)
        if failed:
            # Not fatal: the message reappears when its current visibility runs out.
            metrics.sqs_errors.labels("change_visibility").inc(len(failed))
            log.warning("change_visibility_failed", message_ids=failed)

    async def hand_back(self, changes: Sequence[tuple[Received, int]]) -> None:
        """Messages deferred through no fault of their own: visible again after their delay,
        except those ``_copy`` replaces with fresh copies."""
        plain = await self._copy(changes)
        if plain:
            await self.change_visibility(plain)

    async def _copy(
        self, changes: Sequence[tuple[Received, int]]
    ) -> list[tuple[Received, int]]:
        """Sends a fresh copy of each message a hand-back would bring too close to the
        queue's maxReceiveCount (``ReceiveLimit.must_requeue``); returns the others, and
        those whose copy could not be sent, for the plain hand-back."""
        limit = self.limit
        fresh: list[tuple[Received, int]] = []
        plain: list[tuple[Received, int]] = []
        for change in changes:
            (fresh if limit.must_requeue(change[0].receive_count) else plain).append(change)
        if fresh:
            failed = set(await self.queue.requeue(fresh))
            if len(failed) < len(fresh):
                metrics.requeued.inc(len(fresh) - len(failed))
                log.info("requeued_fresh_copies", count=len(fresh) - len(failed),
                         receive_counts=sorted({m.receive_count for m, _ in fresh}))
            if failed:
                metrics.sqs_errors.labels("requeue").inc(len(failed))
                log.warning("requeue_failed", message_ids=sorted(failed))
                plain += [(m, d) for m, d in fresh if m.message_id in failed]
        return plain

    async def release_unreleased(self) -> None:
        """Once the database is back: release the claims of batches given back during the
        outage. Left alone, they would keep their messages' copies contended (a fresh copy
        or a receive each time) until the own-leak GC's age margin passed. One attempt:
        what fails stays for that GC, which must not race a later claim of the same key."""
        pending, self.unreleased = self.unreleased, []
        if not pending:
            return
        try:
            await self.store.release(pending)
        except DB_ERRORS as exc:
            log.warning("release_failed", error=str(exc))
        else:
            log.info("claims_released_after_outage", count=len(pending))

    async def give_back(
        self, flight: InFlight, delay: int, db_up: bool, deferral: bool = False
    ) -> None:
        """What a batch could not finish: its claims released, its messages visible after
        ``delay`` (``deferral``: not the messages' fault — an outage, a shutdown — so
        ``hand_back`` decides between a hand-back and a fresh copy)."""
        if not flight.unresolved:
            return
        mine = flight.mine()
        if mine and db_up:
            try:
                await self.store.release(mine)
            except DB_ERRORS as exc:
                log.warning("release_failed", error=str(exc))
                self.unreleased += mine
        elif mine:
            self.unreleased += mine
        try:
            changes = [(m, delay) for m in flight.unresolved.values()]
            await (self.hand_back(changes) if deferral else self.change_visibility(changes))
        except Exception as exc:  # the message comes back by itself after the timeout
            log.warning("abandon_visibility_failed", error=repr(exc))
        flight.unresolved.clear()

"""Carries a batch's plan out against the queue and the store, in the one safe order:
dead letters committed → deletes (acks) → visibility changes; and gives back what a
batch could not finish."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from service import metrics
from service.messages import Message, Received
from service.plan import Plan
from service.seams import QueueSeam, StoreSeam
from service.store import DB_ERRORS

log = structlog.get_logger("sqs_ingest.worker")


@dataclass(slots=True)
class InFlight:
    """One batch between receive and ack: what is still unresolved and which claims it
    made. Every received message ends acked or released, never both, never neither."""

    batch: list[Received]
    unresolved: dict[str, Received] = field(default_factory=dict)
    claimed: list[Message] = field(default_factory=list)
    extender: asyncio.Task[None] | None = None
    held_groups: set[str] = field(default_factory=set)  # FIFO groups that must wait
    hidden_for: int = 0  # seconds of visibility so far (the 12-hour cap counts from receive)

    def __post_init__(self) -> None:
        self.unresolved = {m.message_id: m for m in self.batch}

    def resolve(self, messages: Sequence[Received]) -> None:
        for m in messages:
            self.unresolved.pop(m.message_id, None)

    def mine(self) -> list[Message]:
        """The claims this batch made for messages it has not resolved."""
        return [m for m in self.claimed if m.raw.message_id in self.unresolved]

    async def stop_extender(self) -> None:
        # Before acks and releases: a late extension must not undo a release to 0.
        if self.extender is not None:
            self.extender.cancel()
            await asyncio.gather(self.extender, return_exceptions=True)


class PlanExecutor:
    """Applies plans: the only place that deletes messages or changes their visibility."""

    def __init__(self, queue: QueueSeam, store: StoreSeam) -> None:
        self.queue = queue
        self.store = store

    async def carry_out(self, plan: Plan, flight: InFlight) -> None:
        """Letters durable first, then acks (AckFailed propagates: exit 3), then releases."""
        if plan.letters:
            await self.store.dead_letter(plan.letters)
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
        for type_, outcome in plan.outcomes:
            metrics.messages_processed.labels(type_, outcome).inc()
        # One line per batch, at debug only (a no-op call at info).
        log.debug("batch_processed", received=len(flight.batch), released=len(plan.releases),
                  **collections.Counter(o for _, o in plan.outcomes))
        if plan.releases:
            await self.change_visibility(plan.releases)
            flight.resolve([r for r, _ in plan.releases])

    async def change_visibility(self, changes: Sequence[tuple[Received, int]]) -> None:
        failed = await self.queue.change_visibility_batch(changes)
        if failed:
            # Not fatal: the message reappears when its current visibility runs out.
            metrics.sqs_errors.labels("change_visibility").inc(len(failed))
            log.warning("change_visibility_failed", message_ids=failed)

    async def give_back(self, flight: InFlight, delay: int, db_up: bool) -> None:
        """What a batch could not finish: its claims released, its messages visible after
        ``delay``."""
        if not flight.unresolved:
            return
        mine = flight.mine()
        if mine and db_up:
            try:
                await self.store.release(mine)
            except DB_ERRORS as exc:
                # The periodic own-leak GC releases them once the database is back.
                log.warning("release_failed", error=str(exc))
        try:
            await self.change_visibility([(m, delay) for m in flight.unresolved.values()])
        except Exception as exc:  # the message comes back by itself after the timeout
            log.warning("abandon_visibility_failed", error=repr(exc))
        flight.unresolved.clear()

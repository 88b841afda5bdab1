"""One received batch from parse to ack::

    triage (parse) ─► claim (one statement) ─► apply + complete (one txn)
          ─► record failures ─► plan carried out: dead letters → deletes → visibility

Every message ends in exactly one of: acked (its outcome is committed) or released
(visibility set so it comes back). Nothing is acked before the commit that made its
outcome durable. The visibility heartbeat (``service.runtime.visibility``) keeps a slow batch
hidden meanwhile; a part that fails on one message is split (``service.runtime.bisection``); the
claims of batches in flight are counted in ``service.core.claims`` for the own-leak GC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import structlog

from service.adapters.payloads import S3Payloads
from service.core.budget import MemoryBudget
from service.core.claims import ClaimsRegistry
from service.core.messages import Message, Received
from service.core.plan import (
    Plan,
    classify,
    describe,
    letters_ahead,
    settle,
    settle_failures,
    triage,
    wait_behind_letters,
)
from service.core.registry import EntityRow
from service.core.retry import ReceiveLimit, RetryPolicy
from service.core.seams import ClaimResult, QueueSeam, StoreSeam
from service.errors import AckFailed, DatabaseUnavailable, TransientError
from service.handlers import Registry
from service.handlers.invoke import Invoker
from service.observe import metrics, tracing
from service.runtime.bisection import Bisection
from service.runtime.dbhealth import DatabaseHealth
from service.runtime.executor import InFlight, PlanExecutor
from service.runtime.resolve import resolve_batch
from service.runtime.visibility import VisibilityHeartbeat

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
        self.invoker = Invoker(registry, handler_timeout)
        # The live dead-letter limit: maintenance updates it from the queue's RedrivePolicy.
        self.limit = limit
        self.executor = PlanExecutor(queue, store, self.limit)
        self.fatal = fatal
        self.budget = budget  # INGEST_MAX_INFLIGHT_BYTES (None: nothing counted)
        self.payloads = payloads  # S3-offloaded payloads (None: pointers are not resolved)
        # request_ids claimed by batches in flight (the own-leak GC spares them)
        self.holding = ClaimsRegistry()
        self.heartbeat = VisibilityHeartbeat(self.executor, visibility_timeout)
        self.bisection = Bisection(
            self._process, executor=self.executor, store=store, registry=registry,
            policy=policy, limit=limit, fifo=fifo, claims=self.holding,
            heartbeat=self.heartbeat)

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
        self.heartbeat.ensure(flight)
        try:
            with tracing.batch(batch):
                await self._run_guarded(flight)
        except AckFailed as exc:
            self.ack_failed(exc)
        finally:
            if self.budget is not None:
                self.budget.give_all(flight.budget_owner)
            flight.cancel_extender()
            for m in flight.claimed:
                self.holding.drop(m.request_id)
            metrics.in_flight.dec(len(batch))
            metrics.batch_duration.observe(time.monotonic() - started)

    def ack_failed(self, exc: AckFailed) -> None:
        metrics.ack_failures.inc(len(exc.message_ids))
        # Exit 3 on purpose: the outcome is committed but the message stays on the queue.
        # Carrying on would leave an orphan whose redelivery could double-apply; a restart
        # runs orphan GC and redelivery resolves as a duplicate.
        self.fatal(EXIT_ACK_FAILED, "ack_failed", message_ids=exc.message_ids,
                   error=exc.detail)

    async def _run_guarded(self, flight: InFlight) -> None:
        """Process; on any failure give back what is unresolved (AckFailed propagates)."""
        try:
            await self.bisection.settle(flight, flight.batch)
        except AckFailed:
            raise  # exit 3 (run): never handled like a failed batch
        except DatabaseUnavailable as exc:
            # Also DatabaseBusy (a lock or statement timeout, a deadlock, a read-only
            # database): no message's fault, so no receive of theirs is spent on it either
            # (a deferral: fresh copies near maxReceiveCount), and receiving pauses until a
            # probe passes.
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

    async def _process(self, flight: InFlight, part: list[Received]) -> list[Received]:
        """One round over ``part``; returns the messages left for a later round (their
        payloads did not fit the memory budget): ``Bisection.settle`` runs it."""
        owner = flight.budget_owner if self.budget is not None else None
        rest, fetched, unread, later = await resolve_batch(
            self.payloads, self.store, self.policy, part, self.fifo, owner)
        t = triage(rest, self.registry, self.policy, fetched)
        del fetched  # parsed: the payloads' bytes are not held through the commit
        plan = t.plan if unread is None else t.plan.merge(unread)
        if t.primaries:
            await self._claim_and_apply(flight, t.primaries, plan)
        if self.fifo:
            plan.hold_letters(self._positions(flight), flight.lettered)
            plan.hold_followers(self._positions(flight))
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
            assert self.budget is not None
            self.budget.give(self.budget.holds(owner) - flight.body_bytes, owner)
        return later

    async def _claim_and_apply(self, flight: InFlight, primaries: list[Message],
                               plan: Plan) -> None:
        """Claim ``primaries``, run the handlers of those claimed, and merge what was
        decided into ``plan``."""
        for m in primaries:
            self.holding.hold(m.request_id)
            flight.claimed.append(m)
        with tracing.step("claim", primaries):
            claims = await self.store.claim(primaries)
        _note_taken_over(claims.values())
        c = classify(primaries, claims, self.policy, self.fifo)
        if self.fifo and plan.letters:
            # A group's results leave in its order (below): a message to apply behind
            # a letter written after the commit waits for the next receive.
            wait_behind_letters(c, plan.letters, self._positions(flight))
        if c.unclaim:
            await self.store.release(c.unclaim)
        plan.merge(c.plan)
        letters = plan.letters
        if self.fifo and letters:
            # A group's results leave in its order: a letter behind a message handed
            # back waits with it; behind a message to apply, it is written after that
            # one's commit (by carry_out).
            plan.hold_letters(self._positions(flight), flight.lettered)
            letters = letters_ahead(plan.letters, c.to_apply, self._positions(flight))
        if letters and c.to_apply:
            # Durable before any handler runs: a letter the database refuses must fail
            # (and bisect) this part before its handlers' work is done and counted.
            await self.executor.commit_letters(letters, flight)
        if c.to_apply:
            plan.merge(await self._apply(c.to_apply, flight.bisected))

    @staticmethod
    def _positions(flight: InFlight) -> dict[str, int]:
        """Message id → its place in the batch as received (FIFO: its group's order)."""
        return {m.message_id: i for i, m in enumerate(flight.batch)}

    async def _apply(self, to_apply: list[Message], bisecting: bool) -> Plan:
        with tracing.step("commit", to_apply):
            # The reference handlers alone: the store may apply it in one statement.
            rows = None if bisecting else self._entity_rows(to_apply)
            res = await self.store.apply(
                to_apply, self.invoker.one, fifo=self.fifo, batch=self.invoker.batching,
                entity_rows=rows, time_limit=self.invoker.timeout,
            )
        plan = settle(res, self.policy)
        if res.blocked:
            await self.store.release(res.blocked)
        if res.failed:
            failures = [(m, describe(exc)) for m, exc in res.failed]
            # On SQS's last receive a failure is final whatever the count: the store
            # dead-letters those at one failure (ReceiveLimit.exhausted, service.ops.redrive).
            last = [f for f in failures if self.limit.last_receive(f[0].raw.receive_count)]
            counts = await self.store.record_failures(
                [f for f in failures if f not in last], self.limit.max_failures)
            if last:
                counts.update(await self.store.record_failures(last, 1))
            plan.merge(settle_failures(failures, counts, self.policy, self.limit))
        return plan

    def _entity_rows(self, to_apply: list[Message]) -> list[EntityRow] | None:
        """The entity rows of a batch the reference handlers carry alone — standard queue,
        every type's handler has one (``HandlerSpec.entity_row``), no entity twice — for
        the store's one statement; None: the completing transaction (``Store.apply``)."""
        if self.fifo:
            return None
        rows: list[EntityRow] = []
        seen: set[str] = set()
        for m in to_apply:
            spec = self.registry.get(m.type)
            if spec is None or spec.entity_row is None:
                return None
            row = spec.entity_row(m.payload)
            if row[0] in seen:
                return None
            seen.add(row[0])
            rows.append(row)
        return rows


def _note_taken_over(claims: Iterable[ClaimResult]) -> None:
    """Claims of dead owners the claim statement took over: orphans collected, as by GC."""
    taken = [c for c in claims if c.collected_from is not None]
    for c in taken:
        log.warning("orphan_taken_over", request_id=c.request_id, owner=c.collected_from)
    if taken:
        metrics.orphans_collected.inc(len(taken))

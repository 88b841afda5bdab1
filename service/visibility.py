"""The visibility heartbeat of a batch in flight: while any of its messages is unresolved,
every half visibility timeout they are hidden for another full one, up to SQS's 12-hour
cap counted from the receive (``InFlight.hidden_for``, kept across a bisection's halves)."""

from __future__ import annotations

import asyncio

import structlog

from service import metrics
from service.executor import InFlight, PlanExecutor
from service.settings import SQS_MAX_VISIBILITY

log = structlog.get_logger("sqs_ingest.worker")


class VisibilityHeartbeat:
    """Starts and runs ``flight.extender``; ``InFlight.stop_extender`` stops it."""

    def __init__(self, executor: PlanExecutor, visibility_timeout: int) -> None:
        self.executor = executor
        self.visibility_timeout = visibility_timeout

    def ensure(self, flight: InFlight) -> None:
        """Start the flight's heartbeat unless it runs: a finished half of a bisection
        stopped it before its acks, and the next half needs it again."""
        if flight.extender is None or flight.extender.done():
            flight.extender = asyncio.create_task(self._extend(flight), name="extender")

    async def _extend(self, flight: InFlight) -> None:
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

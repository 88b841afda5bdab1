"""The visibility heartbeat of a batch in flight: while any of its messages is unresolved,
every half visibility timeout they are hidden for another full one, up to SQS's 12-hour
cap counted from the receive (``InFlight.received_at``, kept across a bisection's halves).

The cap is read from a clock, not counted in ticks: each tick comes late by the
ChangeMessageVisibility call before it (and the batch starts after the receive), so a
count of vt/2 per tick falls behind the real time, and SQS rejects a change that asks past
the cap — it does not trim it — leaving a rejected call every vt/2 until the count caught
up (hours of them for an odd vt, whose vt // 2 lost half a second per tick).

Extensions of concurrent batches share ChangeMessageVisibilityBatch calls (ten entries
each): a batch of fewer than ten unresolved messages wakes up to ``linger`` (a tenth of
the timeout) before its extension is due and waits, until then at most, for the
extensions of other batches falling due meanwhile (``ExtensionCoalescer``). No extension
goes later than it would alone: the linger is taken before the due time, never out of the
half timeout of cover left then. The calls then come back together, so the batches stay
due together while they run."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable

import structlog

from service.adapters.coalesce import MAX_ENTRIES, ExtensionCoalescer
from service.observe import metrics
from service.runtime.executor import InFlight, PlanExecutor
from service.settings import MIN_VISIBILITY_TIMEOUT, SQS_MAX_VISIBILITY

log = structlog.get_logger("sqs_ingest.worker")

#: Seconds kept off the 12-hour cap: the batch's clock starts after its receives returned
#: (their response, the follow-up receives) and a change reaches SQS after it was asked
#: (the call's latency, its retries). A minute less of cover at 12 hours changes nothing.
CAP_MARGIN = 60

#: The heartbeat's default linger, as a fraction of the visibility timeout. A batch that
#: joins others' call goes up to this early; as the next extension is due half a timeout
#: after the call, a batch is extended at most vt/2 / (vt/2 - linger) = 1.25 times as often.
LINGER_FRACTION = 0.1


def extension(vt: int, elapsed: float, hidden_until: float) -> int:
    """Seconds to hide a batch's messages for, ``elapsed`` seconds after their receive: a
    full timeout, or what is left of SQS's 12 hours (less CAP_MARGIN) when that is less;
    0 when that would not hide them past ``hidden_until`` (where they stay hidden now:
    ChangeMessageVisibility counts from the call, so it can also shorten)."""
    seconds = min(vt, math.floor(SQS_MAX_VISIBILITY - CAP_MARGIN - elapsed))
    return seconds if elapsed + seconds > hidden_until else 0


class VisibilityHeartbeat:
    """Starts and runs ``flight.extender``; ``InFlight.stop_extender`` stops it."""

    def __init__(
        self,
        executor: PlanExecutor,
        visibility_timeout: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        linger: float | None = None,
    ) -> None:
        if visibility_timeout < MIN_VISIBILITY_TIMEOUT:
            # vt / 2 would be a tick under a second (0: a loop of calls that never sleeps).
            raise ValueError(f"visibility timeout {visibility_timeout} < "
                             f"{MIN_VISIBILITY_TIMEOUT}: the heartbeat cannot keep up")
        self.visibility_timeout = visibility_timeout
        self.clock = clock
        self.sleep = sleep
        #: Seconds before its due time a small batch's extension waits for others' (0: each
        #: batch's goes on its own at its due time). At most a quarter timeout: after a
        #: call, the next wake-up must come at least a quarter timeout later.
        self.linger = min(visibility_timeout * LINGER_FRACTION if linger is None else linger,
                          visibility_timeout / 4)
        # One for all the worker's batches: extensions falling due close together share
        # calls (each extension gives its own linger).
        self.extensions = ExtensionCoalescer(executor.change_visibility, clock=clock, sleep=sleep)

    def ensure(self, flight: InFlight) -> None:
        """Start the flight's heartbeat unless it runs: a finished half of a bisection
        stopped it before its acks, and the next half needs it again."""
        if flight.received_at is None:
            flight.received_at = self.clock()  # the batch starts as its receives return
        if flight.extender is None or flight.extender.done():
            flight.extender = asyncio.create_task(
                self._extend(flight, flight.received_at), name="extender")

    async def _extend(self, flight: InFlight, received_at: float) -> None:
        vt = self.visibility_timeout
        flight.hidden_until = flight.hidden_until or vt  # the receive hid them for vt
        # Restarted (a bisection's next half): the next extension is due when half a timeout
        # of cover is left, not half a timeout after the restart (which could come after it).
        wait = min(vt / 2, max(0.0, flight.hidden_until - (self.clock() - received_at) - vt / 2))
        while True:
            # A small batch wakes ``early`` before its extension is due and waits for others'
            # until then; ten or more go alone, at their due time.
            early = min(self.linger, wait) if len(flight.unresolved) < MAX_ENTRIES else 0.0
            await self.sleep(wait - early)
            wait = vt / 2
            if not flight.unresolved:
                return
            elapsed = self.clock() - received_at
            # The change may reach SQS up to ``early`` later: it must not ask past the cap then.
            seconds = extension(vt, elapsed + early, flight.hidden_until)
            if seconds <= 0:
                log.warning("visibility_cap_reached", message_ids=list(flight.unresolved),
                            hidden_until=round(flight.hidden_until))
                return
            # From now, the messages stay hidden for another full timeout (or to the cap).
            changes = [(m, seconds) for m in list(flight.unresolved.values())]
            await self.extensions.submit(changes, early)
            # Counted from the ask: the messages are hidden at least that long.
            flight.hidden_until = elapsed + seconds
            metrics.visibility_extensions.inc(len(changes))
            log.info("visibility_extended", count=len(changes), seconds=seconds)

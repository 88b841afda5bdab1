"""Every delay the daemon decides: the retry policy for messages (visibility backoff,
contention, outage hand-back) and the capped backoff of its reconnect loops."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from service.settings import SQS_MAX_VISIBILITY, Settings


@dataclass(frozen=True)
class RetryPolicy:
    """Visibility delays, in whole seconds, for messages handed back to the queue.

    "Equal jitter" everywhere: half fixed, half random, so replicas spread out but a
    retry never comes back at once.
    """

    base_seconds: float = 2.0
    max_seconds: float = 900.0
    contention_seconds: float = 5.0
    max_failures: int = 5
    rng: Callable[[], float] = random.random

    @classmethod
    def from_settings(
        cls, s: Settings, rng: Callable[[], float] = random.random
    ) -> RetryPolicy:
        return cls(s.retry_base_seconds, s.retry_max_seconds, s.contention_delay,
                   s.max_receive_count, rng)

    def jittered(self, seconds: float) -> int:
        return min(SQS_MAX_VISIBILITY, math.ceil(seconds / 2 + self.rng() * seconds / 2))

    def backoff(self, receive_count: int) -> int:
        """After a handler failure: base * 2^(receives - 1), capped."""
        base = self.base_seconds * (2 ** min(30, max(0, receive_count - 1)))
        return self.jittered(min(self.max_seconds, base))

    def contention(self) -> int:
        """Another live owner holds the claim: come back after it finished (never 0)."""
        return max(1, self.jittered(self.contention_seconds))

    def hand_back(self) -> int:
        """Not the message's fault (outage, a transient error): a short delay."""
        return self.jittered(self.base_seconds)

    def exhausted(self, failures: int) -> bool:
        return failures >= self.max_failures

    def repeat_offender(self, receive_count: int) -> bool:
        """Received far more often than the retry limit while its batch keeps failing
        outside any handler: the safety net dead-letters it."""
        return receive_count > self.max_failures * 3


class Backoff:
    """Capped exponential backoff for a reconnect loop: ``await b.wait(stop)``."""

    def __init__(self, first: float = 0.5, cap: float = 10.0) -> None:
        self.first = first
        self.cap = cap
        self.delay = first

    def reset(self) -> None:
        self.delay = self.first

    async def wait(self, stop: asyncio.Event) -> bool:
        """Sleep the current delay (doubling it for next time); True if stop was set."""
        stopped = await sleep_or_stop(self.delay, stop)
        self.delay = min(self.delay * 2, self.cap)
        return stopped


async def sleep_or_stop(seconds: float, stop: asyncio.Event) -> bool:
    """Sleep, cut short by ``stop``; True when stop is set."""
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


async def wait_any(*events: asyncio.Event) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()

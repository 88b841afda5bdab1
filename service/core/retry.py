"""Every delay and limit the daemon decides: the retry policy for messages (visibility
backoff, contention, outage hand-back), the receive limit the queue's ``RedrivePolicy``
lowers (``ReceiveLimit``), and the capped backoff of its reconnect loops. No I/O."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from service.settings import SQS_MAX_VISIBILITY, Settings

log = structlog.get_logger("sqs_ingest.redrive")


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


@dataclass(frozen=True, slots=True)
class RedrivePolicy:
    """The queue attribute ``RedrivePolicy``: where SQS moves a message, and after how many
    receives."""

    dead_letter_target_arn: str
    max_receive_count: int

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, str]) -> RedrivePolicy | None:
        """None when the queue has no policy (or one this daemon cannot read: logged)."""
        raw = attributes.get("RedrivePolicy")
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            # SQS returns maxReceiveCount as a number; some tools store it as a string.
            return cls(str(doc["deadLetterTargetArn"]), int(doc["maxReceiveCount"]))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("redrive_policy_unreadable", value=raw[:300], error=repr(exc))
            return None


class ReceiveLimit:
    """The daemon's dead-letter limit as it stands now, shared by the batch path (which
    reads it) and maintenance (which updates it from the queue's attributes).

    SQS moves a message to the policy's dead-letter queue on the receive after
    ``maxReceiveCount``; the daemon must dead-letter an always-failing message itself before
    that, so its failure limit is ``min(INGEST_MAX_RECEIVE_COUNT, maxReceiveCount)`` and a
    failure on the last receive SQS allows is final (``service.ops.redrive`` for the rest)."""

    def __init__(self, configured: int, fifo: bool = False) -> None:
        self.configured = configured  # INGEST_MAX_RECEIVE_COUNT
        self.fifo = fifo
        self.policy: RedrivePolicy | None = None

    @property
    def max_failures(self) -> int:
        """Handler failures before the daemon dead-letters a message."""
        if self.policy is None:
            return self.configured
        return min(self.configured, self.policy.max_receive_count)

    def last_receive(self, receive_count: int) -> bool:
        """SQS moves this message to its dead-letter queue if it is received again."""
        return self.policy is not None and receive_count >= self.policy.max_receive_count

    def exhausted(self, failures: int, receive_count: int) -> bool:
        """A handler failure that must be final: the limit, or SQS's last receive."""
        return failures >= self.max_failures or self.last_receive(receive_count)

    def must_requeue(self, receive_count: int) -> bool:
        """A message handed back through no fault of its own (contention, outage, shutdown):
        True when a plain hand-back would leave SQS fewer receives than the daemon's tries,
        so a fresh copy has to replace it. FIFO: only when the next receive would move it
        (a copy goes behind its group's later messages; order yields only to data loss)."""
        if self.policy is None:
            return False
        left = self.policy.max_receive_count - receive_count
        if self.fifo:
            return left <= 0
        return left < self.max_failures

    def update(self, attributes: Mapping[str, str]) -> bool:
        """Take the policy from GetQueueAttributes; say so in the log when it changed.
        True when it changed (the caller updates ``sqs_ingest_receive_limit``)."""
        policy = RedrivePolicy.from_attributes(attributes)
        if policy == self.policy:
            return False
        before, self.policy = self.policy, policy
        if policy is None:
            log.info("redrive_policy_removed", max_failures=self.max_failures)
        elif policy.max_receive_count < self.configured:
            log.warning(
                "receive_limit_lowered_by_redrive_policy",
                configured=self.configured, max_receive_count=policy.max_receive_count,
                max_failures=self.max_failures, dead_letter_queue=policy.dead_letter_target_arn,
                hint="INGEST_MAX_RECEIVE_COUNT is above the queue's maxReceiveCount: the "
                     "daemon dead-letters on the last receive SQS allows")
        else:
            log.info("redrive_policy", max_receive_count=policy.max_receive_count,
                     max_failures=self.max_failures,
                     dead_letter_queue=policy.dead_letter_target_arn, changed=before is not None)
        return True


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

"""The receive loop's own health: a failed receive makes the daemon not ready, the next
successful one makes it ready again (without waiting for GetQueueAttributes)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from pydantic import BaseModel

from service.errors import TransientError
from service.handlers import Registry
from service.testing import FakeQueue
from tests.unit.test_worker import Harness, body, settings, until


class Note(BaseModel):
    n: int


class Flaky(FakeQueue):
    """ReceiveMessage fails while ``failing``; GetQueueAttributes always fails (so only a
    receive can tell that SQS is back)."""

    failing = True
    failures = 0

    async def receive(self, *a: Any, **k: Any) -> list[Any]:
        if self.failing:
            self.failures += 1
            raise TransientError("ReceiveMessage failed: injected")
        return await super().receive(*a, **k)

    async def attributes(self) -> dict[str, str]:
        raise TransientError("GetQueueAttributes failed: injected")


async def test_a_successful_receive_after_failures_makes_the_daemon_ready() -> None:
    r = Registry()

    async def note(p: Note, conn: Any) -> None:
        return None

    r.register("note", Note, note)
    q = Flaky()
    async with Harness(settings(pollers=1, queue_attributes_interval=3600), r, q) as h:
        await until(lambda: q.failures >= 1, "a receive failed")
        assert h.worker.readiness()[1]["sqs"] is False
        q.failing = False
        q.send(body("r1", 1))
        await until(lambda: not q.messages, "received and processed")
        assert h.worker.readiness()[1]["sqs"] is True


async def test_every_outcome_and_reason_series_exists_from_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first dead letter after a restart must be visible to increase(): its series has
    to exist (at 0) before it is incremented."""
    from service.core import labels
    from service.observe import metrics

    # dead_letters gets a registry of its own: on the shared one, another test's dead
    # letter would have made the series already. The type below is new to the shared one.
    own = CollectorRegistry()
    monkeypatch.setattr(metrics, "dead_letters", Counter(
        "sqs_ingest_dead_letters", "test copy", ["reason"], registry=own))
    r = Registry()

    async def note(p: Note, conn: Any) -> None:
        return None

    r.register("prime.check", Note, note)
    value = metrics.REGISTRY.get_sample_value
    async with Harness(settings(pollers=1), r, FakeQueue()):
        await until(lambda: value("sqs_ingest_messages_processed_total",
                                  {"type": "prime.check", "outcome": "retried"}) == 0,
                    "the series of a type nothing was processed for, at 0")
        assert {o: value("sqs_ingest_messages_processed_total",
                         {"type": "prime.check", "outcome": o})
                for o in labels.OUTCOMES} == dict.fromkeys(labels.OUTCOMES, 0.0)
        assert {r: own.get_sample_value("sqs_ingest_dead_letters_total", {"reason": r})
                for r in labels.DEAD_LETTER_REASONS} == dict.fromkeys(
                    labels.DEAD_LETTER_REASONS, 0.0)

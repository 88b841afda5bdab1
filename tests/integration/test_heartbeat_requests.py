"""The visibility heartbeat against moto's SQS through the counting proxy
(tests/faultproxy.py): the extensions of concurrent batches that fall due together go in
ceil(messages / 10) ChangeMessageVisibilityBatch requests, not one per batch, and SQS
accepts every entry."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import pytest

from service.adapters.sqs import SqsQueue
from service.adapters.sqs import sqs_client as aio_sqs_client
from service.core.messages import Received
from service.core.retry import ReceiveLimit
from service.observe import metrics
from service.runtime.executor import InFlight, PlanExecutor
from service.runtime.visibility import VisibilityHeartbeat
from tests.faultproxy import FaultProxy

SIZES = [1, 2, 3, 1, 2, 3, 2]  # seven small batches, 14 messages
VT = 4  # a tick every 2 s, a linger of 0.4 s


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


class OneRound(PlanExecutor):
    """The real executor; each message is resolved once its first extension is answered,
    so every batch's heartbeat ends at its next tick: one round is counted, whatever the
    machine's speed."""

    flights: list[InFlight]

    async def change_visibility(self, changes: Sequence[tuple[Received, int]]) -> None:
        await super().change_visibility(changes)
        for flight in self.flights:
            flight.resolve([m for m, _ in changes])


@pytest.mark.parametrize("fifo", [False, True])
async def test_concurrent_batches_extensions_take_ceil_messages_over_ten_requests(
        sqs_client: Any, queue_url: str, fifo_queue_url: str, sqs_endpoint: str,
        fifo: bool) -> None:
    url = fifo_queue_url if fifo else queue_url
    for i in range(sum(SIZES)):
        extra = {"MessageGroupId": f"g{i}"} if fifo else {}
        sqs_client.send_message(QueueUrl=url, MessageBody=f'{{"n": {i}}}', **extra)
    errors = sample("sqs_ingest_sqs_errors_total", operation="change_visibility")
    extended = sample("sqs_ingest_visibility_extensions_total")
    with FaultProxy(sqs_endpoint) as proxy:
        async with aio_sqs_client("us-east-1", proxy.url) as client:
            queue = SqsQueue(client, url)
            batches = [await queue.receive(n, 0, VT) for n in SIZES]
            assert [len(b) for b in batches] == SIZES
            executor = OneRound(queue, None, ReceiveLimit(5))  # type: ignore[arg-type]
            executor.flights = [InFlight(b) for b in batches]
            heartbeat = VisibilityHeartbeat(executor, VT)
            for flight in executor.flights:  # the batches started together
                heartbeat.ensure(flight)
            await asyncio.wait_for(asyncio.gather(
                *(f.extender for f in executor.flights if f.extender is not None)), 30)
    assert sample("sqs_ingest_visibility_extensions_total") - extended == sum(SIZES)
    assert sample("sqs_ingest_sqs_errors_total", operation="change_visibility") == errors
    assert proxy.by_action["ChangeMessageVisibilityBatch"] == math.ceil(sum(SIZES) / 10) == 2

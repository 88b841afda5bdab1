"""FIFO group order across kill -9, on LocalStack's SQS (whose FIFO queues hold a group
while a message of it is in flight, as SQS does) — the question moto's emulator left open
(README "Known issues"): the reordering seen there is the emulator's; here the order holds,
and the test turns red when the daemon applies a batch out of order."""

from __future__ import annotations

import random
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.acceptance.harness import (
    Daemon,
    Workload,
    chaos_seed,
    check_group_order,
    check_invariants,
    daemon_env,
    fifo_ledger,
    in_flight,
    send_fifo,
    wait_drained,
)
from tests.faultproxy import FaultProxy
from tests.servers import wait_until


@pytest.mark.timeout(420)
async def test_fifo_kill_9_keeps_group_order_and_applies_once_on_localstack(
    localstack: str, database_url: str, tmp_path: Path
) -> None:
    """6 groups of ledger appends, some sent twice, the daemon killed -9 mid-stream four
    times while messages are in flight: every effect lands once and, within each group,
    in send order."""
    sqs: Any = boto3.client("sqs", endpoint_url=localstack, region_name="us-east-1")
    queue_url = sqs.create_queue(
        QueueName=f"fifo-{uuid.uuid4().hex[:10]}.fifo",
        Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true",
                    "VisibilityTimeout": "5"})["QueueUrl"]
    seed = chaos_seed(17)
    w = Workload(seed=seed)
    items = fifo_ledger(w, groups=6, per_group=40)
    rng = random.Random(f"{seed}-fifo")
    items += [items[i] for i in sorted(rng.sample(range(len(items)), 30))]
    held_at_kill: list[int] = []
    quarter = len(items) // 4
    with FaultProxy(localstack, latency_ms=20) as proxy:
        # Each quarter is queued while no daemon runs, so receives take several messages of
        # a group at once (batch order matters, not only SQS's), then killed mid-stream.
        d = Daemon(daemon_env(database_url, queue_url, proxy.url, INGEST_WORKER_NAME="fifo-0"),
                   tmp_path)
        try:
            for k in range(4):
                send_fifo(sqs, queue_url, items[k * quarter:(k + 1) * quarter]
                          if k < 3 else items[k * quarter:])
                d.start()
                d.wait_ready()
                wait_until(lambda: d.metric("sqs_ingest_in_flight_messages") > 0, 30,
                           "messages in flight")
                d.kill9()
                held_at_kill.append(in_flight(sqs, queue_url))
            d.start()
            d.wait_ready()
            wait_drained(sqs, queue_url, [d], timeout=240)
            code = d.stop()
        finally:
            if not d.exited():
                d.kill9()
    assert code == 0, d.logs()
    assert sum(1 for n in held_at_kill if n > 0) >= 3, f"messages held at each kill: {held_at_kill}"
    await check_invariants(database_url, w, sqs, queue_url)
    await check_group_order(database_url, groups=6, per_group=40)

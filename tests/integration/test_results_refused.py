"""Results a destination refuses for good (security review, issue 42): SQS answers an entry
whose ``request_id`` attribute or body holds a character it does not take with a per-entry
failure, on every try. Such rows are marked refused in ``outbox`` in the publisher's own
transaction, so the results behind them still leave — before, a claim (oldest first, 50 at
a time) of 50 refused rows was made again and again, and no later result was ever
published. LocalStack, because it refuses those entries as SQS does (moto accepts them)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from aiobotocore.session import get_session

from service.adapters.sinks import SqsSink
from service.adapters.store import Q, Store, create_pool
from service.observe import metrics
from service.runtime.results import CLAIM, Publisher


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(database_url, 4)
    try:
        yield p
    finally:
        await p.close()


def refused_total() -> float:
    return metrics.REGISTRY.get_sample_value("sqs_ingest_results_refused_total") or 0.0


@pytest.mark.parametrize("fifo", [False, True], ids=["standard", "fifo"])
async def test_refused_results_do_not_block_the_later_ones(
    fifo: bool, localstack: str, pool: asyncpg.Pool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FIFO: every row in one group, so a refused row must not hold its group either (the
    claim's older-pending-row rule)."""
    # A claim's worth of refused rows first (what a hostile producer could write before
    # parse() refused such request_ids), one of them refused for its body (a handler
    # result holding U+FFFF), then 20 ordinary results.
    await pool.execute(
        "INSERT INTO outbox (request_id, request_type, status, reason, group_id)"
        " SELECT 'x' || i || chr(1), 'nope', 'FAILED', 'unknown_type', 'g'"
        "   FROM generate_series(1, $1::int) i", CLAIM - 1)
    await pool.execute(
        "INSERT INTO outbox (request_id, request_type, status, result, group_id)"
        " VALUES ('body-ffff', 'note', 'COMPLETED',"
        "         jsonb_build_object('text', 'a' || chr(65535)), 'g')")
    await pool.execute(
        "INSERT INTO outbox (request_id, request_type, status, result, group_id)"
        " SELECT 'good-' || i, 'note', 'COMPLETED', '{}'::jsonb, 'g'"
        "   FROM generate_series(1, 20) i")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    before = refused_total()
    async with get_session().create_client("sqs", region_name="us-east-1",
                                           endpoint_url=localstack) as sqs:
        name = "results-" + uuid.uuid4().hex[:8] + (".fifo" if fifo else "")
        url = (await sqs.create_queue(
            QueueName=name, Attributes={"FifoQueue": "true"} if fifo else {}))["QueueUrl"]
        publisher = Publisher(Store(pool), SqsSink(sqs, url))
        rounds = []
        for _ in range(20):  # bounded: a FIFO round stops a group at its first refusal
            rounds.append(await publisher.publish_once())
            if rounds[-1] == (0, 0):
                break
        got: list[Any] = []
        while len(got) < 20:  # bounded: each receive returns what is there
            msgs = (await sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10,
                                              MessageAttributeNames=["All"])).get("Messages", [])
            if not msgs:
                break
            got += msgs
            await sqs.delete_message_batch(QueueUrl=url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(msgs)])
    # Standard: the first claim takes the 50 refused rows, all settled; the second the 20
    # results behind them. FIFO: a call whose entries are refused holds its group's later
    # calls until the next round, so it takes more rounds — but it ends.
    assert rounds[-1] == (0, 0), rounds
    print(f"\nrounds (claimed, settled): {rounds}")
    if not fifo:
        assert rounds == [(CLAIM, CLAIM), (20, 20), (0, 0)]
    assert sorted(m["MessageAttributes"]["request_id"]["StringValue"] for m in got) == \
        sorted(f"good-{i}" for i in range(1, 21))
    assert await pool.fetchval("SELECT count(*) FROM outbox WHERE request_id LIKE 'good-%'"
                               " AND published_at IS NOT NULL") == 20
    refused = await pool.fetch("SELECT request_id, refused_reason FROM outbox"
                               " WHERE refused_at IS NOT NULL AND published_at IS NULL")
    assert len(refused) == CLAIM
    assert all("Invalid characters" in r["refused_reason"] for r in refused), refused[:2]
    assert refused_total() - before == CLAIM
    # Neither pending (the gauges) nor kept for ever: the pruner takes them like published ones.
    assert await Store(pool).outbox_stats() == (0, 0.0)
    assert await pool.fetchval(Q["prune_count_outbox"], 0.0) == CLAIM + 20
    assert await pool.execute(Q["outbox_prune"], 0.0, 1000) == f"DELETE {CLAIM + 20}"

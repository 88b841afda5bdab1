"""Results out to real SNS (LocalStack in host mode, SNS beside SQS), with the real
``sqs-ingest run`` process killed -9 while it publishes:

- a FIFO source → FIFO topic → FIFO queue: exactly one result per outcome, and each
  source group's results in commit order (MessageGroupId = the source's group,
  MessageDeduplicationId = request_id:status absorbs the republish after a kill);
- a standard topic fanned out to two queues, raw delivery on and off: every outcome at
  least once, the duplicates counted and reported (a standard destination promises no
  more; consumers deduplicate on the ``request_id`` attribute)."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import asyncpg
import boto3
import pytest
from aiohttp import web

from tests.acceptance.harness import (
    Daemon,
    Workload,
    chaos_seed,
    completed_now,
    daemon_env,
    fifo_ledger,
    send_all,
    send_fifo,
    wait_drained,
)
from tests.acceptance.test_results import keyed_poison, read_all, results_of, wait_published
from tests.faultproxy import FaultProxy
from tests.servers import wait_until

#: How long the destination holds its answer after it has taken a publish.
ANSWER_DELAY = 0.4


class SlowAnswer(FaultProxy):
    """The results destination that answers late: a publish it holds has reached SNS but
    the daemon does not know yet — the moment a kill leaves rows sent and not marked."""

    holding = 0

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        resp = await super()._serve(request)
        self.holding += 1
        try:
            await asyncio.sleep(ANSWER_DELAY)
        finally:
            self.holding -= 1
        return resp



@pytest.fixture
def aws(localstack: str) -> tuple[Any, Any]:
    return (boto3.client("sqs", endpoint_url=localstack, region_name="us-east-1"),
            boto3.client("sns", endpoint_url=localstack, region_name="us-east-1"))


def queue(sqs: Any, name: str, fifo: bool, **attrs: str) -> tuple[str, str]:
    """(url, arn) of a fresh queue; a FIFO one without content-based deduplication, so
    only the publisher's MessageDeduplicationId can absorb a republish."""
    name = f"{name}-{uuid.uuid4().hex[:10]}" + (".fifo" if fifo else "")
    url = sqs.create_queue(QueueName=name,
                           Attributes={**({"FifoQueue": "true"} if fifo else {}), **attrs})["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return str(url), str(arn)


def kill_while_publishing(d: Daemon, dsn: str, dest: SlowAnswer, kills: int, total: int,
                          rng: random.Random) -> None:
    """kill -9 ``kills`` times, each after a random amount of progress and while a publish
    has reached the destination unanswered (so its rows are sent again by the next
    process); waits on conditions, never a sleep."""
    for _ in range(kills):
        target = min(completed_now(dsn) + rng.randrange(5, 25), total - 5)
        wait_until(lambda t=target: completed_now(dsn) >= t, 120, "progress before kill")
        wait_until(lambda: dest.holding > 0, 60, "a publish held by the destination")
        d.kill9()
        d.start()


async def outbox_order(dsn: str) -> dict[str, list[str]]:
    """group_id → its request_ids in commit order (outbox ids are taken by the committing
    statement; a FIFO source hands a group's messages over one after the other)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT group_id, request_id FROM outbox ORDER BY id")
    finally:
        await conn.close()
    out: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        out[r["group_id"]].append(r["request_id"])
    return out


@pytest.mark.timeout(300)
async def test_fifo_topic_one_result_per_outcome_in_commit_order_across_kills(
    database_url: str, localstack: str, aws: tuple[Any, Any], spawn: Callable[..., Daemon],
) -> None:
    sqs, sns = aws
    rng = random.Random(chaos_seed(3030))
    w = Workload(seed=3030)
    items = fifo_ledger(w, groups=6, per_group=25)
    source, _ = queue(sqs, "src", True, VisibilityTimeout="5", ContentBasedDeduplication="true")
    topic = sns.create_topic(Name=f"results-{uuid.uuid4().hex[:8]}.fifo",
                             Attributes={"FifoTopic": "true"})["TopicArn"]
    dest, dest_arn = queue(sqs, "results", True)
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=dest_arn,
                  Attributes={"RawMessageDelivery": "true"})
    proxy = SlowAnswer(localstack)
    with proxy:
        d = spawn(daemon_env(database_url, source, localstack, INGEST_RESULTS_TOPIC_ARN=topic,
                             INGEST_RESULTS_ENDPOINT_URL=proxy.url))
        send_fifo(sqs, source, items)
        d.wait_ready()
        kill_while_publishing(d, database_url, proxy, 3, len(items), rng)
        wait_drained(sqs, source, [d], timeout=120)
        await wait_published(database_url, timeout=60)
        assert d.stop() == 0
    print(f"FIFO SNS: {proxy.requests} PublishBatch calls, 3 kills during a publish")

    messages = read_all(sqs, dest)
    docs = results_of(messages)
    got = Counter((doc["request_id"], doc["status"]) for doc in docs)
    assert got == Counter({(r, "COMPLETED"): 1 for r in w.valid}), (
        f"missing={sorted(set((r, 'COMPLETED') for r in w.valid) - set(got))[:5]} "
        f"doubled={[k for k, n in got.items() if n > 1][:5]}")
    # Each group's results in the order their outcomes were committed.
    arrived: dict[str, list[str]] = defaultdict(list)
    for m, doc in zip(messages, docs, strict=True):
        arrived[m["Attributes"]["MessageGroupId"]].append(doc["request_id"])
    assert arrived == await outbox_order(database_url)
    assert set(arrived) == {g for g, _ in items}  # the source's groups, kept


@pytest.mark.timeout(300)
async def test_standard_topic_raw_and_enveloped_every_outcome_at_least_once(
    database_url: str, localstack: str, aws: tuple[Any, Any], spawn: Callable[..., Daemon],
) -> None:
    sqs, sns = aws
    rng = random.Random(chaos_seed(2020))
    topic = sns.create_topic(Name=f"results-{uuid.uuid4().hex[:8]}")["TopicArn"]
    (raw_q, raw_arn), (env_q, env_arn) = queue(sqs, "raw", False), queue(sqs, "env", False)
    for arn, delivery in ((raw_arn, "true"), (env_arn, "false")):
        sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn,
                      Attributes={"RawMessageDelivery": delivery})
    w = Workload(seed=2020)
    bodies = w.bodies(150)
    source, _ = queue(sqs, "src", False, VisibilityTimeout="5")
    proxy = SlowAnswer(localstack)
    with proxy:
        d = spawn(daemon_env(database_url, source, localstack, INGEST_RESULTS_TOPIC_ARN=topic,
                             INGEST_RESULTS_ENDPOINT_URL=proxy.url))
        send_all(sqs, source, bodies)
        d.wait_ready()
        kill_while_publishing(d, database_url, proxy, 3, len(w.valid), rng)
        wait_drained(sqs, source, [d], timeout=120)
        await wait_published(database_url, timeout=60)
        assert d.stop() == 0

    expected = {(r, "COMPLETED") for r in w.valid} | {(r, "FAILED") for r in keyed_poison(w)}
    raw = Counter((doc["request_id"], doc["status"]) for doc in results_of(read_all(sqs, raw_q)))
    enveloped: Counter[tuple[str, str]] = Counter()
    for m in read_all(sqs, env_q):
        envelope = json.loads(m["Body"])
        assert envelope["Type"] == "Notification" and envelope["TopicArn"] == topic
        doc = json.loads(envelope["Message"])
        assert envelope["MessageAttributes"]["request_id"]["Value"] == doc["request_id"]
        enveloped[(doc["request_id"], doc["status"])] += 1
    for got in (raw, enveloped):
        assert set(got) == expected  # every outcome at least once, nothing else
    print(f"standard SNS (LocalStack), 3 kills: {len(expected)} outcomes, "
          f"{sum(raw.values()) - len(raw)} duplicate(s) delivered raw, "
          f"{sum(enveloped.values()) - len(enveloped)} enveloped")

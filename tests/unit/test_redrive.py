"""The queue's own RedrivePolicy: the live receive limit, the deferral rule (fresh copies
instead of hand-backs near maxReceiveCount), and ``sqs-ingest redrive`` over a fake client.
The worker runs over the in-package fakes; FakeQueue moves a message past its
``max_receive_count`` to ``dead_lettered_by_sqs`` as SQS does."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from structlog.testing import capture_logs

from service.errors import DatabaseUnavailable
from service.executor import PlanExecutor
from service.handlers import Registry
from service.messages import Received
from service.plan import settle_failures
from service.redrive import redrive
from service.retry import ReceiveLimit, RedrivePolicy, RetryPolicy
from service.testing import FakeQueue, FakeStore, FakeWorker, Row
from tests.unit.test_worker import Harness, Note, _hash, body, settings, until


@pytest.fixture
def calls() -> list[int]:
    return []


@pytest.fixture
def registry(calls: list[int]) -> Registry:
    r = Registry()

    async def note(p: Note, conn: Any) -> dict[str, int]:
        if p.n < 0:
            raise RuntimeError("handler refuses negative numbers")
        calls.append(p.n)
        return {"n": p.n}

    r.register("note", Note, note)
    return r


def policy_attrs(max_receive_count: object) -> dict[str, str]:
    return {"RedrivePolicy": json.dumps({
        "deadLetterTargetArn": "arn:aws:sqs:us-east-1:000000000000:dlq",
        "maxReceiveCount": max_receive_count})}


def limit_of(configured: int, queue_max: int | None, fifo: bool = False) -> ReceiveLimit:
    limit = ReceiveLimit(configured, fifo)
    if queue_max is not None:
        limit.update(policy_attrs(queue_max))
    return limit


# -- the policy and the limit ----------------------------------------------------------


def test_policy_is_read_from_the_attribute_number_or_string() -> None:
    assert RedrivePolicy.from_attributes(policy_attrs(3)) == RedrivePolicy(
        "arn:aws:sqs:us-east-1:000000000000:dlq", 3)
    # why the ignore below: a RedrivePolicy is set here
    assert RedrivePolicy.from_attributes(policy_attrs("7")).max_receive_count == 7  # type: ignore[union-attr]
    assert RedrivePolicy.from_attributes({}) is None
    assert RedrivePolicy.from_attributes({"RedrivePolicy": ""}) is None
    with capture_logs() as logs:
        assert RedrivePolicy.from_attributes({"RedrivePolicy": "{not json"}) is None
    assert [e["event"] for e in logs] == ["redrive_policy_unreadable"]


def test_the_policy_lowers_the_limit_and_the_last_receive_is_final() -> None:
    assert limit_of(5, None).max_failures == 5
    assert limit_of(5, 3).max_failures == 3
    assert limit_of(2, 3).max_failures == 2
    limit = limit_of(5, 3)
    assert not limit.exhausted(failures=1, receive_count=2)
    assert limit.exhausted(failures=1, receive_count=3)  # SQS would move it next receive
    assert limit.exhausted(failures=3, receive_count=1)
    assert not limit_of(5, None).exhausted(failures=4, receive_count=40)


def test_deferrals_requeue_when_a_hand_back_would_cost_a_try() -> None:
    # maxReceiveCount 3, 3 tries: any hand-back would leave fewer receives than tries.
    assert all(limit_of(5, 3).must_requeue(r) for r in (1, 2, 3))
    # maxReceiveCount 10, 5 tries: hand back while 5 receives remain.
    assert [r for r in range(1, 11) if limit_of(5, 10).must_requeue(r)] == [6, 7, 8, 9, 10]
    assert not any(limit_of(5, None).must_requeue(r) for r in range(1, 50))
    # FIFO: a copy goes behind its group, so only when the next receive would move it.
    assert [r for r in (1, 2, 3) if limit_of(5, 3, fifo=True).must_requeue(r)] == [3]


def test_the_log_says_once_when_the_policy_lowers_the_limit_and_again_on_change() -> None:
    limit = ReceiveLimit(5)
    with capture_logs() as logs:
        for _ in range(3):
            limit.update(policy_attrs(3))
        limit.update(policy_attrs(4))
        limit.update(policy_attrs(4))
        limit.update({})
        limit.update({})
    assert [(e["event"], e.get("max_failures")) for e in logs] == [
        ("receive_limit_lowered_by_redrive_policy", 3),
        ("receive_limit_lowered_by_redrive_policy", 4),
        ("redrive_policy_removed", 5)]


def test_settle_failures_dead_letters_on_the_last_receive() -> None:
    from tests.unit.test_plan import parsed

    early, last = parsed("m1", "r1", receives=2), parsed("m2", "r2", receives=3)
    plan = settle_failures([(early, "boom"), (last, "boom")], {"r1": 1, "r2": 1},
                           RetryPolicy(max_failures=5), limit_of(5, 3))
    assert [a.message_id for a in plan.acks] == ["m2"]
    assert plan.dead_letter_reasons == ["max_receives_exceeded"]
    assert [r.message_id for r, _ in plan.releases] == ["m1"]


# -- the executor's hand-back ----------------------------------------------------------


async def received(q: FakeQueue, n: int) -> list[Received]:
    got = await q.receive(n, 0, 30)
    assert len(got) == n
    return got


async def test_hand_back_requeues_near_the_limit_and_releases_the_rest() -> None:
    q = FakeQueue()
    q.send("far")
    q.send("near")
    far, near = await received(q, 2)
    q.messages[near.message_id].receive_count = 6
    near = Received(near.message_id, near.receipt_handle, near.body, 6)
    # maxReceiveCount 10, 5 tries: from receive 6 a hand-back would cost a try.
    before = time.monotonic()
    await PlanExecutor(q, FakeStore(), limit_of(5, 10)).hand_back([(far, 3), (near, 7)])
    after = time.monotonic()
    assert q.visibility_calls == [(far.message_id, 3)]
    assert q.requeued == [near.message_id] and near.message_id not in q.messages
    [copy] = [m for m in q.messages.values() if m.body == "near"]
    assert copy.receive_count == 0
    # The copy keeps its own delay (DelaySeconds=7), not 0 and not the other message's 3.
    assert before + 7 <= copy.visible_at <= after + 7


async def test_hand_back_falls_back_to_visibility_when_the_copy_is_refused() -> None:
    class Refusing(FakeQueue):
        async def requeue(self, changes: Any) -> list[str]:
            return [m.message_id for m, _ in changes]

    q = Refusing()
    q.send("x")
    [m] = await received(q, 1)
    with capture_logs() as logs:
        await PlanExecutor(q, FakeStore(), limit_of(5, 3)).hand_back([(m, 4)])
    assert q.visibility_calls == [(m.message_id, 4)]
    assert "requeue_failed" in [e["event"] for e in logs]


async def test_without_a_policy_a_hand_back_is_a_visibility_change() -> None:
    q = FakeQueue()
    q.send("x")
    [m] = await received(q, 1)
    await PlanExecutor(q, FakeStore(), limit_of(5, None)).hand_back([(m, 2)])
    assert q.visibility_calls == [(m.message_id, 2)] and q.requeued == []


# -- the worker over the fakes -----------------------------------------------------------


def redrive_queue(max_receive_count: int = 3) -> FakeQueue:
    q = FakeQueue()
    q.max_receive_count = max_receive_count
    return q


async def test_always_failing_message_is_dead_lettered_before_sqs_moves_it(
    registry: Registry,
) -> None:
    q = redrive_queue(3)
    mid = q.send(body("bad", -1))
    # INGEST_MAX_RECEIVE_COUNT=5 (the default) above the queue's maxReceiveCount=3.
    s = settings(max_receive_count=5, retry_base_seconds=0)
    async with Harness(s, registry, q) as h:
        await until(lambda: mid in h.store.dead or bool(q.dead_lettered_by_sqs), "an outcome")
        assert q.dead_lettered_by_sqs == []
        assert h.store.dead[mid].reason == "max_receives_exceeded"
        assert h.worker.limit.max_failures == 3


async def test_contention_never_pushes_a_healthy_message_to_the_sqs_dlq(
    registry: Registry, calls: list[int]
) -> None:
    q = redrive_queue(2)
    async with Harness(settings(contention_delay=0), registry, q) as h:
        h.store.db.workers["other"] = FakeWorker("other")  # a live replica, busy with it
        h.store.rows["busy"] = Row("busy", "note", _hash({"n": 5}), "IN_PROGRESS", "other")
        q.send(body("busy", 5))
        # Deferred (1 s each) more often than maxReceiveCount allows receives.
        await until(lambda: len(q.requeued) >= 3, "three deferrals", timeout=15)
        assert q.dead_lettered_by_sqs == [] and calls == []
        del h.store.rows["busy"]  # the other owner gave up: it is ours now
        await until(lambda: not q.messages, "processed")
        assert calls == [5] and q.dead_lettered_by_sqs == []


async def test_a_batch_caught_by_an_outage_is_requeued_near_the_limit(
    registry: Registry, calls: list[int]
) -> None:
    q = redrive_queue(1)  # every hand-back would move it
    async with Harness(settings(), registry, q) as h:
        real_claim = h.store.claim

        async def claim_in_an_outage(messages: Any) -> Any:
            h.store.claim = real_claim  # type: ignore[method-assign]  # a stub on this instance
            raise DatabaseUnavailable("the database went away under this batch")

        h.store.claim = claim_in_an_outage  # type: ignore[method-assign]  # a stub on this instance
        mid = q.send(body("r1", 1))
        await until(lambda: q.requeued == [mid], "requeued")
        assert q.dead_lettered_by_sqs == []
        await until(lambda: not q.messages, "processed after the outage", timeout=20)
        assert q.dead_lettered_by_sqs == [] and calls == [1]


async def test_shutdown_requeues_what_it_cancels_near_the_limit() -> None:
    async def stuck(p: Note, conn: Any) -> None:
        await asyncio.sleep(3600)

    stuck_registry = Registry()
    stuck_registry.register("note", Note, stuck)
    q = redrive_queue(1)  # every hand-back would move it
    mid = q.send(body("s1", 1))
    async with Harness(settings(shutdown_timeout=0.5), stuck_registry, q) as h:
        await until(lambda: "s1" in h.store.rows, "claimed")
        assert await h.stop() == 0
    assert q.requeued == [mid] and q.dead_lettered_by_sqs == []
    [copy] = q.messages.values()
    assert copy.body == body("s1", 1) and copy.receive_count == 0


async def test_maintenance_refreshes_the_limit_without_a_restart(registry: Registry) -> None:
    q = FakeQueue()
    async with Harness(settings(max_receive_count=5), registry, q) as h:
        await until(lambda: h.worker.limit.policy is None, "started")
        q.max_receive_count = 2
        await until(lambda: h.worker.limit.max_failures == 2, "policy read", timeout=5)
        assert h.worker.batches.limit is h.worker.limit
        assert h.worker.batches.executor.limit is h.worker.limit


# -- sqs-ingest redrive --------------------------------------------------------------------


class FakeSqs:
    """What ``redrive`` calls of an SQS client, with a move task that finishes in steps."""

    def __init__(self, policy: bool = True, in_dlq: int = 4) -> None:
        self.policy = policy
        self.in_dlq = in_dlq
        self.started: list[dict[str, Any]] = []
        self.polls = 0

    async def get_queue_attributes(self, QueueUrl: str, AttributeNames: list[str]) -> Any:
        if QueueUrl.endswith("/dlq"):
            return {"Attributes": {"ApproximateNumberOfMessages": str(self.in_dlq),
                                   "ApproximateNumberOfMessagesNotVisible": "0"}}
        attrs = {"QueueArn": "arn:aws:sqs:us-east-1:000000000000:src"}
        if self.policy:
            attrs.update(policy_attrs(3))
        return {"Attributes": attrs}

    async def get_queue_url(self, QueueName: str, QueueOwnerAWSAccountId: str) -> Any:
        return {"QueueUrl": f"http://sqs.local/{QueueOwnerAWSAccountId}/{QueueName}"}

    async def start_message_move_task(self, **kw: Any) -> Any:
        self.started.append(kw)
        return {"TaskHandle": "h1"}

    async def list_message_move_tasks(self, SourceArn: str, MaxResults: int) -> Any:
        self.polls += 1
        moved = min(self.polls * 2, self.in_dlq)
        status = "COMPLETED" if moved == self.in_dlq else "RUNNING"
        return {"Results": [{"Status": status, "ApproximateNumberOfMessagesMoved": moved,
                             "ApproximateNumberOfMessagesToMove": self.in_dlq}]}


async def test_redrive_moves_the_dlq_back_and_reports_progress() -> None:
    sqs, lines = FakeSqs(), list[str]()
    code = await redrive(sqs, "http://sqs.local/q/src", False, lines.append, poll_seconds=0)
    assert code == 0
    assert sqs.started == [{"SourceArn": "arn:aws:sqs:us-east-1:000000000000:dlq",
                            "DestinationArn": "arn:aws:sqs:us-east-1:000000000000:src"}]
    assert lines[-2:] == ["moved 2/4 (RUNNING)", "moved 4/4 (COMPLETED)"]


async def test_redrive_dry_run_changes_nothing() -> None:
    sqs, lines = FakeSqs(), list[str]()
    assert await redrive(sqs, "http://sqs.local/q/src", True, lines.append) == 0
    assert sqs.started == []
    assert "would move 4 message(s)" in lines[-1]


async def test_redrive_refuses_a_queue_without_a_policy(capsys: pytest.CaptureFixture[str]) -> None:
    sqs = FakeSqs(policy=False)
    assert await redrive(sqs, "http://sqs.local/q/src", False, print) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no RedrivePolicy" in err
    assert sqs.started == []


def test_a_fresh_copy_carries_body_attributes_group_and_a_dedup_id_of_its_own() -> None:
    from service.sqs import _copy_entry

    attrs = {"a": {"DataType": "String", "StringValue": "x", "StringListValues": []},
             "b": {"DataType": "Binary", "BinaryValue": b"\x00\x01"}}
    m = Received("mid-1", "rh", '{"k": 1}', 3, group_id="g", trace_header="Root=1-a-b",
                 message_attributes=attrs)
    std = _copy_entry("0", m, 7, fifo=False)
    assert std == {"Id": "0", "MessageBody": '{"k": 1}', "DelaySeconds": 7,
                   "MessageAttributes": {"a": {"DataType": "String", "StringValue": "x"},
                                         "b": {"DataType": "Binary", "BinaryValue": b"\x00\x01"}},
                   "MessageSystemAttributes": {"AWSTraceHeader": {
                       "DataType": "String", "StringValue": "Root=1-a-b"}}}
    fifo = _copy_entry("0", m, 7, fifo=True)
    assert "DelaySeconds" not in fifo
    assert (fifo["MessageGroupId"], fifo["MessageDeduplicationId"]) == ("g", "requeue-mid-1")
    assert _copy_entry("0", m, 5000, fifo=False)["DelaySeconds"] == 900


async def test_claims_stranded_by_an_outage_are_released_once_it_is_back() -> None:
    from tests.unit.test_executor import RecordingStore, flight_of

    q, store = FakeQueue(), RecordingStore()
    ex = PlanExecutor(q, store, limit_of(5, 3))
    flight, claimed = flight_of(q, 2)
    flight.claimed = claimed
    await ex.give_back(flight, 3, db_up=False, deferral=True)
    assert store.released == [] and len(q.requeued) == 2  # down: copies, claims stranded
    await ex.release_unreleased()  # the database is back
    assert store.released == [["r0", "r1"]]
    await ex.release_unreleased()
    assert store.released == [["r0", "r1"]]  # once


async def test_a_failed_release_is_tried_once_more_when_the_database_is_back() -> None:
    from tests.unit.test_executor import RecordingStore, flight_of

    q, store = FakeQueue(), RecordingStore()
    ex = PlanExecutor(q, store, limit_of(5, None))
    flight, claimed = flight_of(q, 1)
    flight.claimed = claimed
    store.fail_release = True
    await ex.give_back(flight, 3, db_up=True)
    await ex.release_unreleased()  # fails again: left to the own-leak GC
    store.fail_release = False
    await ex.release_unreleased()
    assert store.released == [["r0"], ["r0"]]

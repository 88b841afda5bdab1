"""The queue's own RedrivePolicy: the live receive limit, the deferral rule (fresh copies
instead of hand-backs near maxReceiveCount), and ``sqs-ingest redrive`` over a fake client.
The worker runs over the in-package fakes; FakeQueue moves a message past its
``max_receive_count`` to ``dead_lettered_by_sqs`` as SQS does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError
from structlog.testing import capture_logs

import service.ops.redrive as redrive_module
from service.core.messages import Received
from service.core.plan import settle_failures
from service.core.retry import ReceiveLimit, RedrivePolicy, RetryPolicy
from service.errors import DatabaseUnavailable
from service.handlers import Registry
from service.ops.redrive import redrive
from service.runtime.executor import PlanExecutor
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
    from service.adapters.sqs import _copy_entry

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


# -- sqs-ingest redrive: every line a user sees, every call it makes ----------------------
# What an operator relies on is the exit code, the progress lines on stdout and the one
# error line on stderr (README "Native redrive"); each branch below asserts all three, and
# the exact calls sent (SQS takes the attribute names, the DLQ's owner account and the
# move's direction literally).

SRC_URL = "http://sqs.local/000000000000/src"
SRC_ARN = "arn:aws:sqs:us-east-1:000000000000:src"
# The DLQ in another account and region: the name and the owner come from the ARN.
DLQ_ARN = "arn:aws:sqs:eu-west-1:111111111111:the-dlq"
DLQ_URL = "http://sqs.local/111111111111/the-dlq"
SOURCE_ATTRIBUTES = ["QueueArn", "RedrivePolicy"]
DLQ_ATTRIBUTES = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]


def sqs_error(code: str, op: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} says no"}}, op)


def task(status: str, moved: int | None = 1, total: int | None = 4,
         reason: str | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"Status": status, "TaskHandle": "h1"}
    if moved is not None:
        t["ApproximateNumberOfMessagesMoved"] = moved
    if total is not None:
        t["ApproximateNumberOfMessagesToMove"] = total
    if reason is not None:
        t["FailureReason"] = reason
    return t


class ScriptedSqs:
    """SQS as ``redrive`` meets it: GetQueueAttributes answers only the attributes asked for
    (an unknown name is InvalidAttributeName, as SQS answers), GetQueueUrl knows the one DLQ
    by name and owner, ListMessageMoveTasks plays ``script`` (a list of Results, or an
    exception to raise) and then repeats its last entry. Every call is recorded. A follow
    that never ends fails the test instead of hanging it."""

    def __init__(self, *, policy_arn: str | None = DLQ_ARN, visible: int | None = 4,
                 in_flight: int | None = 1, script: list[Any] | None = None,
                 fail: dict[str, BaseException] | None = None, max_polls: int = 50) -> None:
        self.policy_arn = policy_arn
        self.visible, self.in_flight = visible, in_flight
        self.script = script if script is not None else [[task("COMPLETED", 4, 4)]]
        self.fail = fail or {}
        self.max_polls = max_polls
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def _call(self, op: str, **kw: Any) -> None:
        self.calls.append((op, kw))
        key = op + (":dlq" if kw.get("QueueUrl") == DLQ_URL else "")
        if key in self.fail:
            raise self.fail[key]

    async def get_queue_attributes(self, **kw: Any) -> Any:
        self._call("GetQueueAttributes", **kw)
        if kw["QueueUrl"] == DLQ_URL:
            known: dict[str, Any] = {"ApproximateNumberOfMessages": self.visible,
                                     "ApproximateNumberOfMessagesNotVisible": self.in_flight}
        else:
            known = {"QueueArn": SRC_ARN, "RedrivePolicy": None if self.policy_arn is None
                     else json.dumps({"deadLetterTargetArn": self.policy_arn,
                                      "maxReceiveCount": 3})}
        unknown = [n for n in kw["AttributeNames"] if n not in known]
        if unknown:
            raise sqs_error("InvalidAttributeName", "GetQueueAttributes")
        return {"Attributes": {n: str(known[n]) for n in kw["AttributeNames"]
                               if known[n] is not None}}

    async def get_queue_url(self, **kw: Any) -> Any:
        self._call("GetQueueUrl", **kw)
        if kw != {"QueueName": "the-dlq", "QueueOwnerAWSAccountId": "111111111111"}:
            raise sqs_error("AWS.SimpleQueueService.NonExistentQueue", "GetQueueUrl")
        return {"QueueUrl": DLQ_URL}

    async def start_message_move_task(self, **kw: Any) -> Any:
        self._call("StartMessageMoveTask", **kw)
        return {"TaskHandle": "h1"}

    async def list_message_move_tasks(self, **kw: Any) -> Any:
        self._call("ListMessageMoveTasks", **kw)
        polls = sum(op == "ListMessageMoveTasks" for op, _ in self.calls)
        if polls > self.max_polls:
            raise AssertionError(f"still following after {self.max_polls} polls")
        step = self.script[min(polls, len(self.script)) - 1]
        if isinstance(step, BaseException):
            raise step
        return {"Results": step} if step is not None else {}

    def ops(self) -> list[str]:
        return [op for op, _ in self.calls]


class Clock:
    """``service.ops.redrive``'s clock and sleep: time passes only when it sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(redrive_module, "time", c)
    monkeypatch.setattr(redrive_module, "asyncio", c)
    return c


async def run(sqs: ScriptedSqs, capsys: pytest.CaptureFixture[str], dry_run: bool = False,
              **kw: Any) -> tuple[int, list[str], str]:
    """(exit code, stdout lines, stderr) of one ``redrive`` over ``sqs``."""
    code = await redrive(sqs, SRC_URL, dry_run, **kw)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


HEAD = [f"dead-letter queue: {DLQ_ARN} ({DLQ_URL})",
        "messages: 4 visible, 1 in flight; maxReceiveCount 3"]
STARTED = f"move task started: {DLQ_ARN} -> {SRC_ARN} (h1)"
READ_SOURCE = ("GetQueueAttributes", {"QueueUrl": SRC_URL, "AttributeNames": SOURCE_ATTRIBUTES})
FIND_DLQ = ("GetQueueUrl", {"QueueName": "the-dlq", "QueueOwnerAWSAccountId": "111111111111"})
READ_DLQ = ("GetQueueAttributes", {"QueueUrl": DLQ_URL, "AttributeNames": DLQ_ATTRIBUTES})
START = ("StartMessageMoveTask", {"SourceArn": DLQ_ARN, "DestinationArn": SRC_ARN})
POLL = ("ListMessageMoveTasks", {"SourceArn": DLQ_ARN, "MaxResults": 1})


async def test_redrive_calls_and_lines_from_start_to_completed(
    clock: Clock, capsys: pytest.CaptureFixture[str],
) -> None:
    # Polled every 0.25 s; an unchanged answer prints nothing; a deadline far away.
    sqs = ScriptedSqs(script=[[task("RUNNING", 0)], [task("RUNNING", 0)], [task("RUNNING", 2)],
                              [task("COMPLETED", 4)]])
    code, out, err = await run(sqs, capsys, poll_seconds=0.25, follow_for=60)
    assert (code, err) == (0, "")
    assert out == [*HEAD, STARTED, "moved 0/4 (RUNNING)", "moved 2/4 (RUNNING)",
                   "moved 4/4 (COMPLETED)"]
    assert sqs.calls == [READ_SOURCE, FIND_DLQ, READ_DLQ, START, POLL, POLL, POLL, POLL]
    assert clock.sleeps == [0.25, 0.25, 0.25]


async def test_redrive_reads_a_sparse_task_and_waits_for_it_to_appear(
    clock: Clock, capsys: pytest.CaptureFixture[str],
) -> None:
    # No task listed yet (no Results at all, then an empty list), then one without counts.
    sqs = ScriptedSqs(script=[None, [], [task("RUNNING", moved=None, total=None)],
                              [task("COMPLETED", 4, 4)]])
    code, out, err = await run(sqs, capsys, poll_seconds=0.5)
    assert (code, err) == (0, "")
    assert out[3:] == ["moved 0/? (RUNNING)", "moved 4/4 (COMPLETED)"]
    assert sqs.ops().count("ListMessageMoveTasks") == 4 and clock.sleeps == [0.5] * 3


async def test_redrive_dry_run_prints_what_would_move_and_starts_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sqs = ScriptedSqs()
    code, out, err = await run(sqs, capsys, dry_run=True)
    assert (code, err) == (0, "")
    assert out == [*HEAD, f"dry run: would move 4 message(s) from {DLQ_ARN} to {SRC_ARN} "
                          "(StartMessageMoveTask); nothing changed"]
    assert sqs.calls == [READ_SOURCE, FIND_DLQ, READ_DLQ]


@pytest.mark.parametrize("visible,in_flight,shown", [
    (0, 0, "messages: 0 visible, 0 in flight; maxReceiveCount 3"),
    # An answer without the counts reads as an empty DLQ.
    (None, None, "messages: 0 visible, 0 in flight; maxReceiveCount 3"),
])
async def test_redrive_with_an_empty_dlq_has_nothing_to_move(
    capsys: pytest.CaptureFixture[str], visible: int | None, in_flight: int | None, shown: str,
) -> None:
    sqs = ScriptedSqs(visible=visible, in_flight=in_flight)
    code, out, err = await run(sqs, capsys)
    assert (code, err) == (0, "")
    assert out == [HEAD[0], shown, "nothing to move"]
    assert sqs.calls == [READ_SOURCE, FIND_DLQ, READ_DLQ]


@pytest.mark.parametrize("visible,in_flight", [(1, 0), (0, 1), (0, 3), (None, 2)])
async def test_redrive_moves_a_dlq_holding_any_message_visible_or_in_flight(
    clock: Clock, capsys: pytest.CaptureFixture[str], visible: int | None, in_flight: int,
) -> None:
    sqs = ScriptedSqs(visible=visible, in_flight=in_flight)
    code, out, err = await run(sqs, capsys)
    assert (code, err) == (0, "")
    assert out == [HEAD[0], f"messages: {visible or 0} visible, {in_flight} in flight; "
                            "maxReceiveCount 3", STARTED, "moved 4/4 (COMPLETED)"]
    assert sqs.calls == [READ_SOURCE, FIND_DLQ, READ_DLQ, START, POLL]


@pytest.mark.parametrize("exc,shown", [
    (sqs_error("AccessDenied", "GetQueueAttributes"),
     "An error occurred (AccessDenied) when calling the GetQueueAttributes operation: "
     "AccessDenied says no"),
    (EndpointConnectionError(endpoint_url=SRC_URL),
     f'Could not connect to the endpoint URL: "{SRC_URL}"'),
])
async def test_redrive_fails_when_the_source_queue_cannot_be_read(
    capsys: pytest.CaptureFixture[str], exc: BaseException, shown: str,
) -> None:
    sqs = ScriptedSqs(fail={"GetQueueAttributes": exc})
    code, out, err = await run(sqs, capsys)
    assert (code, out) == (1, [])
    assert err == f"sqs-ingest: redrive failed: GetQueueAttributes on {SRC_URL}: {shown}\n"
    assert sqs.calls == [READ_SOURCE]


async def test_redrive_refuses_a_queue_without_a_redrive_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sqs = ScriptedSqs(policy_arn=None)
    code, out, err = await run(sqs, capsys)
    assert (code, out) == (2, [])
    assert err == (f"sqs-ingest: redrive refused: {SRC_URL} has no RedrivePolicy, so there "
                   "is no dead-letter queue to move messages from\n")
    assert sqs.calls == [READ_SOURCE]


@pytest.mark.parametrize("arn", [
    "arn:aws:sns:eu-west-1:111111111111:the-dlq",  # six fields, but not SQS
    "arn:aws:sqs:eu-west-1:the-dlq",  # five fields
    "arn:aws:sqs:eu-west-1:111111111111:the-dlq:extra",
])
async def test_redrive_fails_on_a_policy_whose_target_is_not_an_sqs_queue_arn(
    capsys: pytest.CaptureFixture[str], arn: str,
) -> None:
    sqs = ScriptedSqs(policy_arn=arn)
    code, out, err = await run(sqs, capsys)
    assert (code, out) == (1, [])
    assert err == (f"sqs-ingest: redrive failed: dead-letter queue {arn}: "
                   f"not an SQS queue ARN: {arn}\n")
    assert sqs.calls == [READ_SOURCE]


@pytest.mark.parametrize("failing,code_,calls", [
    ("GetQueueUrl", "AWS.SimpleQueueService.NonExistentQueue", [READ_SOURCE, FIND_DLQ]),
    ("GetQueueAttributes:dlq", "AccessDenied", [READ_SOURCE, FIND_DLQ, READ_DLQ]),
])
async def test_redrive_fails_when_the_dead_letter_queue_cannot_be_found_or_read(
    capsys: pytest.CaptureFixture[str], failing: str, code_: str, calls: list[Any],
) -> None:
    op = failing.split(":")[0]
    sqs = ScriptedSqs(fail={failing: sqs_error(code_, op)})
    code, out, err = await run(sqs, capsys)
    assert (code, out) == (1, [])
    assert err == (f"sqs-ingest: redrive failed: dead-letter queue {DLQ_ARN}: An error "
                   f"occurred ({code_}) when calling the {op} operation: {code_} says no\n")
    assert sqs.calls == calls


async def test_redrive_fails_when_the_move_task_cannot_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    sqs = ScriptedSqs(fail={"StartMessageMoveTask": sqs_error(
        "AWS.SimpleQueueService.UnsupportedOperation", "StartMessageMoveTask")})
    code, out, err = await run(sqs, capsys)
    assert (code, out) == (1, HEAD)
    assert err == ("sqs-ingest: redrive failed: StartMessageMoveTask: An error occurred "
                   "(AWS.SimpleQueueService.UnsupportedOperation) when calling the "
                   "StartMessageMoveTask operation: "
                   "AWS.SimpleQueueService.UnsupportedOperation says no\n")
    assert sqs.calls == [READ_SOURCE, FIND_DLQ, READ_DLQ, START]


async def test_redrive_stops_following_when_the_task_list_cannot_be_read(
    clock: Clock, capsys: pytest.CaptureFixture[str],
) -> None:
    sqs = ScriptedSqs(script=[[task("RUNNING", 1)],
                              sqs_error("AccessDenied", "ListMessageMoveTasks")])
    code, out, err = await run(sqs, capsys)
    assert (code, out) == (1, [*HEAD, STARTED, "moved 1/4 (RUNNING)"])
    assert err == ("sqs-ingest: redrive: ListMessageMoveTasks failed: An error occurred "
                   "(AccessDenied) when calling the ListMessageMoveTasks operation: "
                   "AccessDenied says no (the task goes on; run redrive --dry-run to see "
                   "what is left)\n")
    assert sqs.calls[-2:] == [POLL, POLL]


@pytest.mark.parametrize("status,reason,shown", [
    ("FAILED", "AccessDenied on the destination queue",
     "sqs-ingest: redrive failed: AccessDenied on the destination queue"),
    ("FAILED", None, "sqs-ingest: redrive failed: no reason given"),
    ("CANCELLED", "cancelled by the operator",
     "sqs-ingest: redrive cancelled: cancelled by the operator"),
    ("CANCELLED", None, "sqs-ingest: redrive cancelled: no reason given"),
])
async def test_a_move_task_that_ends_failed_or_cancelled_exits_1_with_its_reason(
    clock: Clock, capsys: pytest.CaptureFixture[str], status: str, reason: str | None,
    shown: str,
) -> None:
    sqs = ScriptedSqs(script=[[task("RUNNING", 1)], [task(status, 2, reason=reason)]])
    code, out, err = await run(sqs, capsys)
    assert (code, out) == (1, [*HEAD, STARTED, "moved 1/4 (RUNNING)", f"moved 2/4 ({status})"])
    assert err == shown + "\n"
    assert sqs.ops().count("ListMessageMoveTasks") == 2  # ended: no poll after it


async def test_redrive_stops_following_a_task_that_outlasts_follow_for(
    clock: Clock, capsys: pytest.CaptureFixture[str],
) -> None:
    sqs = ScriptedSqs(script=[[task("RUNNING", 1)]])  # never ends
    code, out, err = await run(sqs, capsys, poll_seconds=1.0, follow_for=2.5)
    assert (code, out) == (1, [*HEAD, STARTED, "moved 1/4 (RUNNING)"])
    assert err == "sqs-ingest: redrive: stopped following the task (timeout); it goes on\n"
    # Polled at 0, 1, 2 and 3 s: the last one past the 2.5 s deadline.
    assert sqs.ops().count("ListMessageMoveTasks") == 4 and clock.sleeps == [1.0] * 3


class RecordingClients:
    """``service.ops.redrive.sqs_client``: records what each client was made with and hands
    out ``sqs``."""

    def __init__(self, sqs: ScriptedSqs) -> None:
        self.sqs = sqs
        self.made: list[tuple[str, str | None]] = []
        self.closed = 0

    @contextlib.asynccontextmanager
    async def __call__(self, region: str, endpoint_url: str | None,
                       max_pool_connections: int = 50,
                       session: Any = None) -> AsyncIterator[ScriptedSqs]:
        self.made.append((region, endpoint_url))
        try:
            yield self.sqs
        finally:
            self.closed += 1


def redrive_settings() -> Any:
    return settings(queue_url=SRC_URL, aws_region="eu-west-2",
                    sqs_endpoint_url="http://127.0.0.1:4566")


async def test_the_command_runs_on_the_configured_queue_region_and_endpoint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    clients = RecordingClients(ScriptedSqs())
    monkeypatch.setattr(redrive_module, "sqs_client", clients)
    assert await redrive_module.main(redrive_settings(), True) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines() == [*HEAD, (
        f"dry run: would move 4 message(s) from {DLQ_ARN} to {SRC_ARN} "
        "(StartMessageMoveTask); nothing changed")]
    assert clients.made == [("eu-west-2", "http://127.0.0.1:4566")] and clients.closed == 1
    assert clients.sqs.calls == [READ_SOURCE, FIND_DLQ, READ_DLQ]


async def test_the_command_moves_and_polls_once_a_second(
    monkeypatch: pytest.MonkeyPatch, clock: Clock, capsys: pytest.CaptureFixture[str],
) -> None:
    sqs = ScriptedSqs(script=[[task("RUNNING", 0)], [task("RUNNING", 3)],
                              [task("COMPLETED", 4)]])
    clients = RecordingClients(sqs)
    monkeypatch.setattr(redrive_module, "sqs_client", clients)
    assert await redrive_module.main(redrive_settings(), False) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.splitlines() == [
        *HEAD, STARTED, "moved 0/4 (RUNNING)", "moved 3/4 (RUNNING)", "moved 4/4 (COMPLETED)"]
    assert sqs.calls == [READ_SOURCE, FIND_DLQ, READ_DLQ, START, POLL, POLL, POLL]
    assert clock.sleeps == [1.0, 1.0]
    assert clients.made == [("eu-west-2", "http://127.0.0.1:4566")] and clients.closed == 1

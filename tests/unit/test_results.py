"""Results out over the fakes: the worker with a publisher, a destination that refuses, the
drain at SIGTERM; and the pure shape of what is published."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel

from service.adapters.sinks import entry, fifo_id
from service.core.seams import OutboxRow, ResultsSink
from service.handlers import Registry
from service.observe import metrics
from service.runtime.results import MAX_BYTES, Publisher, bodies_of, result_body
from service.runtime.worker import EXIT_OK, Worker
from service.settings import Settings
from service.testing import FakeQueue, FakeSink, FakeStore
from tests.unit.test_worker import until


class Note(BaseModel):
    n: int


def settings(**over: Any) -> Settings:
    base: dict[str, Any] = {
        "queue_url": "http://127.0.0.1:1/q", "database_url": "postgresql://u@h/d",
        "wait_time_seconds": 1, "pollers": 2, "shutdown_timeout": 5, "max_receive_count": 1,
        "queue_attributes_interval": 0.2, "gc_interval": 0.2, "worker_lease": 3,
        "results_queue_url": "http://127.0.0.1:1/results",
    }
    return Settings(**{**base, **over})


def registry() -> Registry:
    async def note(p: Any, conn: Any) -> dict[str, Any] | None:
        if p.n < 0:
            raise RuntimeError("negative")
        return {"n": p.n}

    reg = Registry()
    reg.register("note", Note, note)
    return reg


def body(rid: str, n: int = 1) -> str:
    return json.dumps({"request_id": rid, "type": "note", "payload": {"n": n}})


def _sink(s: FakeSink) -> ResultsSink:
    return s  # mypy: the fake is a ResultsSink


def start(store: FakeStore, sink: FakeSink, queue: FakeQueue, **pub: Any) -> tuple[
        Worker, asyncio.Task[int]]:
    publisher = Publisher(store, _sink(sink), stats_interval=0.05, **pub)
    w = Worker(settings(), queue, store, registry(), publisher=publisher)
    return w, asyncio.create_task(w.run())


async def test_every_outcome_is_published_once() -> None:
    store, sink, queue = FakeStore(results=True), FakeSink(), FakeQueue()
    await store.register_worker("w")
    for i in range(25):
        queue.send(body(f"r{i}", i))
    queue.send(body("r3", 3))  # a duplicate: no second result
    queue.send(body("bad", -1))  # fails once, max_receive_count=1: FAILED
    queue.send(json.dumps({"request_id": "poison", "type": "note", "payload": {}}))
    queue.send(body("r4", 99))  # the key of another request: no result
    queue.send("not json")  # no request_id: no result
    w, run = start(store, sink, queue)
    await until(lambda: len(sink.sent) == 27, "27 results")
    await until(lambda: not queue.messages, "queue drained")
    w.request_stop()
    assert await asyncio.wait_for(run, 15) == EXIT_OK
    got = sorted((r.request_id, r.status, r.reason) for r in sink.sent)
    assert got == sorted(
        [(f"r{i}", "COMPLETED", None) for i in range(25)]
        + [("bad", "FAILED", "max_receives_exceeded"), ("poison", "FAILED", "invalid_payload")])


async def test_a_refusing_destination_never_stops_ingestion() -> None:
    store, sink, queue = FakeStore(results=True), FakeSink(), FakeQueue()
    await store.register_worker("w")
    sink.refuse = True
    w, run = start(store, sink, queue)
    try:
        for i in range(40):
            queue.send(body(f"r{i}", i))
        await until(lambda: len(queue.deleted) == 40, "all 40 ingested while refused")
        await until(lambda: metrics.outbox_pending._value.get() == 40, "pending 40")
        assert sink.sent == [] and w.readiness()[0]
        await until(lambda: metrics.outbox_oldest_age._value.get() > 0, "age grows")
        sink.refuse = False
        await until(lambda: len(sink.sent) == 40, "published once it is back", timeout=40)
        await until(lambda: metrics.outbox_pending._value.get() == 0, "pending back to 0")
        assert len({r.id for r in sink.sent}) == 40
    finally:
        w.request_stop()
        assert await asyncio.wait_for(run, 15) == EXIT_OK


async def test_sigterm_publishes_what_is_pending() -> None:
    store, sink, queue = FakeStore(results=True), FakeSink(), FakeQueue()
    await store.register_worker("w")
    # A poll interval far beyond the test, and the wake-up event never heard: only the
    # drain at stop can send these.
    w, run = start(store, sink, queue, poll_interval=3600)
    await until(lambda: bool(w._background), "started")
    store.outbox_written = asyncio.Event()  # the loops wait on the old one
    for i in range(15):
        queue.send(body(f"r{i}", i))
    await until(lambda: len(queue.deleted) == 15, "ingested")
    assert len(sink.sent) < 15
    w.request_stop()
    assert await asyncio.wait_for(run, 15) == EXIT_OK
    assert sorted(r.request_id for r in sink.sent) == sorted(f"r{i}" for i in range(15))


def row(**over: Any) -> OutboxRow:
    base: dict[str, Any] = {
        "id": 7, "request_id": "req-1", "request_type": "note", "status": "COMPLETED",
        "result": {"n": 1}, "reason": None,
        "completed_at": datetime(2026, 11, 26, 4, 0, 0, 123000, tzinfo=UTC), "group_id": None,
    }
    return OutboxRow(**{**base, **over})


def test_the_published_shape() -> None:
    assert json.loads(result_body(row())) == {
        "request_id": "req-1", "type": "note", "status": "COMPLETED", "result": {"n": 1},
        "reason": None, "completed_at": "2026-11-26T04:00:00.123000Z"}
    assert entry(0, row(), fifo=False) == {"Id": "0", "MessageAttributes": {
        "request_id": {"DataType": "String", "StringValue": "req-1"}}}
    fifo = entry(3, row(status="FAILED", group_id="g-7"), fifo=True)
    assert (fifo["MessageDeduplicationId"], fifo["MessageGroupId"]) == ("req-1:FAILED", "g-7")
    assert entry(0, row(), fifo=True)["MessageGroupId"] == "req-1"  # standard source


def test_fifo_ids_that_sqs_would_refuse_are_hashed_stably() -> None:
    assert fifo_id("a-b_c:COMPLETED") == "a-b_c:COMPLETED"
    for bad in ("x" * 129, "é:FAILED", "with space"):
        out = fifo_id(bad)
        assert out.startswith("sha256-") and len(out) == 71 and out == fifo_id(bad)
    assert fifo_id("x" * 128) == "x" * 128


def big(i: int, n: int) -> OutboxRow:
    return OutboxRow(i, f"r-{i}", "note", "COMPLETED", {"blob": "x" * n}, None,
                     datetime(2026, 11, 26, tzinfo=UTC), None)


async def test_calls_stay_under_ten_entries_and_the_batch_limit_in_order() -> None:
    async def calls(rows: list[OutboxRow]) -> list[list[str]]:
        sink = FakeSinkCalls()
        pub = Publisher(FakeStore(results=True), sink)
        await pub._send(rows)
        return sink.call_bodies

    small = [big(i, 10) for i in range(12)]
    assert [len(c) for c in await calls(small)] == [10, 2]
    # Nine of 20 KB and one of 200 KB: 380 KB in one call would be refused whole.
    mixed = [big(i, 20_000) for i in range(9)] + [big(9, 200_000)]
    got = await calls(mixed)
    assert len(got) == 2
    assert [json.loads(b)["request_id"] for c in got for b in c] == [
        f"r-{i}" for i in range(10)]  # order kept (FIFO)
    for c in got:
        assert sum(len(b) for b in c) <= MAX_BYTES


class FakeSinkCalls(FakeSink):
    """Records the bodies of each call."""

    def __init__(self) -> None:
        super().__init__()
        self.call_bodies: list[list[str]] = []

    async def send(self, rows: Any, bodies: Any = ()) -> set[int]:
        self.call_bodies.append(list(bodies))
        return await super().send(rows, bodies)


def test_a_result_over_the_message_limit_is_published_without_it() -> None:
    rows = [big(0, MAX_BYTES), big(1, 100)]
    bodies = bodies_of(rows)
    doc = json.loads(bodies[0])
    assert doc["result"] is None and doc["result_omitted"] == "too_large"
    assert doc["request_id"] == "r-0" and doc["status"] == "COMPLETED"
    assert json.loads(bodies[1])["result"] == {"blob": "x" * 100}
    assert "result_omitted" not in json.loads(bodies[1])


async def test_a_destination_that_takes_1_mib_gets_a_600_kb_result_whole_in_its_own_call(
) -> None:
    """An SQS results queue whose MaximumMessageSize is 1 MiB (sink.max_message_bytes): a
    600 KB result leaves whole, alone in its call; the neighbours go in another."""
    sink = FakeSinkCalls()
    sink.max_message_bytes = 1024 * 1024
    await Publisher(FakeStore(results=True), sink)._send([big(0, 100), big(1, 600_000),
                                                          big(2, 100)])
    docs = [[json.loads(b) for b in c] for c in sink.call_bodies]
    assert [[d["request_id"] for d in c] for c in docs] == [["r-0"], ["r-1"], ["r-2"]]
    assert docs[1][0]["result"] == {"blob": "x" * 600_000}
    assert "result_omitted" not in docs[1][0]


def grouped(i: int, group: str) -> OutboxRow:
    """A result of ~100 KB: two go in one call (the calls' limit is 256 KiB)."""
    return OutboxRow(i, f"{group}{i}", "note", "COMPLETED", {"blob": "x" * 100_000}, None,
                     datetime(2026, 11, 26, tzinfo=UTC), group)


async def test_after_a_failed_entry_its_groups_later_rows_wait_for_the_next_round() -> None:
    """A FIFO destination answers Failed for one entry: the later rows of its group (in the
    later calls) are not sent before it; the other groups' rows go on."""
    rows = [grouped(0, "g"), grouped(1, "g"), grouped(2, "g"), grouped(3, "h"),
            grouped(4, "g"), grouped(5, "h")]
    sink = FakeSinkCalls()
    sink.fifo = True
    sink.refuse_ids = {1}
    pub = Publisher(FakeStore(results=True), sink)
    assert await pub._send(rows) == {0, 3, 5}
    assert [r.id for r in sink.sent] == [0, 3, 5]
    sink.refuse_ids = set()  # the next round: the rest, in order
    assert await pub._send([r for r in rows if r.id in {1, 2, 4}]) == {1, 2, 4}
    assert [r.id for r in sink.sent] == [0, 3, 5, 1, 2, 4]


async def fifo_results(messages: list[str], fail_once: str | None = None) -> list[tuple[str, str]]:
    """Send ``messages`` (bodies) to one group of a FIFO queue; run the worker until every
    message is gone (the handler of ``fail_once`` fails on its first call); the results
    in the order they were published."""
    store, sink, queue = FakeStore(results=True), FakeSink(fifo=True), FakeQueue(fifo=True)
    await store.register_worker("w")
    failed: list[str] = []

    async def note(p: Any, conn: Any) -> dict[str, Any]:
        from service.handlers import current_request_id

        if current_request_id() == fail_once and not failed:
            failed.append(fail_once)
            raise RuntimeError("transient, once")
        return {"n": p.n}

    reg = Registry()
    reg.register("note", Note, note)
    for m in messages:
        queue.send(m, group_id="g")
    w = Worker(settings(queue_url="http://127.0.0.1:1/q.fifo", max_receive_count=3,
                        retry_base_seconds=1, results_queue_url="http://127.0.0.1:1/r.fifo"),
               queue, store, reg, rng=lambda: 0.0,
               publisher=Publisher(store, _sink(sink), stats_interval=0.05))
    run = asyncio.create_task(w.run())
    try:
        await until(lambda: not queue.messages and len(sink.sent) == len(messages),
                    "every message ingested and its result published")
    finally:
        w.request_stop()
        assert await asyncio.wait_for(run, 15) == EXIT_OK
    assert failed == ([fail_once] if fail_once else [])
    return [(r.request_id, r.status) for r in sink.sent]


POISON = json.dumps({"request_id": "poison", "type": "note", "payload": {"n": "NaN?"}})


async def test_fifo_results_of_valid_poison_valid_leave_in_that_order() -> None:
    assert await fifo_results([body("first"), POISON, body("second")]) == [
        ("first", "COMPLETED"), ("poison", "FAILED"), ("second", "COMPLETED")]


async def test_fifo_a_poison_followers_result_leaves_after_its_failed_heads() -> None:
    assert await fifo_results([body("head"), POISON], fail_once="head") == [
        ("head", "COMPLETED"), ("poison", "FAILED")]


async def test_a_row_refused_for_good_is_settled_and_its_group_goes_on() -> None:
    """An entry refused for good (SenderFault) is marked refused, never claimed again: the
    next round publishes the rest of its FIFO group; counted, not pending."""
    store, sink = FakeStore(results=True), FakeSink(fifo=True)
    for i, group in enumerate(["g", "g", "h", "g"]):
        store._result(f"r{i}", "note", "COMPLETED", {"n": i}, None, group)
    sink.refuse_for_good = {2: "InvalidParameterValue: Invalid characters found"}  # r1
    pub = Publisher(store, _sink(sink))
    before = metrics.REGISTRY.get_sample_value("sqs_ingest_results_refused_total") or 0.0
    assert await pub.publish_once() == (4, 4)  # r1 refused, the others sent
    store._result("r4", "note", "COMPLETED", {"n": 4}, None, "g")
    assert await pub.publish_once() == (1, 1)  # r1 is not claimed again, nor waited for
    assert await pub.publish_once() == (0, 0)
    assert [r.request_id for r in sink.sent] == ["r0", "r2", "r3", "r4"]
    assert (metrics.REGISTRY.get_sample_value("sqs_ingest_results_refused_total")
            or 0.0) - before == 1
    assert await store.outbox_stats() == (0, 0.0)


def test_only_an_entry_s_own_fault_is_refused_for_good() -> None:
    """A character or size SQS/SNS refuse is the entry's for good; an access or key problem
    (a SenderFault too) is the destination's configuration: those results wait for the fix."""
    from service.adapters.sinks import _accepted

    rows = [grouped(i, "g") for i in range(4)]
    resp = {"Successful": [{"Id": "0"}], "Failed": [
        {"Id": "1", "SenderFault": True, "Code": "InvalidParameterValue",
         "Message": "Invalid characters found."},
        {"Id": "2", "SenderFault": True, "Code": "KMS.AccessDeniedException", "Message": "no"},
        {"Id": "3", "SenderFault": False, "Code": "InvalidMessageContents", "Message": "bad"}]}
    sent = _accepted(rows, resp, "send_message_batch")
    assert sent == {0}
    assert sent.refused == {1: "InvalidParameterValue: Invalid characters found.",
                            3: "InvalidMessageContents: bad"}

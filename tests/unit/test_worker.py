"""The worker loop over the in-package fakes of both seams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from pydantic import BaseModel
from structlog.testing import capture_logs

from service.errors import TransientError
from service.handlers import Registry
from service.handlers.entities import EntityUpsert
from service.runtime.worker import EXIT_ACK_FAILED, EXIT_OK, Worker
from service.settings import Settings
from service.testing import FakeQueue, FakeStore


class Note(BaseModel):
    n: int


def settings(**over: Any) -> Settings:
    base: dict[str, Any] = {
        "queue_url": "http://127.0.0.1:1/q",
        "database_url": "postgresql://u@h/d",
        "wait_time_seconds": 1,
        "pollers": 2,
        "shutdown_timeout": 5,
        "max_receive_count": 3,
        "retry_base_seconds": 2,
        "contention_delay": 4,
        "queue_attributes_interval": 0.2,
        "gc_interval": 0.2,
        "worker_lease": 3,
    }
    base.update(over)
    return Settings(**base)


def body(rid: str, n: int = 1, type_: str = "note", **extra: Any) -> str:
    return json.dumps({"request_id": rid, "type": type_, "payload": {"n": n}, **extra})


async def until(pred: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class RecordingQueue(FakeQueue):
    """FakeQueue that logs when receives start and how many are in progress, so tests can
    wait for "no poll in flight" and check that none started after a given moment."""

    def __init__(self, fifo: bool = False) -> None:
        super().__init__(fifo)
        self.events: list[str] = []
        self.receiving = 0

    async def receive(self, *args: Any, **kwargs: Any) -> Any:
        self.events.append("receive")
        self.receiving += 1
        try:
            return await super().receive(*args, **kwargs)
        finally:
            self.receiving -= 1

    async def delete_batch(self, messages: Any) -> None:
        try:
            await super().delete_batch(messages)
        except Exception:
            self.events.append("delete_failed")
            raise


class Harness:
    def __init__(self, s: Settings, registry: Registry, queue: FakeQueue,
                 store: FakeStore | None = None) -> None:
        self.queue = queue
        self.store = store or FakeStore()
        self.worker = Worker(s, queue, self.store, registry,
                             visibility_timeout=30, rng=lambda: 0.0)
        self.task: asyncio.Task[int] | None = None

    async def __aenter__(self) -> Harness:
        self.task = asyncio.create_task(self.worker.run())
        return self

    async def stop(self) -> int:
        assert self.task is not None
        self.worker.request_stop()
        return await asyncio.wait_for(self.task, 20)

    async def __aexit__(self, *exc: object) -> None:
        if self.task and not self.task.done():
            await self.stop()


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

    async def upsert(p: EntityUpsert, conn: Any) -> None:
        return None

    r.register("note", Note, note)
    r.register("entity.upsert", EntityUpsert, upsert)
    return r


@pytest.fixture
async def harness(registry: Registry) -> AsyncIterator[Harness]:
    async with Harness(settings(), registry, FakeQueue()) as h:
        yield h


async def test_valid_poison_and_duplicate_are_all_resolved(harness: Harness, calls: list[int]) -> None:
    q = harness.queue
    for i in range(5):
        q.send(body(f"r{i}", i))
    q.send("{broken")
    await until(lambda: not q.messages, "queue drained")
    q.send(body("r1", 1))  # redelivery of a completed request
    await until(lambda: not q.messages, "duplicate acked")
    assert sorted(calls) == [0, 1, 2, 3, 4]  # applied once each
    assert {r.status for r in harness.store.rows.values()} == {"COMPLETED"}
    [letter] = harness.store.dead.values()
    assert letter.body == "{broken" and letter.reason == "invalid_json"
    assert await harness.stop() == EXIT_OK


async def test_reused_key_with_other_payload_is_dead_lettered(harness: Harness, calls: list[int]) -> None:
    q = harness.queue
    q.send(body("r1", 1))
    await until(lambda: not q.messages, "first applied")
    q.send(body("r1", 2))
    await until(lambda: not q.messages, "conflict acked")
    assert calls == [1]
    assert [d.reason for d in harness.store.dead.values()] == ["idempotency_key_reused"]


async def test_ack_failure_exits_3_and_stops_receiving(registry: Registry, calls: list[int]) -> None:
    q = RecordingQueue()
    mid = q.send(body("r1", 1))
    q.fail_delete_ids.add(mid)
    with capture_logs() as logs:
        async with Harness(settings(), registry, q) as h:
            assert h.task is not None
            code = await asyncio.wait_for(h.task, 10)
    assert code == EXIT_ACK_FAILED
    assert calls == [1]  # the effect is committed...
    assert mid in q.messages  # ...the message is still there, for the restart to resolve
    # No poll began after the failed delete (polls already waiting were cancelled).
    failed_at = q.events.index("delete_failed")
    assert "receive" not in q.events[failed_at + 1:], q.events
    # What the operator reads: which messages stayed on the queue, and why.
    [fatal] = [e for e in logs if e["event"] == "fatal"]
    assert (fatal["reason"], fatal["exit_code"], fatal["message_ids"]) == (
        "ack_failed", EXIT_ACK_FAILED, [mid])
    assert "injected: entry failed" in fatal["error"]


async def test_transient_failure_backs_off_then_dead_letters(harness: Harness) -> None:
    q = harness.queue
    mid = q.send(body("bad", -1))
    # Each failure hides the message for the backoff; make it visible again at once.
    for attempt in range(1, 4):
        # The failure is counted first, the visibility change follows: wait for both.
        await until(lambda: (harness.store.failures.get("bad", 0) >= attempt
                             and sum(c[0] == mid for c in q.visibility_calls) >= attempt)
                    or mid in harness.store.dead, f"failure {attempt}")
        if mid in harness.store.dead:
            break
        assert q.visibility_calls[-1][0] == mid
        # backoff grows with the receive count (rng=0 → half of base * 2^(n-1))
        assert q.visibility_calls[-1][1] == max(1, 2 ** (attempt - 1))
        q.messages[mid].visible_at = 0
    await until(lambda: mid not in q.messages, "dead-lettered and acked")
    letter = harness.store.dead[mid]
    assert letter.reason == "max_receives_exceeded"
    # max_receive_count=3: two failures are retried (a hand-back each), the third is the
    # dead letter, on the third receive. An off-by-one limit changes these numbers.
    assert [d for m, d in q.visibility_calls if m == mid] == [1, 2]
    assert letter.receive_count == 3
    assert "handler refuses" in (letter.error or "")
    assert "bad" not in harness.store.rows  # claim released, nothing IN_PROGRESS


async def test_claim_held_by_another_owner_is_deferred_not_failed(harness: Harness, calls: list[int]) -> None:
    from service.testing import FakeWorker, Row

    harness.store.db.workers["other"] = FakeWorker("other")  # a live replica
    harness.store.rows["busy"] = Row("busy", "note", _hash({"n": 5}), "IN_PROGRESS", "other")
    q = harness.queue
    mid = q.send(body("busy", 5))
    await until(lambda: any(c[0] == mid for c in q.visibility_calls), "deferred")
    assert calls == []
    assert harness.store.failures == {}
    assert q.visibility_calls[-1] == (mid, 2)  # contention delay 4 s, equal jitter with rng=0
    assert mid in q.messages


async def test_fifo_failure_blocks_later_messages_of_its_group(registry: Registry, calls: list[int]) -> None:
    q = FakeQueue(fifo=True)
    q.send(body("a1", 1), "A")
    q.send(body("a2", -2), "A")  # fails
    q.send(body("a3", 3), "A")  # must not overtake a2
    q.send(body("b1", 10), "B")
    async with Harness(settings(queue_url="http://127.0.0.1:1/q.fifo"), registry, q) as h:
        await until(lambda: h.store.failures.get("a2") == 1, "a2 failed once")
        await until(lambda: len(q.messages) == 2, "a1 and b1 acked")
        assert calls == [1, 10]
        assert {q.messages[m].body for m in q.messages} == {body("a2", -2), body("a3", 3)}
        assert "a3" not in h.store.rows  # its claim was released


async def test_database_outage_stops_receiving_then_resumes(registry: Registry, calls: list[int]) -> None:
    q = RecordingQueue()
    async with Harness(settings(), registry, q) as harness:
        await outage_then_recovery(harness, q, calls)


async def outage_then_recovery(harness: Harness, q: RecordingQueue, calls: list[int]) -> None:
    pings = 0
    real_ping = harness.store.ping

    async def counting_ping() -> None:
        nonlocal pings
        pings += 1
        await real_ping()

    harness.store.ping = counting_ping  # type: ignore[method-assign]  # a stub on this instance
    await until(lambda: harness.worker.readiness()[0], "ready before the outage")
    harness.store.db.down = True
    mid = q.send(body("r1", 1))
    await until(lambda: not harness.worker.readiness()[0], "not ready")
    # A poll already waiting may have taken the message (its claim failed: released).
    await until(lambda: q.receiving == 0, "polls already in flight returned")
    q.messages[mid].visible_at = 0
    receives, seen_pings = q.events.count("receive"), pings
    # Two more reconnection probes while the message sits visible: still no receive.
    await until(lambda: pings >= seen_pings + 2, "two more database probes")
    assert q.events.count("receive") == receives
    harness.store.db.down = False
    await until(lambda: not q.messages, "processed after recovery")
    assert calls == [1]
    assert harness.worker.readiness()[0]


async def test_stop_finishes_in_flight_batch_and_exits_0(registry: Registry) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(p: Note, conn: Any) -> None:
        started.set()
        await release.wait()

    registry = Registry()
    registry.register("note", Note, slow)
    q = FakeQueue()
    q.send(body("s1", 1))
    async with Harness(settings(), registry, q) as h:
        await asyncio.wait_for(started.wait(), 5)
        h.worker.request_stop()
        assert not h.worker.readiness()[0]
        await asyncio.sleep(0.1)
        q.send(body("late", 2))
        release.set()
        assert h.task is not None
        assert await asyncio.wait_for(h.task, 10) == EXIT_OK
    assert h.store.rows["s1"].status == "COMPLETED"
    assert len(q.messages) == 1  # the late one was not taken (or was released at once)
    [late] = q.messages.values()
    assert late.visible_at <= time.monotonic()


async def test_stop_deadline_cancels_and_releases(registry: Registry) -> None:
    async def stuck(p: Note, conn: Any) -> None:
        await asyncio.sleep(3600)

    registry = Registry()
    registry.register("note", Note, stuck)
    q = FakeQueue()
    mid = q.send(body("s1", 1))
    async with Harness(settings(shutdown_timeout=0.5), registry, q) as h:
        await until(lambda: "s1" in h.store.rows, "claimed")
        assert await h.stop() == EXIT_OK
    assert "s1" not in h.store.rows  # claim released
    assert q.messages[mid].visible_at <= time.monotonic()  # visible again at once


def _hash(payload: dict[str, Any]) -> str:
    from service.core.messages import payload_hash

    return payload_hash(payload)


def _live_replica(store: FakeStore) -> None:
    """Worker "other", alive: its heartbeat far ahead, so no GC collects its claims here."""
    from service.testing import FakeWorker

    store.db.workers["other"] = FakeWorker("other", heartbeat_at=time.monotonic() + 3600)


async def test_fifo_wait_behind_another_owner_gives_back_later_claims(
    registry: Registry, calls: list[int]
) -> None:
    from service.testing import Row

    q = FakeQueue(fifo=True)
    a1 = q.send(body("a1", 1), "A")
    a2 = q.send(body("a2", 2), "A")
    h = Harness(settings(queue_url="http://127.0.0.1:1/q.fifo"), registry, q)
    _live_replica(h.store)
    h.store.rows["a1"] = Row("a1", "note", _hash({"n": 1}), "IN_PROGRESS", "other")
    with capture_logs() as logs:
        async with h:
            await until(lambda: len(q.visibility_calls) >= 2, "both deferred")
            assert calls == []
            assert "a2" not in h.store.rows  # claimed, then given back: no stale claim left
            assert len(q.messages) == 2
    # Both wait the contention delay (4 s, equal jitter with rng=0): a2 behind a1 — the
    # batch's own plan, not a failed batch's blanket hand-back.
    assert sorted(q.visibility_calls[:2]) == sorted([(a1, 2), (a2, 2)])
    assert not [e for e in logs if e["event"] == "batch_failed"]


async def test_a_fifo_head_claimed_by_a_dead_worker_is_taken_over_not_deferred(
    registry: Registry, calls: list[int]
) -> None:
    """Its owner died after the startup GC, and the next GC pass is an hour away: the claim
    statement takes the head's claim over (counted as an orphan collected), and the head
    and its follower are applied in order in the same receive, nothing deferred."""
    from service.observe import metrics
    from service.testing import FakeWorker, Row

    q = RecordingQueue(fifo=True)
    store = FakeStore(lease=3)
    store.db.workers["dead"] = FakeWorker("dead")
    store.rows["h"] = Row("h", "note", _hash({"n": 1}), "IN_PROGRESS", "dead", group_id="A",
                          sequence_number=1)
    h = Harness(settings(queue_url="http://127.0.0.1:1/q.fifo", gc_interval=3600), registry,
                q, store)
    before = metrics.orphans_collected._value.get()
    with capture_logs() as logs:
        async with h:
            await until(lambda: "receive" in q.events, "the startup GC done, polling")
            store.db.age_worker("dead", 3600)
            q.send(body("h", 1), "A")
            q.send(body("f", 2), "A")
            await until(lambda: not q.messages, "both applied")
    assert calls == [1, 2] and q.visibility_calls == []
    assert {r: (row.status, row.owner) for r, row in store.rows.items()} == {
        "h": ("COMPLETED", "fake-worker"), "f": ("COMPLETED", "fake-worker")}
    assert metrics.orphans_collected._value.get() - before == 1
    assert [(e["request_id"], e["owner"]) for e in logs
            if e["event"] == "orphan_taken_over"] == [("h", "dead")]


async def test_dead_lettered_redelivery_is_acked_not_applied(harness: Harness, calls: list[int]) -> None:
    from service.core.seams import DeadLetter

    q = harness.queue
    mid = q.send(body("r9", 9))
    harness.store.dead[mid] = DeadLetter(mid, body("r9", 9), "max_receives_exceeded", "x",
                                         "r9", "note", 5)
    await until(lambda: not q.messages, "acked")
    assert calls == []
    assert "r9" not in harness.store.rows


async def test_a_dead_poller_fails_liveness_and_exits_1(registry: Registry) -> None:
    class Broken(FakeQueue):
        async def receive(self, *a: Any, **k: Any) -> list[Any]:
            raise RuntimeError("bug in the poller")

    async with Harness(settings(), registry, Broken()) as h:
        assert h.task is not None
        code = await asyncio.wait_for(h.task, 10)
        _, detail = h.worker.liveness()
    assert code == 1
    assert detail["dead_pollers"]


async def test_a_hung_handler_times_out_as_a_failure(registry: Registry) -> None:
    async def hung(p: Note, conn: Any) -> None:
        await asyncio.sleep(3600)

    registry = Registry()
    registry.register("note", Note, hung)
    q = FakeQueue()
    mid = q.send(body("h1", 1))
    async with Harness(settings(handler_timeout=0.2), registry, q) as h:
        await until(lambda: any(c[0] == mid for c in q.visibility_calls), "released")
        assert h.store.failures.get("h1") == 1  # counted as a handler failure
        assert "h1" not in h.store.rows  # claim released


async def test_a_database_back_with_an_older_schema_is_not_ready(harness: Harness, calls: list[int]) -> None:
    """Restored from a backup behind this code's migrations: stay not ready, receive
    nothing, until the schema is current again."""
    q = harness.queue
    harness.store.db.down = True
    harness.store.db.schema_behind = True
    mid = q.send(body("r1", 1))
    await until(lambda: not harness.worker.readiness()[0], "not ready")
    harness.store.db.down = False
    await until(lambda: harness.worker.readiness()[1]["schema"] is False, "schema behind")
    assert harness.worker.readiness()[1]["database"] is False  # still not receiving
    checks = harness.store.db.schema_checks
    q.messages[mid].visible_at = 0
    await until(lambda: harness.store.db.schema_checks >= checks + 2, "two more probes")
    assert "r1" not in harness.store.rows and calls == []  # nothing claimed meanwhile
    harness.store.db.schema_behind = False
    await until(lambda: not q.messages, "processed once the schema is current")
    assert calls == [1] and harness.worker.readiness()[0]


# -- The commit path's own decisions (BatchProcessor._apply), issue 22's survivors ---------


async def test_a_batch_handler_gets_the_received_batch_in_one_call() -> None:
    """A type with a batch form: the daemon hands it the batch whole, one call for the
    five messages received together; the one-by-one function is never called."""
    one: list[int] = []
    batches: list[list[str]] = []

    async def note(p: Note, conn: Any) -> dict[str, int]:
        one.append(p.n)
        return {"n": p.n}

    async def notes(items: list[tuple[str, Any]], conn: Any) -> list[dict[str, Any] | None]:
        batches.append([rid for rid, _ in items])
        return [{"n": p.n} for _, p in items]

    registry = Registry()
    registry.register("note", Note, note)
    registry.register_batch("note", notes)
    q = FakeQueue()
    for i in range(5):
        q.send(body(f"r{i}", i))
    async with Harness(settings(pollers=1), registry, q) as h:
        await until(lambda: not q.messages, "queue drained")
    assert batches == [[f"r{i}" for i in range(5)]] and one == []
    assert {r.status for r in h.store.rows.values()} == {"COMPLETED"}


async def test_a_claim_lost_before_the_commit_is_deferred_for_the_contention_delay(
    registry: Registry, calls: list[int],
) -> None:
    """The orphan GC took the claim between the claim and the commit (another owner holds
    it at the fence): nothing is applied for it, and the message comes back after the
    contention delay — not as a failure, not as a failed batch."""
    q = FakeQueue()
    mid = q.send(body("r1", 1))
    h = Harness(settings(pollers=1, contention_delay=40), registry, q)
    apply = h.store.apply

    async def stolen_then_apply(*args: Any, **kwargs: Any) -> Any:
        _live_replica(h.store)
        h.store.rows["r1"].owner = "other"  # what a GC and a replica's new claim leave
        return await apply(*args, **kwargs)

    h.store.apply = stolen_then_apply  # type: ignore[method-assign]
    async with h:
        await until(lambda: any(c[0] == mid for c in q.visibility_calls), "deferred")
    assert q.visibility_calls == [(mid, 20)]  # contention 40 s, equal jitter with rng=0
    assert h.store.rows["r1"].status == "IN_PROGRESS" and h.store.failures == {}
    assert calls == [] and mid in q.messages


async def test_a_handler_failure_on_the_queues_last_receive_is_dead_lettered_at_once(
    registry: Registry,
) -> None:
    """The queue's RedrivePolicy moves a message after 3 receives; one received for the 3rd
    time fails its handler for the first time: the daemon dead-letters it now (one failure
    is final there) rather than let SQS move it unrecorded."""
    q = FakeQueue()
    q.max_receive_count = 3
    mid = q.send(body("bad", -1))
    q.messages[mid].receive_count = 2  # two receives by a consumer before this one
    async with Harness(settings(pollers=1, max_receive_count=5), registry, q) as h:
        await until(lambda: mid not in q.messages, "acked")
    letter = h.store.dead[mid]
    assert (letter.reason, letter.receive_count) == ("max_receives_exceeded", 3)
    assert h.store.failures == {} and q.dead_lettered_by_sqs == []


async def test_the_crash_point_fires_after_the_commit_before_any_delete(
    registry: Registry, calls: list[int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The chaos harness's crash point (tests/crashpoint.py, wrapped around the store's
    apply): it is reached once the batch's rows are committed and while its message is still
    on the queue. The kill is replaced by a snapshot of that moment."""
    import types

    from tests import crashpoint

    q = FakeQueue()
    h = Harness(settings(pollers=1), registry, q)
    seen: list[tuple[dict[str, str], list[str]]] = []

    def kill(pid: int, sig: int) -> None:
        seen.append(({k: r.status for k, r in h.store.rows.items()}, list(q.deleted)))

    monkeypatch.setattr(FakeStore, "apply", FakeStore.apply)  # restored after the test
    monkeypatch.setattr(crashpoint, "os", types.SimpleNamespace(
        write=lambda fd, data: len(data), getpid=lambda: 0, kill=kill))
    crashpoint.install(FakeStore, crashpoint.AFTER_COMMIT_BEFORE_DELETE)
    mid = q.send(body("r1", 1))
    async with h:
        await until(lambda: not q.messages, "acked")
    assert seen == [({"r1": "COMPLETED"}, [])]
    assert q.deleted == [mid] and calls == [1]


async def test_the_daemon_traces_each_message_through_claim_commit_and_settle(
    registry: Registry,
) -> None:
    """With tracing on, the daemon's own path (not tracing's unit) opens one span per step
    under each message's span: the commit's names the request and parents the handler."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from service.observe import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, "http://127.0.0.1:1/000000000000/q")
    try:
        q = FakeQueue()
        q.send(body("r1", 1))
        q.send(body("r2", 2))
        async with Harness(settings(pollers=1), registry, q):
            await until(lambda: not q.messages, "acked")
    finally:
        tracing.shutdown()
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}
    steps = sorted((s.name, str((s.attributes or {}).get("sqs_ingest.request_id")))
                   for s in spans if s.parent is not None and s.parent.span_id in by_id
                   and by_id[s.parent.span_id].name == "process q")
    assert steps == [("claim", "r1"), ("claim", "r2"), ("commit", "r1"), ("commit", "r2"),
                     ("settle", "None"), ("settle", "None")]
    batch_steps = {s.name: s.attributes for s in spans
                   if s.parent is not None and s.parent.span_id in by_id
                   and by_id[s.parent.span_id].name == "sqs-ingest batch"}
    assert batch_steps["commit"] == {"messaging.batch.message_count": 2}
    handlers = [s for s in spans if s.name == "handler note"]
    assert len(handlers) == 2
    assert {by_id[h.parent.span_id].name for h in handlers if h.parent} == {"commit"}


@pytest.fixture
def bug_in_batch_clean_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch fails in its clean-up (its duration metric), outside its own guard."""
    from service.observe import metrics

    def broken(value: float) -> None:
        raise RuntimeError("a bug in the batch's clean-up")

    monkeypatch.setattr(metrics.batch_duration, "observe", broken)


@pytest.mark.usefixtures("bug_in_batch_clean_up")
async def test_a_batch_task_that_dies_of_a_bug_stops_the_daemon_with_exit_1(
    registry: Registry,
) -> None:
    """A bug outside the batch's guard (here: its duration metric) is not lost as an
    unretrieved task exception while the daemon carries on: it is logged and the daemon
    exits 1, for the orchestrator to restart it."""
    from service.runtime.worker import EXIT_FATAL

    q = FakeQueue()
    q.send(body("r1", 1))
    with capture_logs() as logs:
        async with Harness(settings(pollers=1), registry, q) as h:
            assert h.task is not None
            code = await asyncio.wait_for(h.task, 10)
    assert code == EXIT_FATAL
    [fatal] = [e for e in logs if e["event"] == "fatal"]
    assert fatal["reason"] == "task_died" and "a bug in the batch" in fatal["error"]


async def test_the_memory_budget_is_whole_again_once_the_batches_are_done(
    registry: Registry,
) -> None:
    """Each batch holds its bodies' bytes in the memory budget (INGEST_MAX_INFLIGHT_BYTES)
    while it runs and gives them all back when it ends: after a stop nothing is held."""
    q = FakeQueue()
    for i in range(12):
        q.send(body(f"r{i}", i))
    h = Harness(settings(pollers=1), registry, q)
    held: list[int] = []
    apply = h.store.apply

    async def apply_seen(messages: Any, *args: Any, **kwargs: Any) -> Any:
        held.append(h.worker.budget.used)
        return await apply(messages, *args, **kwargs)

    h.store.apply = apply_seen  # type: ignore[method-assign]
    async with h:
        await until(lambda: not q.messages, "drained")
    assert held and min(held) >= len(body("r0", 0))  # counted while the batch commits
    assert h.worker.budget.used == 0


def _claim_fails_once(store: FakeStore, exc: Exception) -> list[list[str]]:
    """The store's next claim raises ``exc`` (later ones go through); returns the request
    ids of the claim that failed, once it has."""
    claim = store.claim
    failed: list[list[str]] = []

    async def claim_once(messages: Any) -> Any:
        if not failed:
            failed.append([m.request_id for m in messages])
            raise exc
        return await claim(messages)

    store.claim = claim_once  # type: ignore[method-assign]
    return failed


async def test_a_transient_store_error_hands_the_batch_back_whole_for_later(
    registry: Registry, calls: list[int],
) -> None:
    """A store seam that raises TransientError (retry later, not an outage): the batch is
    handed back whole with the retry backoff — not bisected, nothing dead-lettered, the
    database still up — and completes on a later receive."""
    from service.errors import TransientError

    q = FakeQueue()
    ids = [q.send(body(f"r{i}", i)) for i in range(3)]
    h = Harness(settings(pollers=1), registry, q)
    failed = _claim_fails_once(h.store, TransientError("lock wait timed out"))
    with capture_logs() as logs:
        async with h:
            await until(lambda: len(q.visibility_calls) >= 3, "handed back")
            assert sorted(q.visibility_calls) == sorted((m, 1) for m in ids)  # base 2 s, rng 0
            assert h.worker.readiness()[0]  # not taken for an outage
            for m in ids:
                if m in q.messages:  # (not completed already, on a slow machine)
                    q.messages[m].visible_at = 0
            await until(lambda: not q.messages, "completed later")
    assert failed == [["r0", "r1", "r2"]] and sorted(calls) == [0, 1, 2]
    assert h.store.dead == {}
    assert [e["error"] for e in logs if e["event"] == "batch_retry_later"] == [
        "lock wait timed out"]


async def test_an_outage_met_by_a_batch_is_reported_with_the_database_s_error(
    registry: Registry, calls: list[int],
) -> None:
    """The batch is the first to meet the outage (its claim): the daemon goes not-ready and
    its log line says what the database said, then it recovers and completes the message."""
    from service.errors import DatabaseUnavailable

    q = FakeQueue()
    mid = q.send(body("r1", 1))
    h = Harness(settings(pollers=1), registry, q)
    _claim_fails_once(h.store, DatabaseUnavailable("connection lost in claim: ConnectionResetError()"))
    with capture_logs() as logs:
        async with h:
            await until(lambda: bool(q.visibility_calls), "handed back")
            if mid in q.messages:  # (not completed already, on a slow machine)
                q.messages[mid].visible_at = 0
            await until(lambda: not q.messages, "completed after the outage")
    assert [e["error"] for e in logs if e["event"] == "database_unavailable"] == [
        "connection lost in claim: ConnectionResetError()"]
    assert [e["event"] for e in logs if e["event"].startswith("database_")] == [
        "database_unavailable", "database_available"]  # not ready, then ready again
    assert calls == [1]


async def test_a_message_whose_handler_outlasts_half_the_visibility_timeout_is_kept_hidden() -> None:
    """The batch's heartbeat, started by the daemon's path: with a 4 s visibility timeout a
    handler still running after 2 s gets its message's visibility extended (to 4 s more),
    so no other consumer receives it meanwhile; the handler waits for that extension."""
    q = FakeQueue()
    extended = asyncio.Event()

    async def slow(p: Note, conn: Any) -> dict[str, int]:
        await asyncio.wait_for(extended.wait(), 10)
        return {"n": p.n}

    registry = Registry()
    registry.register("note", Note, slow)
    mid = q.send(body("r1", 1))
    store = FakeStore()
    worker = Worker(settings(pollers=1, contention_delay=40), q, store, registry,
                    visibility_timeout=4, rng=lambda: 0.0)
    task = asyncio.create_task(worker.run())
    try:
        await until(lambda: bool(q.visibility_calls), "an extension")
        assert q.visibility_calls[0] == (mid, 4)
        assert q.messages[mid].receive_count == 1  # never received a second time
        extended.set()
        await until(lambda: not q.messages, "completed")
    finally:
        worker.request_stop()
        assert await asyncio.wait_for(task, 20) == EXIT_OK
    assert store.rows["r1"].status == "COMPLETED"


class _NoSequenceNumbers(FakeQueue):
    """A FIFO queue whose messages come without a SequenceNumber (as some emulators send
    them): order within a group is the order of the batch as received."""

    async def receive(self, max_messages: int = 10, wait_seconds: int = 0,
                      visibility_timeout: int | None = 30) -> list[Any]:
        import dataclasses

        got = await super().receive(max_messages, wait_seconds, visibility_timeout)
        return [dataclasses.replace(r, sequence_number=None) for r in got]


async def test_fifo_without_sequence_numbers_a_follower_waits_behind_its_group_by_batch_order(
    registry: Registry, calls: list[int],
) -> None:
    """Group A as received: a0 (request x), a1 (x again: a twin, deferred for the
    contention delay, 20 s with rng=0), a2 (request y, whose handler fails: 1 s backoff).
    a2 came after a1, so it must not be visible before it: both come back after 20 s —
    the batch's own order decides, as the messages carry no SequenceNumber."""
    q = _NoSequenceNumbers(fifo=True)
    q.send(body("x", 1), "A")
    a1 = q.send(body("x", 1), "A")
    a2 = q.send(body("y", -1), "A")
    h = Harness(settings(pollers=1, contention_delay=40,
                         queue_url="http://127.0.0.1:1/q.fifo"), registry, q)
    async with h:
        await until(lambda: len(q.visibility_calls) >= 2, "a1 and a2 handed back")
    assert sorted(q.visibility_calls[:2]) == sorted([(a1, 20), (a2, 20)])
    assert calls == [1]


@pytest.mark.usefixtures("bug_in_batch_clean_up")
async def test_a_batch_that_dies_of_a_bug_while_stopping_is_logged_and_the_exit_stays_0(
    registry: Registry,
) -> None:
    """A stop requested while a batch runs; the batch then dies in its clean-up: the drain
    goes on and the exit is still 0 (its work was committed and acked), with one line."""
    started, release = asyncio.Event(), asyncio.Event()

    async def slow(p: Note, conn: Any) -> dict[str, int]:
        started.set()
        await asyncio.wait_for(release.wait(), 10)
        return {"n": p.n}
    r = Registry()
    r.register("note", Note, slow)
    q = FakeQueue()
    mid = q.send(body("r1", 1))
    with capture_logs() as logs:
        h = Harness(settings(pollers=1), r, q)
        async with h:
            await asyncio.wait_for(started.wait(), 10)
            h.worker.request_stop()
            release.set()
            assert h.task is not None
            code = await asyncio.wait_for(h.task, 20)
    assert code == EXIT_OK and mid not in q.messages
    assert [e["error"] for e in logs if e["event"] == "task_failed_while_stopping"] == [
        "RuntimeError(\"a bug in the batch's clean-up\")"]
    assert not [e for e in logs if e["event"] == "fatal"]



def test_every_fatal_is_logged_and_the_first_decides_the_exit_code(registry: Registry) -> None:
    """A batch died (exit 1) and another then failed its acks: the exit stays 1, and the
    ack failure's line still names the messages it left on the queue."""
    from service.runtime.worker import EXIT_FATAL

    worker = Worker(settings(), FakeQueue(), FakeStore(), registry, visibility_timeout=30)
    with capture_logs() as logs:
        worker._fatal(EXIT_FATAL, "task_died", task="batch-m1", error="RuntimeError()")
        worker._fatal(EXIT_ACK_FAILED, "ack_failed", message_ids=["m2"], error="injected")
    assert worker.exit_code == EXIT_FATAL and worker.stopping
    assert [(e["reason"], e["exit_code"], e.get("message_ids")) for e in logs
            if e["event"] == "fatal"] == [("task_died", EXIT_FATAL, None),
                                          ("ack_failed", EXIT_FATAL, ["m2"])]


async def test_batch_duration_is_observed_once_per_batch_in_seconds(registry: Registry) -> None:
    """sqs_ingest_batch_duration_seconds (SPEC §6): one observation per batch, the batch's
    own wall time — a fraction of a second here, not a clock reading."""
    from service.observe import metrics

    def observed() -> tuple[float, float]:
        [metric] = metrics.batch_duration.collect()
        samples = {s.name: s.value for s in metric.samples}
        return (samples["sqs_ingest_batch_duration_seconds_count"],
                samples["sqs_ingest_batch_duration_seconds_sum"])

    count, total = observed()
    q = FakeQueue()
    q.send(body("r1", 1))
    async with Harness(settings(pollers=1), registry, q):
        await until(lambda: not q.messages, "acked")
    count2, total2 = observed()
    assert count2 - count == 1
    assert 0 < total2 - total < 10


async def test_after_an_outage_a_worker_row_pruned_meanwhile_is_back_before_any_claim(
    registry: Registry, calls: list[int],
) -> None:
    """This worker's row was pruned while the database was away (a long outage): when it
    is back, the row is registered again before the next claim — not at the next heartbeat
    tick (20 s here), in between every claim would have an owner other replicas' GC takes
    for gone."""
    q = FakeQueue()
    h = Harness(settings(pollers=1, worker_lease=60), registry, q)
    with_row: list[bool] = []
    claim = h.store.claim

    async def claim_seen(messages: Any) -> Any:
        present = h.store.worker_id in h.store.db.workers
        result = await claim(messages)
        with_row.append(present)  # only claims that reached the database
        return result

    h.store.claim = claim_seen  # type: ignore[method-assign]
    await h.store.register_worker("w")  # as `run` does before the worker starts (app.py)
    async with h:
        await until(lambda: h.worker.readiness()[0], "ready")
        assert h.store.worker_id in h.store.db.workers
        h.store.db.down = True
        mid = q.send(body("r1", 1))
        await until(lambda: not h.worker.readiness()[0], "not ready")
        del h.store.db.workers[h.store.worker_id]  # pruned while the database was away
        h.store.db.down = False
        await until(lambda: h.worker.readiness()[0], "ready again")
        if mid in q.messages:
            q.messages[mid].visible_at = 0
        await until(lambda: not q.messages, "completed")
    assert with_row == [True] and calls == [1]



# -- a backlog: several receives per batch (INGEST_RECEIVES_PER_BATCH) -----------------------


class ClaimSizes(FakeStore):
    """FakeStore that records how many messages each claim statement carried."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    async def claim(self, messages: Any) -> Any:
        self.sizes.append(len(messages))
        return await super().claim(messages)


class WaitsQueue(FakeQueue):
    """FakeQueue that records each receive's WaitTimeSeconds, and can refuse one receive."""

    def __init__(self, fifo: bool = False, refuse: int | None = None) -> None:
        super().__init__(fifo)
        self.waits: list[int] = []
        self.refuse = refuse  # the index of the receive that raises TransientError
        self.just_received = False

    async def receive(self, max_messages: int = 10, wait_seconds: int = 0,
                      visibility_timeout: int | None = 30) -> Any:
        self.waits.append(wait_seconds)
        if self.refuse is not None and len(self.waits) - 1 == self.refuse:
            raise TransientError("ReceiveMessage failed: injected")
        try:
            return await super().receive(max_messages, wait_seconds, visibility_timeout)
        finally:
            self.just_received = True


async def drain_backlog(s: Settings, registry: Registry, q: FakeQueue, n: int,
                        group: str | None = None, harness: Harness | None = None) -> ClaimSizes:
    """Send ``n`` messages, then run a worker until every one is completed and acked."""
    for i in range(n):
        q.send(body(f"b{i}", i), group)
    h = harness or Harness(s, registry, q, ClaimSizes())
    assert isinstance(h.store, ClaimSizes)
    async with h:
        await until(lambda: not q.messages, "backlog drained")
        await until(lambda: len(h.store.rows) == n, "every request completed")
    assert sum(h.store.sizes) == n  # each claimed once
    return h.store


async def test_a_backlog_is_claimed_three_receives_at_a_time(registry: Registry,
                                                             calls: list[int]) -> None:
    q = WaitsQueue()
    store = await drain_backlog(settings(pollers=1, receives_per_batch=3), registry, q, 25)
    assert store.sizes == [25]  # 10 + 10 + 5: one claim, one completing transaction
    assert sorted(calls) == list(range(25))  # each applied once
    # The follow-ups never wait (a long poll would hold the first ten meanwhile); the one
    # that came back with five ended the batch.
    assert q.waits[:3] == [1, 0, 0]


async def test_one_receive_per_batch_when_set_to_one(registry: Registry) -> None:
    q = WaitsQueue()
    store = await drain_backlog(settings(pollers=1, receives_per_batch=1), registry, q, 25)
    assert store.sizes == [10, 10, 5]
    assert 0 not in q.waits


async def test_fifo_batches_take_one_receive(registry: Registry) -> None:
    q = WaitsQueue(fifo=True)
    s = settings(queue_url="http://127.0.0.1:1/q.fifo", pollers=1, receives_per_batch=3)
    store = await drain_backlog(s, registry, q, 25)
    assert max(store.sizes) <= 10
    assert 0 not in q.waits


async def test_a_failed_follow_up_receive_keeps_what_the_first_brought(
    registry: Registry, calls: list[int]
) -> None:
    q = WaitsQueue(refuse=1)  # the first follow-up fails
    store = await drain_backlog(settings(pollers=1, receives_per_batch=3), registry, q, 25)
    assert store.sizes[0] == 10  # the first receive's ten, processed without the rest
    assert sorted(calls) == list(range(25))


async def test_follow_ups_only_with_room_in_the_memory_budget(registry: Registry,
                                                              calls: list[int]) -> None:
    q = WaitsQueue()
    h = Harness(settings(pollers=1, receives_per_batch=3), registry, q, ClaimSizes())
    budget = h.worker.budget
    real_try_take = budget.try_take

    def no_room_right_after_a_receive(n: int, owner: object, urgent: bool = False) -> bool:
        # Right after a receive the only request for room is a follow-up's: refused.
        if q.just_received and not urgent:
            q.just_received = False
            return False
        return real_try_take(n, owner, urgent)

    budget.try_take = no_room_right_after_a_receive  # type: ignore[method-assign]
    store = await drain_backlog(h.worker.s, registry, q, 12, harness=h)
    assert store.sizes == [10, 2]  # no follow-up without room; nothing lost
    assert sorted(calls) == list(range(12))

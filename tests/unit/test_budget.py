"""The memory budget (INGEST_MAX_INFLIGHT_BYTES): the pure MemoryBudget, and the worker over
the fakes — receiving waits while it is full, a batch whose payloads exceed it completes in
rounds without holding more than the budget, and a budget that cannot hold one payload is
bad configuration."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from service.adapters.payloads import S3Payloads
from service.core.budget import MemoryBudget
from service.handlers import Registry, current_request_id
from service.observe import metrics
from service.runtime.worker import Worker
from service.settings import ConfigError, load_settings
from service.testing import FakeQueue, FakeStore
from tests.unit.test_payloads import FakeS3, Note, doc, note_registry, pointer_body
from tests.unit.test_worker import settings, until


async def drain(w: Any, queue: Any) -> None:
    """Runs the worker until the queue is empty, then stops it: it exits 0."""
    task = asyncio.create_task(w.run())
    try:
        await until(lambda: not queue.messages, "drained")
    finally:
        w.request_stop()
        assert await asyncio.wait_for(task, 20) == 0


async def test_take_waits_for_room_first_come_first_served() -> None:
    b = MemoryBudget(100)
    a, c, d = object(), object(), object()
    assert b.try_take(60, a)
    first = asyncio.ensure_future(b.take(50, c))
    await asyncio.sleep(0)
    assert not first.done() and not b.try_take(10, d)  # a waiter goes first
    b.give(30, a)
    await asyncio.wait_for(first, 30)
    assert (b.used, b.holds(a), b.holds(c)) == (80, 30, 50)


async def test_when_every_holder_waits_the_first_waiter_is_let_in() -> None:
    """Two batches holding bodies, each waiting for a payload that does not fit: nobody
    would ever give bytes back, so the first is let in (over the limit) instead of a
    deadlock."""
    b = MemoryBudget(100)
    a, c = object(), object()
    assert b.try_take(45, a) and b.try_take(45, c)
    wa = asyncio.ensure_future(b.take(40, a))
    wc = asyncio.ensure_future(b.take(40, c))
    await asyncio.wait_for(wa, 30)
    assert not wc.done()
    b.give_all(a)
    await asyncio.wait_for(wc, 30)
    assert b.used == 85


async def test_a_cancelled_waiter_takes_nothing() -> None:
    b = MemoryBudget(100)
    a, c = object(), object()
    assert b.try_take(100, a)
    w = asyncio.ensure_future(b.take(10, c))
    await asyncio.sleep(0)
    w.cancel()
    await asyncio.gather(w, return_exceptions=True)
    b.give_all(a)
    assert b.used == 0 and b.holds(c) == 0


def test_a_budget_that_cannot_hold_one_payload_is_bad_config() -> None:
    base = {"queue_url": "http://127.0.0.1:1/q", "database_url": "postgresql://u@h/d"}
    assert load_settings(**base).max_inflight_bytes >= load_settings(**base).max_payload_bytes
    with pytest.raises(ConfigError, match=r"INGEST_MAX_INFLIGHT_BYTES .*INGEST_MAX_PAYLOAD"):
        load_settings(**base, max_payload_bytes=2_000_000, max_inflight_bytes=1_000_000)
    load_settings(**base, max_payload_bytes=1_000_000, max_inflight_bytes=1_000_000)


def rig(limit: int, payload_max: int = 4096) -> tuple[Worker, FakeQueue, FakeStore, FakeS3]:
    queue, store, s3 = FakeQueue(), FakeStore(), FakeS3()
    w = Worker(settings(pollers=1, max_payload_bytes=payload_max, max_inflight_bytes=limit),
               queue, store, note_registry(), visibility_timeout=30, rng=lambda: 0.0,
               payloads=S3Payloads(s3, payload_max, allowed="payloads"))
    return w, queue, store, s3


async def test_payloads_beyond_the_budget_are_applied_in_rounds_within_it() -> None:
    """Ten pointers of ~3,000 bytes, a budget of 12,000: never more than the budget held
    (peak), every payload applied, and the batch went through several rounds."""
    w, queue, store, s3 = rig(12_000)
    pad = "x" * 2_900
    for i in range(10):
        s3.put(f"k{i}", doc(f"r{i}")[:-2] + f', "pad": "{pad}"}}}}'.encode())
    for i in range(10):
        queue.send(pointer_body(f"k{i}"))
    await drain(w, queue)
    assert {r: store.rows[r].status for r in store.rows} == {
        f"r{i}": "COMPLETED" for i in range(10)}
    assert w.budget.peak <= 12_000 and w.budget.used == 0
    assert len([c for c in s3.calls if c[0] == "get"]) > 10  # re-opened in later rounds


async def test_receiving_waits_while_the_budget_is_full() -> None:
    w, queue, store, _ = rig(8_192)
    other = object()
    assert w.budget.try_take(8_192, other)  # everything held by batches in flight
    waits = metrics.budget_waits._value.get()
    task = asyncio.create_task(w.run())
    try:
        queue.send(doc("r1").decode())
        await until(lambda: metrics.budget_waits._value.get() > waits, "the poller waits")
        assert "r1" not in store.rows and all(
            m.receive_count == 0 for m in queue.messages.values())  # not even received
        w.budget.give_all(other)
        await until(lambda: "r1" in store.rows and store.rows["r1"].status == "COMPLETED",
                    "received once there is room")
    finally:
        w.request_stop()
        assert await asyncio.wait_for(task, 20) == 0



def fifo_rig(handler: Any) -> tuple[Worker, FakeQueue, FakeStore, FakeS3]:
    """A FIFO queue, two ~3,000-byte payloads and a budget that holds one of them: the
    second is applied in the batch's later round."""
    queue, store, s3 = FakeQueue(fifo=True), FakeStore(), FakeS3()
    reg = Registry()
    reg.register("note", Note, handler)
    w = Worker(settings(queue_url="http://127.0.0.1:1/q.fifo", pollers=1,
                        max_payload_bytes=4096, max_inflight_bytes=4096,
                        retry_base_seconds=1),
               queue, store, reg, visibility_timeout=30, rng=lambda: 0.0,
               payloads=S3Payloads(s3, 4096, allowed="payloads"))
    pad = "x" * 2_900
    for rid in ("head", "follower"):
        s3.put(rid, doc(rid)[:-2] + f', "pad": "{pad}"}}}}'.encode())
        queue.send(pointer_body(rid), group_id="g")
    return w, queue, store, s3


async def test_a_later_round_holds_back_the_group_of_a_head_that_failed() -> None:
    """FIFO, head and follower both S3 pointers, room for one payload: the head fails in the
    first round and is handed back; the follower, in the later round, waits behind it (it
    was applied and deleted before its head)."""
    applied: list[str] = []
    failed: list[str] = []

    async def note(p: Note, conn: Any) -> dict[str, int]:
        rid = current_request_id()
        if rid == "head" and not failed:
            failed.append(rid)
            raise RuntimeError("transient, once")
        applied.append(rid)
        return {"n": p.n}

    w, queue, store, _ = fifo_rig(note)
    await drain(w, queue)
    assert failed == ["head"]
    assert applied == ["head", "follower"]
    assert {r: store.rows[r].status for r in store.rows} == {
        "head": "COMPLETED", "follower": "COMPLETED"}
    assert w.budget.peak <= 4096 and w.budget.used == 0


async def test_the_heartbeat_covers_a_later_round() -> None:
    """The first round's acks stop the visibility heartbeat: the later round must start it
    again, or its messages come back visible while their handlers run."""
    covered: dict[str, bool] = {}

    async def note(p: Note, conn: Any) -> dict[str, int]:
        covered[current_request_id()] = any(
            t.get_name() == "extender" and not t.done() for t in asyncio.all_tasks())
        return {"n": p.n}

    w, queue, _, _ = fifo_rig(note)
    await drain(w, queue)
    assert covered == {"head": True, "follower": True}


def test_the_default_budget_lets_every_poller_receive_at_once() -> None:
    """Ten 1 MiB messages are 10 MiB, the whole default budget: a poll taking room for a full
    receive would let only one of INGEST_POLLERS ask at a time (found by the SIGTERM chaos
    test: four pollers never got into their long polls). Each poll takes its share."""
    s = load_settings(queue_url="http://127.0.0.1:1/q", database_url="postgresql://u@h/d")
    w = Worker(s, FakeQueue(), FakeStore(), note_registry(), visibility_timeout=30,
               max_message_bytes=1024 * 1024)
    owners = [object() for _ in range(s.pollers)]
    assert all(w.budget.try_take(w.receive_reserve, o) for o in owners)


async def test_a_receive_beyond_its_room_is_charged_to_its_batch() -> None:
    """A poll's room is its share of the budget; messages that take more are counted all the
    same (over the limit if need be), so the next polls wait until the batch gives them back."""
    queue = FakeQueue()
    release = asyncio.Event()

    class Slow(FakeStore):
        async def claim(self, messages):
            await release.wait()
            return await super().claim(messages)

    store = Slow()
    w = Worker(settings(pollers=2, max_payload_bytes=4096, max_inflight_bytes=8192),
               queue, store, note_registry(), visibility_timeout=30, rng=lambda: 0.0)
    assert w.receive_reserve == 4096
    body = doc("big")[:-2] + b', "pad": "' + b"x" * 6000 + b'"}}'
    queue.send(body.decode())
    task = asyncio.create_task(w.run())
    try:
        await until(lambda: w.budget.used >= len(body), "the whole body counted")
        release.set()
        await until(lambda: "big" in store.rows and store.rows["big"].status == "COMPLETED",
                    "applied")
    finally:
        release.set()
        w.request_stop()
        assert await asyncio.wait_for(task, 20) == 0
    assert w.budget.used == 0


async def test_a_body_is_charged_for_the_json_values_it_will_be_parsed_into() -> None:
    """Security review, issue 42: parsed, [{},{},…] is 26 times its size, held until the
    batch ends; counting raw bytes only, 80 bodies of 149 kB just under
    INGEST_MAX_JSON_VALUES were admitted at once (391 MiB peak). A body is charged its
    characters plus PARSED_BYTES_PER_VALUE for each value it holds."""
    from service.core.budget import MemoryBudget
    from service.core.limits import PARSED_BYTES_PER_VALUE, json_values
    from service.core.messages import Received
    from service.runtime.worker import keep_bytes

    bomb = '{"request_id":"r","type":"t","payload":{"junk":[' + ",".join(["{}"] * 1000) + "]}}"
    plain = "x" * 100
    budget = MemoryBudget(10**6)
    poll, batch = object(), object()
    assert budget.try_take(1000, poll)
    keep_bytes(budget, [Received("m1", "h1", bomb), Received("m2", "h2", plain)], poll, batch)
    assert json_values(bomb) == 2004  # 2 objects, 1 list, 1,000 {} and 1,001 commas
    assert budget.holds(batch) == budget.used == \
        len(bomb) + 2004 * PARSED_BYTES_PER_VALUE + len(plain)
    assert budget.holds(poll) == 0

"""PlanExecutor.give_back on its own: what a batch could not finish goes back, claims
released (only this batch's, only while the database is up), messages visible after the
delay, nothing left unresolved."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import weakref
from typing import Any

import pytest

from service.core.messages import Message, Received
from service.core.retry import ReceiveLimit
from service.errors import AckFailed, DatabaseUnavailable
from service.runtime.executor import InFlight, PlanExecutor
from service.testing import FakeQueue, FakeStore


class RecordingStore(FakeStore):
    def __init__(self) -> None:
        super().__init__()
        self.released: list[list[str]] = []
        self.fail_release = False

    async def release(self, messages: Any) -> None:
        self.released.append([m.request_id for m in messages])
        if self.fail_release:
            raise DatabaseUnavailable("down")


def flight_of(q: FakeQueue, n: int) -> tuple[InFlight, list[Message]]:
    for i in range(n):
        q.send(f"body-{i}")
    got = q._take(n, 30)
    flight = InFlight(list(got))
    # No payload model: the executor never reads it.
    claimed = [Message(r, f"r{i}", "note", None, {}, "h")  # type: ignore[arg-type]
               for i, r in enumerate(got)]
    return flight, claimed


async def test_give_back_releases_this_batch_claims_and_sets_visibility() -> None:
    q, store = FakeQueue(), RecordingStore()
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, claimed = flight_of(q, 3)
    flight.claimed = claimed[:2]  # r2 was never claimed
    flight.resolve([claimed[0].raw])  # r0 was already acked
    await ex.give_back(flight, 7, db_up=True)
    assert store.released == [["r1"]]  # claimed and unresolved only
    assert sorted(q.visibility_calls) == sorted([(claimed[1].raw.message_id, 7),
                                                 (claimed[2].raw.message_id, 7)])
    assert flight.unresolved == {}


async def test_give_back_while_the_database_is_down_only_releases_visibility() -> None:
    q, store = FakeQueue(), RecordingStore()
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, claimed = flight_of(q, 2)
    flight.claimed = claimed
    await ex.give_back(flight, 3, db_up=False)
    assert store.released == []  # the own-leak GC frees them once it is back
    assert sorted(t for _, t in q.visibility_calls) == [3, 3]
    assert flight.unresolved == {}


async def test_give_back_survives_a_failed_release_and_a_failed_visibility_change() -> None:
    class BrokenVisibility(FakeQueue):
        async def change_visibility_batch(self, changes: Any) -> list[str]:
            raise RuntimeError("SQS down")

    q, store = BrokenVisibility(), RecordingStore()
    store.fail_release = True
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, claimed = flight_of(q, 1)
    flight.claimed = claimed
    await ex.give_back(flight, 5, db_up=True)
    assert store.released == [["r0"]]
    assert flight.unresolved == {}  # it comes back by itself after the timeout


async def test_give_back_of_a_resolved_batch_does_nothing() -> None:
    q, store = FakeQueue(), RecordingStore()
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, claimed = flight_of(q, 1)
    flight.claimed = claimed
    flight.resolve([claimed[0].raw])
    await ex.give_back(flight, 5, db_up=True)
    assert store.released == [] and q.visibility_calls == []



async def test_letters_committed_before_the_handlers_are_not_written_again() -> None:
    """The batch commits a part's dead letters before its handlers run; carrying the plan
    out afterwards writes only the letters not committed yet (the executor keeps that in
    the batch's InFlight, the plan stays as it was)."""
    from service.core.plan import Plan
    from service.core.seams import DeadLetter

    class CountingStore(FakeStore):
        writes: list[list[str]]

        async def dead_letter(self, letters: Any) -> None:
            self.writes.append([d.sqs_message_id for d in letters])
            await super().dead_letter(letters)

    q, store = FakeQueue(), CountingStore()
    store.writes = []
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, _ = flight_of(q, 2)
    first, second = flight.batch
    plan = Plan()
    plan.letter(first, DeadLetter.of_received(first, "invalid_json", "early"), "_invalid")
    await ex.commit_letters(plan.letters, flight)
    plan.letter(second, DeadLetter.of_received(second, "invalid_json", "late"), "_invalid")
    await ex.carry_out(plan, flight)
    assert store.writes == [[first.message_id], [second.message_id]]
    assert len(plan.letters) == 2 and not flight.unresolved


class Ordered(FakeQueue):
    """A queue and a store that write every effect into one log, in the order it happens."""

    def __init__(self, log: list[tuple[str, list[str]]]) -> None:
        super().__init__()
        self.log = log

    async def delete_batch(self, messages: Any) -> None:
        self.log.append(("delete", [m.message_id for m in messages]))
        await super().delete_batch(messages)

    async def change_visibility_batch(self, changes: Any) -> list[str]:
        self.log.append(("visibility", [f"{m.message_id}={d}" for m, d in changes]))
        return await super().change_visibility_batch(changes)

    async def requeue(self, changes: Any) -> list[str]:
        self.log.append(("requeue", [f"{m.message_id}={d}" for m, d in changes]))
        return await super().requeue(changes)


class OrderedStore(FakeStore):
    def __init__(self, log: list[tuple[str, list[str]]]) -> None:
        super().__init__()
        self.log = log
        self.fail_letters = False

    async def dead_letter(self, letters: Any) -> None:
        self.log.append(("letters", [d.sqs_message_id for d in letters]))
        if self.fail_letters:
            raise DatabaseUnavailable("down")
        await super().dead_letter(letters)


def ordered_plan(batch: list[Any]) -> Any:
    """m0 poison (letter + ack), m1 completed (ack), m2 retried (release), m3 contended
    (deferral)."""
    from service.core.plan import Plan
    from service.core.seams import DeadLetter

    plan = Plan()
    plan.letter(batch[0], DeadLetter.of_received(batch[0], "invalid_json", "x"), "_invalid")
    plan.ack(batch[1], "note", "completed")
    plan.release(batch[2], 7)
    plan.defer(batch[3], 4)
    return plan


async def test_carry_out_commits_letters_then_stops_the_extender_then_acks_then_hands_back(
) -> None:
    """The executor's one safe order (SPEC: nothing acked before it is durable): dead
    letters committed → visibility extender stopped → deletes → visibility changes
    (releases and deferrals in one call, with their own delays); all four resolved."""
    import asyncio

    log: list[tuple[str, list[str]]] = []
    q, store = Ordered(log), OrderedStore(log)
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, _ = flight_of(q, 4)
    ids = [r.message_id for r in flight.batch]

    async def extender() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            log.append(("extender_stopped", []))

    flight.extender = asyncio.create_task(extender())
    await asyncio.sleep(0)
    await ex.carry_out(ordered_plan(flight.batch), flight)
    assert log == [("letters", [ids[0]]), ("extender_stopped", []),
                   ("delete", [ids[0], ids[1]]),
                   ("visibility", [f"{ids[2]}=7", f"{ids[3]}=4"])]
    assert flight.unresolved == {}
    assert q.deleted == ids[:2] and set(store.dead) == {ids[0]}


async def test_carry_out_acks_nothing_when_the_letters_are_not_committed() -> None:
    log: list[tuple[str, list[str]]] = []
    q, store = Ordered(log), OrderedStore(log)
    store.fail_letters = True
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, _ = flight_of(q, 4)
    with pytest.raises(DatabaseUnavailable):
        await ex.carry_out(ordered_plan(flight.batch), flight)
    assert [step for step, _ in log] == ["letters"]  # no delete, no visibility change
    assert len(flight.unresolved) == 4 and q.deleted == []


async def test_a_failed_ack_hands_nothing_back_and_resolves_nothing() -> None:
    """AckFailed propagates (exit 3): the releases after it are not carried out and the
    batch's messages stay unresolved (the restart's GC makes them safe)."""
    log: list[tuple[str, list[str]]] = []
    q, store = Ordered(log), OrderedStore(log)
    q.fail_delete_call = True
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, _ = flight_of(q, 4)
    with pytest.raises(AckFailed):
        await ex.carry_out(ordered_plan(flight.batch), flight)
    assert [step for step, _ in log] == ["letters", "delete"]
    assert len(flight.unresolved) == 4


def sample(name: str, **labels: str) -> float:
    from service.observe import metrics

    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_carry_out_counts_letters_outcomes_lags_and_contention() -> None:
    """The metrics of a batch, exactly (deltas: the registry is the process's)."""
    names = [("sqs_ingest_dead_letters_total", {"reason": "invalid_json"}),
             ("sqs_ingest_messages_processed_total", {"type": "_invalid",
                                                      "outcome": "dead_lettered"}),
             ("sqs_ingest_messages_processed_total", {"type": "note", "outcome": "completed"}),
             ("sqs_ingest_contention_deferrals_total", {}),
             ("sqs_ingest_message_lag_seconds_count", {}),
             ("sqs_ingest_message_lag_seconds_sum", {})]
    before = [sample(n, **lb) for n, lb in names]
    q, store = FakeQueue(), FakeStore()
    flight, _ = flight_of(q, 5)
    plan = ordered_plan(flight.batch)
    plan.ack(flight.batch[4], "note", "completed")  # two of one (type, outcome): counted 2
    plan.lags.append(2.5)
    plan.contention = 3
    await PlanExecutor(q, store, ReceiveLimit(5)).carry_out(plan, flight)
    after = [sample(n, **lb) for n, lb in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 2, 3, 1, 2.5]


async def test_a_failed_visibility_change_is_counted_not_raised() -> None:
    q = FakeQueue()
    flight, _ = flight_of(q, 2)
    stale = dataclasses.replace(flight.batch[0], receipt_handle="stale")
    before = sample("sqs_ingest_sqs_errors_total", operation="change_visibility")
    await PlanExecutor(q, FakeStore(), ReceiveLimit(5)).change_visibility(
        [(stale, 5), (flight.batch[1], 5)])
    assert sample("sqs_ingest_sqs_errors_total", operation="change_visibility") - before == 1
    assert q.visibility_calls == [(flight.batch[1].message_id, 5)]


def test_hold_keeps_each_fifo_group_s_longest_delay() -> None:
    from service.core.messages import Received

    def r(mid: str, group: str | None) -> Received:
        return Received(mid, "rh", "{}", 1, None, group)

    flight = InFlight([])
    flight.hold([(r("a", "g"), 5), (r("b", "g"), 3), (r("c", None), 9), (r("d", "h"), 0)])
    assert flight.held_groups == {"g": 5, "h": 0}  # a group handed back at once waits 0 s
    flight.hold([(r("e", "h"), 2), (r("f", "g"), 4)])
    assert flight.held_groups == {"g": 5, "h": 2}


def test_resolving_a_message_twice_is_harmless() -> None:
    q = FakeQueue()
    flight, _ = flight_of(q, 2)
    flight.resolve(flight.batch[:1])
    flight.resolve(flight.batch[:1])
    assert list(flight.unresolved) == [flight.batch[1].message_id]


def limited() -> ReceiveLimit:
    """Dead-letter after 2 failures, SQS after 5 receives: a message received 4 times has
    1 receive left (< 2 tries) and must come back as a fresh copy; one received once not."""
    from service.core.retry import RedrivePolicy

    limit = ReceiveLimit(2)
    limit.policy = RedrivePolicy("arn:aws:sqs:us-east-1:000000000000:dlq", 5)
    return limit


class FailingRequeue(FakeQueue):
    def __init__(self, fail: set[str]) -> None:
        super().__init__()
        self.fail = fail

    async def requeue(self, changes: Any) -> list[str]:
        ok = [(m, d) for m, d in changes if m.message_id not in self.fail]
        await super().requeue(ok)
        return [m.message_id for m, _ in changes if m.message_id in self.fail]


async def test_hand_back_copies_what_is_near_the_queue_s_limit_and_hands_back_the_rest() -> None:
    q = FailingRequeue(set())
    flight, _ = flight_of(q, 3)
    first, near, nearer = flight.batch
    changes = [(first, 3), (dataclasses.replace(near, receive_count=4), 3),
               (dataclasses.replace(nearer, receive_count=5), 3)]
    before = sample("sqs_ingest_requeued_total")
    await PlanExecutor(q, FakeStore(), limited()).hand_back(changes)
    assert sorted(q.requeued) == sorted([near.message_id, nearer.message_id])
    assert q.visibility_calls == [(first.message_id, 3)]
    assert sample("sqs_ingest_requeued_total") - before == 2


async def test_a_copy_that_could_not_be_sent_is_handed_back_instead() -> None:
    q = FailingRequeue(set())
    flight, _ = flight_of(q, 3)
    first, near, nearer = flight.batch
    q.fail.add(nearer.message_id)
    changes = [(first, 3), (dataclasses.replace(near, receive_count=4), 3),
               (dataclasses.replace(nearer, receive_count=4), 3)]
    requeued, errors = sample("sqs_ingest_requeued_total"), sample(
        "sqs_ingest_sqs_errors_total", operation="requeue")
    await PlanExecutor(q, FakeStore(), limited()).hand_back(changes)
    assert q.requeued == [near.message_id]
    assert sorted(q.visibility_calls) == sorted([(first.message_id, 3), (nearer.message_id, 3)])
    assert sample("sqs_ingest_requeued_total") - requeued == 1
    assert sample("sqs_ingest_sqs_errors_total", operation="requeue") - errors == 1


async def test_claims_given_back_during_an_outage_are_released_once_it_is_over() -> None:
    """Every batch given back while the database is down (or whose release failed) adds its
    claims; release_unreleased releases them all once, in one attempt, then nothing."""
    q, store = FakeQueue(), RecordingStore()
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    down, claimed_down = flight_of(q, 1)
    down.claimed = claimed_down
    await ex.give_back(down, 3, db_up=False)
    down2, claimed_down2 = flight_of(q, 1)
    down2.claimed = [dataclasses.replace(claimed_down2[0], request_id="r-down")]
    await ex.give_back(down2, 3, db_up=False)
    failing, claimed_failing = flight_of(q, 1)
    failing.claimed = [dataclasses.replace(claimed_failing[0], request_id="r-failed")]
    store.fail_release = True
    await ex.give_back(failing, 3, db_up=True)
    assert [m.request_id for m in ex.unreleased] == ["r0", "r-down", "r-failed"]
    store.fail_release = False
    store.released.clear()
    await ex.release_unreleased()
    assert store.released == [["r0", "r-down", "r-failed"]] and ex.unreleased == []
    await ex.release_unreleased()
    assert store.released == [["r0", "r-down", "r-failed"]]  # nothing left: no call


async def test_a_failed_release_after_the_outage_is_not_retried() -> None:
    q, store = FakeQueue(), RecordingStore()
    ex = PlanExecutor(q, store, ReceiveLimit(5))
    flight, claimed = flight_of(q, 1)
    flight.claimed = claimed
    await ex.give_back(flight, 3, db_up=False)
    store.fail_release = True
    await ex.release_unreleased()  # logged; the own-leak GC frees them later
    assert store.released == [["r0"]] and ex.unreleased == []


@pytest.mark.parametrize("deferral", [False, True])
async def test_give_back_copies_near_the_limit_only_for_a_deferral(deferral: bool) -> None:
    """A deferral (outage, shutdown: not the message's fault) goes through hand_back, which
    sends a fresh copy of a message near the queue's limit; a failed batch's plain give-back
    never does (its receives count)."""
    q = FakeQueue()
    flight, _ = flight_of(q, 2)
    near = dataclasses.replace(flight.batch[1], receive_count=4)
    flight.unresolved[near.message_id] = near
    await PlanExecutor(q, FakeStore(), limited()).give_back(flight, 6, db_up=True,
                                                            **({"deferral": True} if deferral
                                                               else {}))
    first = flight.batch[0].message_id
    if deferral:
        assert (q.requeued, q.visibility_calls) == ([near.message_id], [(first, 6)])
    else:
        assert q.requeued == []
        assert sorted(q.visibility_calls) == sorted([(first, 6), (near.message_id, 6)])
    assert flight.unresolved == {}


@pytest.mark.parametrize("kind", ["releases", "deferrals"])
async def test_carry_out_resolves_what_it_hands_back(kind: str) -> None:
    """A plan with only releases (retries) or only deferrals: handed back and resolved."""
    from service.core.plan import Plan

    q = FakeQueue()
    flight, _ = flight_of(q, 2)
    plan = Plan()
    for r in flight.batch:
        (plan.release if kind == "releases" else plan.defer)(r, 4)
    await PlanExecutor(q, FakeStore(), ReceiveLimit(5)).carry_out(plan, flight)
    assert sorted(q.visibility_calls) == sorted((r.message_id, 4) for r in flight.batch)
    assert flight.unresolved == {}


async def test_a_stopped_heartbeat_leaves_no_cycle_that_keeps_its_batch() -> None:
    """The cancelled heartbeat task keeps its CancelledError, whose traceback holds the frame
    that holds the flight, which held the task: each finished batch (messages, bodies,
    claims) waited for the cyclic GC's rare full collection (BENCHMARKS, peak RSS). Stopped,
    the flight lets go of the task, and the batch goes with its last reference."""
    class Owner:  # what the batch holds, observable (InFlight has slots: no weakref)
        pass

    flight = InFlight([Received("m1", "rh1", "{}")], budget_owner=Owner())
    gone = weakref.ref(flight.budget_owner)

    async def beat(f: InFlight) -> None:  # like VisibilityHeartbeat._extend: holds the flight
        await asyncio.sleep(3600)

    flight.extender = asyncio.create_task(beat(flight))
    await asyncio.sleep(0)
    gc.disable()  # no cyclic collection: only reference counts free the batch
    try:
        await flight.stop_extender()
        del flight
        await asyncio.sleep(0)  # the loop lets go of the step that awaited the stop
        assert gone() is None, "the stopped heartbeat still holds its batch in a cycle"
    finally:
        gc.enable()

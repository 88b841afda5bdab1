"""PlanExecutor.give_back on its own: what a batch could not finish goes back, claims
released (only this batch's, only while the database is up), messages visible after the
delay, nothing left unresolved."""

from __future__ import annotations

from typing import Any

from service.errors import DatabaseUnavailable
from service.executor import InFlight, PlanExecutor
from service.messages import Message
from service.retry import ReceiveLimit
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
    from service.plan import Plan
    from service.seams import DeadLetter

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

"""One hostile message among neighbours, over the fakes: a statement that fails on a
value is bisected down to the message at fault; its neighbours finish in the same receive."""

from __future__ import annotations

import json
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import pytest
from pydantic import BaseModel

from service.core.claims import ClaimsRegistry
from service.core.labels import INVALID_TYPE_LABEL
from service.core.messages import Message, Received, parse
from service.core.plan import Plan
from service.core.retry import ReceiveLimit, RedrivePolicy, RetryPolicy
from service.core.seams import ClaimResult
from service.errors import DataRejected
from service.handlers import Registry
from service.runtime.bisection import Bisection
from service.runtime.executor import InFlight, PlanExecutor
from service.runtime.visibility import VisibilityHeartbeat
from service.testing import FakeQueue, FakeStore
from tests.unit.test_worker import Harness, body, settings, until


class Note(BaseModel):
    n: int


class RefusingStore(FakeStore):
    """A store whose claim statement fails, like PostgreSQL on an index entry too large,
    whenever the batch holds a request_id starting with "hostile"."""

    claims: list[list[str]]

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
        self.claims.append([m.request_id for m in messages])
        if any(m.request_id.startswith("hostile") for m in messages):
            # What the real store raises for asyncpg's ProgramLimitExceededError (the seam
            # speaks service.errors: service.adapters.pgerrors translates at the connection).
            raise DataRejected(
                "ProgramLimitExceededError: index row size 5016 exceeds btree version 4 "
                "maximum 2704")
        return await super().claim(messages)


@pytest.fixture
def registry() -> Registry:
    r = Registry()

    async def note(p: Note, conn: Any) -> dict[str, int]:
        return {"n": p.n}

    r.register("note", Note, note)
    return r


async def test_a_refused_value_costs_only_its_own_message(registry: Registry) -> None:
    q = FakeQueue()
    ids = [q.send(body(f"r{i}", i)) for i in range(4)]
    hostile = q.send(body("hostile-1", 99))
    ids += [q.send(body(f"r{i}", i)) for i in range(4, 9)]
    h = Harness(settings(pollers=1), registry, q)
    h.store = RefusingStore(h.store.worker_id, h.store.db)
    h.store.claims = []
    h.worker = type(h.worker)(h.worker.s, q, h.store, registry, visibility_timeout=30,
                              rng=lambda: 0.0)
    async with h:
        await until(lambda: not q.messages, "every message settled")
    letter = h.store.dead[hostile]
    assert (letter.reason, letter.body) == ("rejected_by_database", body("hostile-1", 99))
    assert "index row size" in (letter.error or "")
    assert sorted(h.store.rows) == sorted(f"r{i}" for i in range(9))
    assert {r.status for r in h.store.rows.values()} == {"COMPLETED"}
    assert len(h.store.dead) == 1  # no neighbour dead-lettered
    assert q.visibility_calls == []  # nobody was handed back: all settled in one receive
    # A bisection of 10 down to 1: at most 2 * ceil(log2(10)) + 1 claim statements.
    assert len(h.store.claims) <= 9, h.store.claims


class _BoomStore(FakeStore):
    """A store with a bug that only request ``boom`` triggers, in its claim; records each
    claim's request ids."""

    def __init__(self) -> None:
        super().__init__()
        self.claims: list[list[str]] = []

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
        self.claims.append([m.request_id for m in messages])
        if any(m.request_id == "boom" for m in messages):
            raise RuntimeError("a bug that only this message triggers")
        return await super().claim(messages)


def _harness(registry: Registry, q: FakeQueue, store: FakeStore) -> Harness:
    """One poller over ``q`` and ``store``, no jitter."""
    h = Harness(settings(pollers=1), registry, q)
    h.store = store
    h.worker = type(h.worker)(h.worker.s, q, store, registry, visibility_timeout=30,
                              rng=lambda: 0.0)
    return h


async def test_a_message_that_keeps_failing_alone_is_the_only_one_dead_lettered(
    registry: Registry,
) -> None:
    """The repeat-offender net: only the message that fails on its own is taken; its
    neighbours from the same batch complete."""
    q = FakeQueue()
    for i in range(3):
        q.send(body(f"r{i}", i))
    bad = q.send(body("boom", 7))
    for m in q.messages.values():
        m.receive_count = 20  # all received far beyond the retry limit already

    store = _BoomStore()
    async with _harness(registry, q, store):
        await until(lambda: not q.messages, "every message settled")
    assert [(k, d.reason) for k, d in store.dead.items()] == [(bad, "processing_error")]
    assert sorted(store.rows) == ["r0", "r1", "r2"]


async def test_a_bug_on_a_first_receive_hands_the_batch_back_whole(registry: Registry) -> None:
    """Bisection is for a refused value or a repeat offender: a statement that fails for any
    other reason on a message's first receives fails its batch, which is handed back whole to
    be retried (not split, nothing dead-lettered, no neighbour completed meanwhile)."""
    q = FakeQueue()
    ids = [q.send(body(f"r{i}", i)) for i in range(3)]
    ids.append(q.send(body("boom", 7)))  # receive_count 1: far from any limit

    store = _BoomStore()
    async with _harness(registry, q, store):
        await until(lambda: len(q.visibility_calls) >= 4, "the batch handed back")
    assert store.claims[0] == ["r0", "r1", "r2", "boom"]  # one claim for the whole batch
    assert all("boom" in c for c in store.claims)  # never split into halves
    assert sorted(m for m, _ in q.visibility_calls[:4]) == sorted(ids)
    assert store.rows == {} and store.dead == {}


def test_limits_at_the_door_name_the_field(registry: Registry) -> None:
    from service.core.messages import Received

    def reason(doc: dict[str, Any]) -> tuple[str, str]:
        p = parse(Received("m", "rh", json.dumps(doc)), registry)
        assert not isinstance(p, Message)
        return p.reason, p.error

    long_id = "x" * 513
    assert reason({"request_id": long_id, "type": "note", "payload": {"n": 1}}) == (
        "request_id_too_long", "request_id has 513 characters, at most 512 are accepted")
    assert reason({"request_id": "r", "type": "t" * 257, "payload": {}})[0] == "type_too_long"
    ok = parse(Received("m", "rh", json.dumps(
        {"request_id": "é" * 512, "type": "note", "payload": {"n": 1}})), registry)
    assert isinstance(ok, Message)  # 512 characters of 2 bytes each still fit


def test_a_payload_too_deep_to_write_back_is_poison_not_a_crash(registry: Registry) -> None:
    """Found by the fuzzer: orjson reads 1,024 levels but writes 254; parse() raised."""
    from service.core.messages import Poison, Received

    deep = "[" * 300 + "0" + "]" * 300
    b = '{"request_id": "r", "type": "note", "payload": {"n": 1, "x": ' + deep + "}}"
    p = parse(Received("m", "rh", b), registry)
    assert isinstance(p, Poison) and p.reason == "invalid_payload"
    assert "Recursion limit" in p.error


async def test_fifo_bisection_keeps_a_handed_back_message_ahead_of_its_group(
    registry: Registry,
) -> None:
    """FIFO: a message that fails alone without being at fault is handed back; the later
    messages of its group in the same batch must wait behind it, not overtake it."""
    q = FakeQueue(fifo=True)
    a1 = q.send(body("a1", 1), "A")
    x = q.send(body("x", 2), "X")
    a2 = q.send(body("a2", 3), "A")
    q.messages[x].receive_count = 20  # far beyond the limit: its failures start a bisection
    applied: list[str] = []

    class Buggy(FakeStore):
        async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
            if any(m.request_id in ("a1", "x") for m in messages):
                raise RuntimeError("a failure outside any handler")
            applied.extend(m.request_id for m in messages)
            return await super().claim(messages)

    store = Buggy()
    h = Harness(settings(pollers=1, queue_url="http://127.0.0.1:1/q.fifo"), registry, q)
    h.store = store
    h.worker = type(h.worker)(h.worker.s, q, store, registry, visibility_timeout=30,
                              rng=lambda: 0.0)
    async with h:
        await until(lambda: x in store.dead and len(q.visibility_calls) >= 2, "settled")
    assert store.dead[x].reason == "processing_error"
    assert "a2" not in applied  # never claimed ahead of a1
    assert (a1, 1) in q.visibility_calls  # handed back after its own failure
    assert (a2, 0) in q.visibility_calls  # released behind it, in order


class _Note(BaseModel):
    n: int


def _failing_on_negative() -> Registry:
    r = Registry()

    async def note(p: _Note, conn: Any) -> dict[str, int]:
        if p.n < 0:
            raise RuntimeError("transient handler failure")
        return {"n": p.n}

    r.register("note", _Note, note)
    return r


async def test_fifo_bisection_any_hand_back_holds_back_its_group() -> None:
    """Review finding: a1 fails its handler in the first half (handed back with a backoff);
    a2, same group, in the second half must not complete ahead of it."""
    applied: list[str] = []

    class Refusing(RefusingStore):
        async def apply(self, messages: Sequence[Message], call: Any, fifo: bool = False,
                        batch: Any = None, entity_rows: Any = None,
                        time_limit: float | None = None) -> Any:
            res = await super().apply(messages, call, fifo=fifo, batch=batch,
                                      entity_rows=entity_rows, time_limit=time_limit)
            applied.extend(m.request_id for m, _ in res.completed)
            return res

    r = _failing_on_negative()
    q = FakeQueue(fifo=True)
    q.send(body("a1", -1), "A")
    hostile = q.send(body("hostile", 2), "H")
    a2 = q.send(body("a2", 3), "A")
    store = Refusing()
    store.claims = []
    h = Harness(settings(pollers=1, queue_url="http://127.0.0.1:1/q.fifo"), r, q)
    h.store = store
    h.worker = type(h.worker)(h.worker.s, q, store, r, visibility_timeout=30, rng=lambda: 0.0)
    async with h:
        await until(lambda: hostile in store.dead and (a2, 0) in q.visibility_calls, "settled")
    assert "a2" not in applied


async def test_a_refused_letter_does_not_count_a_handler_failure_twice() -> None:
    """Review finding: the poison letter is committed before the handlers run, so a letter
    the database refuses bisects the batch before any handler work is done and counted."""

    class Refusing(FakeStore):
        async def dead_letter(self, letters: Sequence[Any]) -> None:
            if any(d.reason == "invalid_json" for d in letters):
                raise DataRejected("CharacterNotInRepertoireError: invalid byte sequence")
            await super().dead_letter(letters)

    r = _failing_on_negative()
    q = FakeQueue()
    q.send(body("bad", -1))
    ok = q.send(body("ok", 1))
    poison = q.send("{not json")
    store = Refusing()
    h = Harness(settings(pollers=1, max_receive_count=5), r, q)
    h.store = store
    h.worker = type(h.worker)(h.worker.s, q, store, r, visibility_timeout=30, rng=lambda: 0.0)
    async with h:
        await until(lambda: ok not in q.messages and poison in store.dead, "settled")
    assert store.failures.get("bad") == 1, store.failures
    assert store.dead[poison].reason == "rejected_by_database"


async def test_a_message_dead_lettered_by_bisection_keeps_its_request_id() -> None:
    r = _failing_on_negative()
    q = FakeQueue()
    q.send(body("r1", 1))
    hostile = q.send(body("hostile-9", 9))
    store = RefusingStore()
    store.claims = []
    h = Harness(settings(pollers=1), r, q)
    h.store = store
    h.worker = type(h.worker)(h.worker.s, q, store, r, visibility_timeout=30, rng=lambda: 0.0)
    async with h:
        await until(lambda: not q.messages, "settled")
    d = store.dead[hostile]
    assert (d.reason, d.request_id, d.request_type) == ("rejected_by_database", "hostile-9",
                                                        "note")


# -- Bisection on its own, over a stand-in for the batch path (issue 22's survivors) ----------


class _Releases(FakeStore):
    released: list[list[str]]

    async def release(self, messages: Sequence[Message]) -> None:
        self.released.append([m.request_id for m in messages])
        await super().release(messages)


class _Executor(PlanExecutor):
    """Records hand-backs (message id, seconds) and dead letters (message id, reason)."""

    def __init__(self, store: FakeStore, limit: ReceiveLimit) -> None:
        super().__init__(FakeQueue(), store, limit)
        self.visibility: list[tuple[str, int]] = []
        self.letters: list[tuple[str, str]] = []
        self.plans: list[Plan] = []

    async def change_visibility(self, changes: Sequence[tuple[Received, int]]) -> None:
        self.visibility += [(m.message_id, seconds) for m, seconds in changes]

    async def carry_out(self, plan: Plan, flight: InFlight) -> None:
        await flight.stop_extender()
        self.plans.append(plan)
        self.letters += [(d.sqs_message_id, d.reason) for d in plan.letters]
        flight.resolve(plan.acks)


class _Part:
    """What the batch path does to a part, scripted by request_id: it claims every message
    (flight and registry, as ``BatchProcessor._process``); the claim fails (DataRejected)
    if the part holds a ``refused`` message; else a ``handed_back`` message fails its
    handler and is handed back with that backoff (its FIFO group held back), then the part
    fails (RuntimeError) if it holds a ``broken`` message, else the rest completes. A
    ``deferred`` message (request_id → its n-th part) is left out of its n-th part and
    returned for a later round, as the memory budget does."""

    def __init__(self, registry: Registry, claims: ClaimsRegistry, fifo: bool, *,
                 refused: AbstractSet[str] = frozenset(), broken: AbstractSet[str] = frozenset(),
                 handed_back: dict[str, int] | None = None,
                 deferred: dict[str, int] | None = None) -> None:
        self.registry, self.claims, self.fifo = registry, claims, fifo
        self.refused, self.broken = refused, broken
        self.handed_back = handed_back or {}
        self.deferred = deferred or {}
        self.seen: dict[str, int] = {}
        self.calls: list[tuple[list[str], bool]] = []  # (request_ids, heartbeat running)

    async def __call__(self, flight: InFlight, part: list[Received]) -> list[Received]:
        later = []
        for r in part:
            rid = r.message_id.removeprefix("m-")
            self.seen[rid] = self.seen.get(rid, 0) + 1
            if self.deferred.get(rid) == self.seen[rid]:
                later.append(r)
        part = [r for r in part if r not in later]
        messages = [parse(r, self.registry) for r in part]
        assert all(isinstance(m, Message) for m in messages)
        mine = [m for m in messages if isinstance(m, Message)]
        running = flight.extender is not None and not flight.extender.done()
        self.calls.append(([m.request_id for m in mine], running))
        for m in mine:
            self.claims.hold(m.request_id)
            flight.claimed.append(m)
        ids = {m.request_id for m in mine}
        if ids & self.refused:  # the claim statement: before any handler runs
            raise DataRejected("ProgramLimitExceededError: index row size 5016 exceeds")
        back = [(m.raw, self.handed_back[m.request_id]) for m in mine
                if m.request_id in self.handed_back]
        flight.resolve([r for r, _ in back])
        if self.fifo:
            flight.hold(back)
        if ids & self.broken:  # e.g. a later round of the part (memory budget) fails
            raise RuntimeError("a failure outside any handler")
        flight.resolve(part)
        return later


def _bisect(process: Any, fifo: bool = False, limit: ReceiveLimit | None = None,
            base_seconds: float = 2.0) -> tuple[Bisection, _Releases, _Executor]:
    store = _Releases()
    store.released = []
    limit = limit or ReceiveLimit(5, fifo)
    executor = _Executor(store, limit)
    b = Bisection(process, executor=executor, store=store, registry=process.registry,
                  policy=RetryPolicy(base_seconds=base_seconds, rng=lambda: 0.0),
                  limit=limit, fifo=fifo, claims=process.claims,
                  heartbeat=VisibilityHeartbeat(executor, 30))
    return b, store, executor


async def _settled(bisection: Bisection, batch: list[Received]) -> InFlight:
    """``settle`` over a fresh flight of ``batch``, its heartbeat stopped afterwards."""
    flight = InFlight(batch)
    try:
        await bisection.settle(flight, batch)
    finally:
        await flight.stop_extender()
    return flight


def _received(rid: str, group: str | None = None, receive_count: int = 1) -> Received:
    return Received(f"m-{rid}", f"rh-{rid}", body(rid), receive_count, group_id=group)


async def test_a_bisection_gives_back_exactly_the_claims_of_the_failed_part(
    registry: Registry,
) -> None:
    """Each failed part gives back its own claims, in the store and in the registry the
    own-leak GC spares; a half that completed before keeps its claims held."""
    claims = ClaimsRegistry()
    process = _Part(registry, claims, fifo=False, refused={"h"})
    bisection, store, executor = _bisect(process)
    batch = [_received(rid) for rid in ("r0", "r1", "r2", "h")]
    flight = InFlight(batch)
    await bisection.settle(flight, batch)
    assert executor.letters == [("m-h", "rejected_by_database")]
    # The whole batch, then the failed half (r0, r1 completed: theirs stay), then h alone.
    assert store.released == [["r0", "r1", "r2", "h"], ["r2", "h"], ["h"]]
    assert sorted(claims) == ["r0", "r1", "r2"]  # h's claims all given back, once each
    assert sorted(m.request_id for m in flight.claimed) == ["r0", "r1", "r2"]
    assert flight.unresolved == {}


async def test_fifo_a_message_handed_back_by_bisection_waits_behind_its_group(
    registry: Registry,
) -> None:
    """FIFO: a1's handler failed (handed back for 8 s) in the part where a2 then fails
    alone: a2 waits at least as long as a1, never reappears ahead of it. b, whose group
    nothing held, gets the plain hand-back delay (0 s with retry_base_seconds=0)."""
    claims = ClaimsRegistry()
    process = _Part(registry, claims, fifo=True, refused={"h"}, broken={"a2", "b"},
                    handed_back={"a1": 8})
    bisection, _, executor = _bisect(process, fifo=True, base_seconds=0)
    batch = [_received("a1", "A"), _received("a2", "A"), _received("h", "H"),
             _received("b", "B")]
    flight = await _settled(bisection, batch)
    assert executor.letters == [("m-h", "rejected_by_database")]
    assert executor.visibility == [("m-a2", 8), ("m-b", 0)]
    assert flight.held_groups == {"A": 8, "B": 0}
    assert flight.unresolved == {}


async def test_a_failure_on_the_last_receive_sqs_allows_is_bisected_and_dead_lettered(
    registry: Registry,
) -> None:
    """A queue whose RedrivePolicy moves a message after 3 receives: on its 3rd, a message
    whose part fails outside any handler (far from the repeat-offender net, 15 receives) is
    found alone and dead-lettered by the daemon before SQS moves it; its neighbour goes on."""
    limit = ReceiveLimit(5)
    limit.policy = RedrivePolicy("arn:aws:sqs:us-east-1:000000000000:dlq", 3)
    claims = ClaimsRegistry()
    process = _Part(registry, claims, fifo=False, broken={"x"})
    bisection, _, executor = _bisect(process, limit=limit)
    batch = [_received("r0"), _received("x", receive_count=3)]
    flight = await _settled(bisection, batch)
    assert executor.letters == [("m-x", "processing_error")]
    assert process.calls[1:] == [(["r0"], True), (["x"], True)]  # the halves
    assert executor.visibility == [] and flight.unresolved == {}


async def test_a_later_round_of_a_bisected_half_is_still_bisected(registry: Registry) -> None:
    """A half of a bisection leaves x to a later round (the memory budget), where x fails
    outside any handler on its first receive: that round is still the bisection's, so x,
    alone, is handed back on its own — not raised out of the batch it came with."""
    claims = ClaimsRegistry()
    process = _Part(registry, claims, fifo=False, refused={"h"}, broken={"x"},
                    deferred={"x": 2})
    bisection, _, executor = _bisect(process)
    batch = [_received(rid) for rid in ("a", "h", "b", "x")]
    flight = await _settled(bisection, batch)
    assert process.calls[-2:] == [(["b"], True), (["x"], True)]  # the half, its later round
    assert executor.letters == [("m-h", "rejected_by_database")]
    assert [mid for mid, _ in executor.visibility] == ["m-x"]
    assert flight.unresolved == {}


async def test_fifo_the_rest_of_a_part_runs_under_the_heartbeat_while_its_group_waits(
    registry: Registry,
) -> None:
    """a2 is held back behind a1 (handed back in the first half): its visibility is set to
    a1's delay, which stops the heartbeat; c, the rest of that half, is still processed and
    must stay hidden meanwhile, so the heartbeat runs again before it is."""
    claims = ClaimsRegistry()
    process = _Part(registry, claims, fifo=True, refused={"h"}, handed_back={"a1": 8})
    bisection, _, executor = _bisect(process, fifo=True)
    batch = [_received("a1", "A"), _received("h", "H"), _received("a2", "A"),
             _received("c", "C")]
    flight = await _settled(bisection, batch)
    assert executor.letters == [("m-h", "rejected_by_database")]
    assert ("m-a2", 8) in executor.visibility
    assert process.calls[-1] == (["c"], True)  # a2 held back, c under the heartbeat
    assert flight.unresolved == {}


class _RefusesBody:
    """A part whose statement the database refuses while it holds the message with body
    ``refused`` (e.g. that message's own dead letter, written in the part's transaction);
    any other part completes."""

    def __init__(self, registry: Registry, refused: str) -> None:
        self.registry, self.claims, self.refused = registry, ClaimsRegistry(), refused

    async def __call__(self, flight: InFlight, part: list[Received]) -> list[Received]:
        if any(r.body == self.refused for r in part):
            raise DataRejected("CharacterNotInRepertoireError: invalid byte sequence")
        flight.resolve(part)
        return []


async def test_a_message_that_does_not_parse_blamed_by_bisection_is_dead_lettered_whole(
    registry: Registry,
) -> None:
    """Bisection finds a message whose body is not an envelope at all (no request_id, no
    type): its dead letter is acked for that very message, counted under the label for
    invalid types, and keeps the database's error text; its neighbour completes."""
    bad = "\u00ff not an envelope {"
    process = _RefusesBody(registry, bad)
    bisection, _, executor = _bisect(process)
    junk = Received("m-junk", "rh-junk", bad, 1)
    flight = await _settled(bisection, [_received("r0"), junk])
    assert executor.letters == [("m-junk", "rejected_by_database")]
    [plan] = executor.plans
    assert plan.acks == [junk]
    assert plan.outcomes == [(INVALID_TYPE_LABEL, "dead_lettered")]
    [letter] = plan.letters
    assert (letter.body, letter.request_id, letter.request_type) == (bad, None, None)
    assert letter.error == "DataRejected: CharacterNotInRepertoireError: invalid byte sequence"
    assert flight.unresolved == {}


class _FailsAfterTheClaim(FakeStore):
    """A store with a bug in its commit path (after the claims are made); records which
    claims were still held each time the queue was asked to change a visibility."""

    async def apply(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the commit path")


class _Watching(FakeQueue):
    def __init__(self, store: FakeStore) -> None:
        super().__init__()
        self.store = store
        self.held_then: list[list[str]] = []

    async def change_visibility_batch(self, changes: Sequence[tuple[Received, int]]) -> list[str]:
        self.held_then.append(sorted(self.store.rows))
        return await super().change_visibility_batch(changes)


async def test_a_failed_batch_releases_its_claims_before_its_messages_come_back(
    registry: Registry,
) -> None:
    """A batch that fails after its claims were made (the database up): the claims are
    released first, so a redelivery finds nothing held — not left for a later sweep."""
    store = _FailsAfterTheClaim()
    q = _Watching(store)
    ids = [q.send(body(f"r{i}", i)) for i in range(3)]
    async with _harness(registry, q, store):
        await until(lambda: len(q.visibility_calls) >= 3, "the batch handed back")
        assert store.rows == {} and store.dead == {}  # before the stop's own clean-up
    assert sorted(m for m, _ in q.visibility_calls[:3]) == sorted(ids)
    assert q.held_then[0] == []  # no claim still held when the messages came back


async def test_a_batch_failed_by_a_bug_is_handed_back_as_is_even_near_the_redrive_limit(
    registry: Registry,
) -> None:
    """A failed batch is the messages' own business (not an outage, not a shutdown): handed
    back plainly, counting toward the queue's maxReceiveCount — no fresh copy, though on
    this receive (3rd of 5, retry limit 3) a deferral would have requeued one."""
    store = _FailsAfterTheClaim()
    q = FakeQueue()
    q.max_receive_count = 5
    mid = q.send(body("r0", 1))
    q.messages[mid].receive_count = 2
    async with _harness(registry, q, store) as h:
        await until(lambda: bool(q.visibility_calls or q.requeued), "handed back")
        assert h.worker.limit.must_requeue(3)  # the queue's policy was known: a deferral
        # Now: once the hand-back delay is over the message may be received again (and
        # a poll in flight at the stop hands it back as a deferral, a fresh copy).
        assert [m for m, _ in q.visibility_calls] == [mid] and q.requeued == []

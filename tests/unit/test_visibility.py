"""The visibility heartbeat (service.runtime.visibility) on a virtual clock: every half timeout the
batch's unresolved messages are hidden for another full one, and never asked past SQS's
12-hour cap, which counts from the receive and rejects (does not trim) a change past it.
No real sleep: the clock's ``sleep`` advances it and only yields."""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from service.core.messages import Received
from service.core.retry import ReceiveLimit
from service.runtime.executor import InFlight, PlanExecutor
from service.runtime.visibility import CAP_MARGIN, VisibilityHeartbeat, extension
from service.settings import SQS_MAX_VISIBILITY
from service.testing.fakes import FakeQueue

EXT = "sqs_ingest_visibility_extensions_total"
ERR = "sqs_ingest_sqs_errors_total"


def sample(name: str, **labels: str) -> float:
    from service.observe import metrics

    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


class Clock:
    """Virtual monotonic time; a heartbeat that never stops fails on ``max_sleeps``."""

    def __init__(self, max_sleeps: int, start: float = 0.0) -> None:
        self.now = start
        self.max_sleeps = max_sleeps
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        assert len(self.slept) <= self.max_sleeps, "the heartbeat did not stop"
        self.now += seconds
        await asyncio.sleep(0)


class Sqs:
    """ChangeMessageVisibility as SQS answers it: each call takes ``latency`` seconds and
    hides a message from its arrival; one that would end more than 12 hours after the
    receive (``received``, on the clock: before the batch started) is rejected."""

    def __init__(self, clock: Clock, vt: int, flight: InFlight, latency: float = 0.0,
                 received: float = 0.0, steps: Sequence[Callable[[], None]] = ()) -> None:
        self.clock, self.latency, self.received, self.steps = clock, latency, received, steps
        self.visible_at = {m: received + vt for m in flight.unresolved}
        self.calls: list[tuple[float, list[tuple[str, int]]]] = []
        self.rejected: list[tuple[float, str, int]] = []
        self.late: list[tuple[float, str]] = []  # extended after it was visible again

    async def change_visibility(self, changes: Sequence[tuple[Received, int]]) -> None:
        self.clock.now += self.latency
        t = self.clock.now
        self.calls.append((t, [(m.message_id, s) for m, s in changes]))
        for m, s in changes:
            if t > self.visible_at[m.message_id]:
                self.late.append((t, m.message_id))
            if t + s - self.received > SQS_MAX_VISIBILITY:
                self.rejected.append((t, m.message_id, s))
            else:
                self.visible_at[m.message_id] = t + s
        if len(self.calls) <= len(self.steps):
            self.steps[len(self.calls) - 1]()


def flight_of(n: int) -> InFlight:
    return InFlight([Received(f"m{i}", f"rh{i}", "{}") for i in range(n)])


@pytest.mark.parametrize("linger", [0.0, None])
async def test_every_half_timeout_each_unresolved_message_is_hidden_for_a_full_one(
        linger: float | None) -> None:
    """vt odd: the ticks are vt / 2 and the messages stay hidden until the last call + vt
    (the count of vt // 2 per tick this replaces lost half a second a tick). With the
    default linger (vt / 10) the heartbeat wakes 3.1 s early and waits for other batches'
    extensions until then: alone, its calls go at the same times."""
    vt, clock, flight = 31, Clock(10), flight_of(2)
    m0, m1 = flight.unresolved
    sqs = Sqs(clock, vt, flight, steps=[lambda: flight.resolve(flight.batch[:1]),
                                        lambda: flight.resolve(flight.batch)])
    before = sample(EXT)
    hb = VisibilityHeartbeat(sqs, vt, clock=clock, sleep=clock.sleep,  # type: ignore[arg-type]
                             linger=linger)
    hb.ensure(flight)
    assert flight.extender is not None
    await asyncio.wait_for(flight.extender, 5)
    if linger == 0:
        assert clock.slept == [15.5, 15.5, 15.5]
    else:
        # Woken 3.1 s early, then the linger's 3.1 s; the last tick finds it resolved.
        assert clock.slept == pytest.approx([12.4, 3.1, 12.4, 3.1, 12.4])
    assert sqs.calls == [(15.5, [(m0, 31), (m1, 31)]), (31.0, [(m1, 31)])]
    # Counted from the ask (at the start of the linger): hidden at least that long.
    assert (flight.received_at, flight.hidden_until) == pytest.approx(
        (0.0, 62.0 if linger == 0 else 58.9))
    assert sample(EXT) - before == 3


@pytest.mark.parametrize("linger", [0.0, None])
@pytest.mark.parametrize("vt", [2, 3, 31, 20_000, SQS_MAX_VISIBILITY])
async def test_a_batch_that_runs_for_ever_is_kept_hidden_up_to_the_cap_and_never_past_it(
        vt: int, linger: float | None) -> None:
    """A batch that never finishes (a hung handler with INGEST_HANDLER_TIMEOUT=0), calls
    that take 50 ms, and a batch that starts 0.2 s after SQS's receive: no change is asked
    past 12 hours after the receive (SQS rejects it: before, a tick count that fell behind
    the clock sent thousands of rejected calls at vt 2 and 3); none comes after the message
    was visible again; the message stays hidden to within CAP_MARGIN of the cap (before,
    at vt 20,000 it was visible again at 30,000 s); and the heartbeat then returns at its
    next tick. With the default linger too: woken early, the change still asks nothing past
    the cap when it goes at the end of the linger."""
    # A monotonic clock that is not at 0 when the batch starts (elapsed = now - start).
    start = 5_000.0
    clock = Clock(max_sleeps=4 * SQS_MAX_VISIBILITY // vt + 10, start=start)
    flight = flight_of(1)
    sqs = Sqs(clock, vt, flight, latency=0.05, received=start - 0.2)
    hb = VisibilityHeartbeat(sqs, vt, clock=clock, sleep=clock.sleep,  # type: ignore[arg-type]
                             linger=linger)
    hb.ensure(flight)
    assert flight.extender is not None
    await asyncio.wait_for(flight.extender, 60)
    assert sqs.rejected == []
    assert sqs.late == []
    hidden = sqs.visible_at["m0"] - sqs.received
    assert SQS_MAX_VISIBILITY - CAP_MARGIN - 1 <= hidden <= SQS_MAX_VISIBILITY
    # It returned at its first tick after the last extension (a tick per call, one more;
    # with a linger, each call's tick is two sleeps: the wake-up and the linger).
    assert len(clock.slept) == (1 if linger == 0 else 2) * len(sqs.calls) + 1
    assert flight.unresolved  # it stopped at the cap, not because the batch ended
    if vt == SQS_MAX_VISIBILITY:
        assert sqs.calls == []  # the receive hid it to the cap: a change could only shorten it


def test_extension_is_a_full_timeout_until_the_cap_then_what_is_left_then_nothing() -> None:
    cap = SQS_MAX_VISIBILITY - CAP_MARGIN
    assert extension(30, 15.0, 30.0) == 30
    assert extension(30, cap - 20.5, cap - 5) == 20  # what is left, whole seconds
    assert extension(30, cap - 10, cap) == 0  # would not hide it longer than it is
    assert extension(30, cap + 1, cap) == 0
    # A timeout of the whole 12 hours: the receive already hid it to the cap; a change
    # would only shorten it.
    assert extension(SQS_MAX_VISIBILITY, SQS_MAX_VISIBILITY / 2, SQS_MAX_VISIBILITY) == 0


@pytest.mark.parametrize("vt", [0, 1])
def test_a_timeout_under_two_seconds_is_refused(vt: int) -> None:
    """vt / 2 under a second is no heartbeat (at 0, a loop of calls that never sleeps);
    INGEST_VISIBILITY_TIMEOUT refuses it (exit 2) and a queue's own is replaced by 30."""
    with pytest.raises(ValueError, match="visibility timeout"):
        VisibilityHeartbeat(object(), vt)  # type: ignore[arg-type]


async def test_a_restarted_heartbeat_keeps_the_receive_time() -> None:
    """A bisection stops the heartbeat before a half's acks and starts it again: the cap
    still counts from the batch's start, not from the restart."""
    vt, clock, flight = 30, Clock(10), flight_of(1)
    sqs = Sqs(clock, vt, flight)
    hb = VisibilityHeartbeat(sqs, vt, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    hb.ensure(flight)
    await flight.stop_extender()
    clock.now = SQS_MAX_VISIBILITY - CAP_MARGIN - 20  # the first half ran for nearly 12 h
    flight.hidden_until = clock.now + 10
    hb.ensure(flight)
    assert flight.extender is not None
    await asyncio.wait_for(flight.extender, 5)
    assert flight.received_at == 0.0
    # 10 s of cover left, under half a timeout: extended at once, to the cap (less the margin).
    assert sqs.calls == [(SQS_MAX_VISIBILITY - CAP_MARGIN - 20, [("m0", 20)])]


@pytest.mark.parametrize(("cover", "first_call"), [(25.0, 1010.0), (10.0, 1000.0), (40.0, 1015.0)])
async def test_a_restarted_heartbeat_extends_when_half_a_timeout_of_cover_is_left(
        cover: float, first_call: float) -> None:
    """Restarted at 1,000 s with ``cover`` seconds of hiding left: the next extension comes
    when 15 s (half the timeout) are left — at once if fewer are — never later than half a
    timeout after the restart; before, always half a timeout after it, by when a restart
    late in a cycle had let the cover run out."""
    vt, clock, flight = 30, Clock(10), flight_of(1)
    sqs = Sqs(clock, vt, flight, steps=[lambda: flight.resolve(flight.batch)])
    hb = VisibilityHeartbeat(sqs, vt, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    hb.ensure(flight)
    await flight.stop_extender()
    clock.now = 1000.0
    flight.hidden_until = clock.now + cover
    hb.ensure(flight)
    assert flight.extender is not None
    await asyncio.wait_for(flight.extender, 5)
    assert sqs.calls == [(first_call, [("m0", 30)])]


async def test_the_last_second_before_the_cap_is_still_asked_for() -> None:
    """One second left under the cap (less CAP_MARGIN) at a tick, and the messages hidden
    for less than that: a change of one second, then nothing more."""
    vt, clock, flight = 30, Clock(10), flight_of(1)
    sqs = Sqs(clock, vt, flight)
    hb = VisibilityHeartbeat(sqs, vt, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    hb.ensure(flight)
    await flight.stop_extender()
    clock.now = SQS_MAX_VISIBILITY - CAP_MARGIN - 1.5  # 1.5 s left: a whole second to ask
    flight.hidden_until = clock.now + 0.2
    hb.ensure(flight)
    assert flight.extender is not None
    await asyncio.wait_for(flight.extender, 5)
    assert sqs.calls == [(SQS_MAX_VISIBILITY - CAP_MARGIN - 1.5, [("m0", 1)])]


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to its next timer whenever nothing is ready: the
    heartbeats of many batches (and the linger's timer) share one virtual timeline, and
    nothing really sleeps."""

    def __init__(self) -> None:
        self.now = 1_000.0
        super().__init__(_Jump(self))

    def time(self) -> float:
        return self.now


class _Jump(selectors.DefaultSelector):
    def __init__(self, loop: VirtualTimeLoop) -> None:
        super().__init__()
        self.loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if not ready and timeout:
            self.loop.now += timeout
        return ready


class CountingQueue(FakeQueue):
    """The fake queue, each ChangeMessageVisibilityBatch request recorded with its time."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[float, list[str]]] = []

    async def change_visibility_batch(self, changes: Sequence[tuple[Received, int]]) -> list[str]:
        self.requests.append((asyncio.get_running_loop().time(),
                              [m.message_id for m, _ in changes]))
        return await super().change_visibility_batch(changes)


SIZES = [1, 2, 3, 1, 2, 3, 2]  # seven batches, 14 messages


def run_concurrent_batches(broken: tuple[int, int] | None = None) -> tuple[
        CountingQueue, list[tuple[float, list[str]]], float]:
    """The seven batches start 0.4 s apart (vt 30, default linger 3 s) and run for 40 s:
    two rounds of extensions each. ``broken``: (batch, message) of a message whose receipt
    handle SQS no longer knows (it was received again elsewhere). Returns the queue, each
    batch's start and message ids, and how many change_visibility errors were counted."""

    async def scenario() -> tuple[list[tuple[float, list[str]]], float]:
        loop = asyncio.get_running_loop()
        queue = CountingQueue()
        for i in range(sum(SIZES)):
            queue.send(f'{{"n": {i}}}')
        executor = PlanExecutor(queue, None, ReceiveLimit(5))  # type: ignore[arg-type]
        hb = VisibilityHeartbeat(executor, 30, clock=loop.time, sleep=asyncio.sleep)
        flights, started = [], []
        for n in SIZES:
            flight = InFlight(await queue.receive(n, 0, 30))
            hb.ensure(flight)
            flights.append(flight)
            started.append((loop.time(), list(flight.unresolved)))
            await asyncio.sleep(0.4)
        if broken is not None:
            batch, message = broken
            queue.messages[started[batch][1][message]].receipt = "received-again-elsewhere"
        errors = sample(ERR, operation="change_visibility")
        await asyncio.sleep(40 - 0.4 * len(SIZES))
        for flight in flights:
            await flight.stop_extender()
        holder.append(queue)
        return started, sample(ERR, operation="change_visibility") - errors

    holder: list[CountingQueue] = []
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        started, errors = runner.run(scenario())
    return holder[0], started, errors


def test_concurrent_batches_due_together_share_ceil_entries_over_ten_requests() -> None:
    """Seven small batches (14 messages) received within 2.4 s of one another, handlers
    still running after 40 s: each round of extensions takes ceil(14 / 10) = 2
    ChangeMessageVisibilityBatch requests, 4 in all (before: one per batch and round, 14),
    none of more than ten entries; and no message is extended later than it was alone —
    the first time within half a timeout of its batch's start, then within half a timeout
    of its previous extension."""
    queue, started, _ = run_concurrent_batches()
    assert len(queue.requests) == 2 * math.ceil(sum(SIZES) / 10) == 4
    assert all(len(ids) <= 10 for _, ids in queue.requests)
    for start, ids in started:
        for mid in ids:
            times = [t for t, req in queue.requests if mid in req]
            assert len(times) == 2  # both rounds
            assert times[0] <= start + 15
            assert times[1] <= times[0] + 15


def test_a_failed_entry_in_a_shared_request_fails_only_its_message() -> None:
    """A message SQS answers ``ReceiptHandleIsInvalid`` for (received again elsewhere), in a
    request shared with other batches' messages: it is logged and counted as a failed
    change (sqs_ingest_sqs_errors_total{operation="change_visibility"}) each round, as
    when its batch's extension went alone; the other messages are extended, and its own
    batch's heartbeat goes on."""
    queue, started, errors = run_concurrent_batches(broken=(2, 1))
    victim = started[2][1][1]  # a message of the third batch (three messages)
    assert errors == 2  # one failed entry per round
    extended = [mid for mid, _ in queue.visibility_calls]
    assert victim not in extended
    for _, ids in started:
        for mid in ids:
            assert extended.count(mid) == (0 if mid == victim else 2)


def test_a_batch_that_finishes_while_its_extension_lingers_sends_none_after() -> None:
    """Two batches 2 s apart (vt 30, linger 3 s): the first's extension waits for the
    second's; the first finishes meanwhile (stop_extender, before its acks or releases).
    Its extension never goes out — it would hide a released message again — and the
    second's goes when due, alone."""

    async def scenario() -> tuple[list[tuple[float, list[str]]], list[str], list[str], float]:
        loop = asyncio.get_running_loop()
        queue = CountingQueue()
        for i in range(3):
            queue.send(f'{{"n": {i}}}')
        executor = PlanExecutor(queue, None, ReceiveLimit(5))  # type: ignore[arg-type]
        hb = VisibilityHeartbeat(executor, 30, clock=loop.time, sleep=asyncio.sleep)
        first = InFlight(await queue.receive(2, 0, 30))
        hb.ensure(first)
        await asyncio.sleep(2)
        second = InFlight(await queue.receive(1, 0, 30))
        second_start = loop.time()
        hb.ensure(second)
        await asyncio.sleep(12.5)  # 14.5 s: the first woke at 12 and waits until 15
        await first.stop_extender()
        await asyncio.sleep(10)
        await second.stop_extender()
        return queue.requests, list(first.unresolved), list(second.unresolved), second_start

    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        requests, _, second, start = runner.run(scenario())
    assert [ids for _, ids in requests] == [second]
    assert requests[0][0] == start + 15


async def test_a_batch_of_ten_or_more_is_extended_alone_when_due() -> None:
    """Ten unresolved messages fill a request: no early wake-up, no linger — the call goes
    when due, as without a linger."""
    vt, clock, flight = 30, Clock(10), flight_of(10)
    sqs = Sqs(clock, vt, flight, steps=[lambda: flight.resolve(flight.batch)])
    hb = VisibilityHeartbeat(sqs, vt, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    assert hb.linger == 3.0
    hb.ensure(flight)
    assert flight.extender is not None
    await asyncio.wait_for(flight.extender, 5)
    assert clock.slept == [15.0, 12.0]  # the next wake-up (early: none left) ends it
    assert [t for t, _ in sqs.calls] == [15.0]


@pytest.mark.parametrize(("linger", "kept"), [(None, 3.0), (5.0, 5.0), (20.0, 7.5)])
def test_the_linger_is_a_tenth_of_the_timeout_and_at_most_a_quarter(
        linger: float | None, kept: float) -> None:
    """Past a quarter timeout, a batch woken that early would be extended again less than
    a quarter timeout after its previous extension."""
    executor = SimpleNamespace(change_visibility=None)
    assert VisibilityHeartbeat(executor, 30, linger=linger).linger == kept  # type: ignore[arg-type]

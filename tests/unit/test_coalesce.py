"""DeleteCoalescer: small batches' deletes share one DeleteMessageBatch within the linger,
and each caller is answered about its own messages only (a failed ack still stops the
daemon: exit 3 for the batch whose message failed)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from service.adapters.coalesce import DeleteCoalescer, ExtensionCoalescer
from service.core.messages import Received
from service.errors import AckFailed


def msgs(prefix: str, n: int) -> list[Received]:
    return [Received(f"{prefix}{i}", f"h-{prefix}{i}", "{}") for i in range(n)]


class Deletes:
    def __init__(self, fail: set[str] | None = None, down: bool = False) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail or set()
        self.down = down

    async def __call__(self, messages: Sequence[Received]) -> None:
        ids = [m.message_id for m in messages]
        self.calls.append(ids)
        await asyncio.sleep(0)
        if self.down:
            raise AckFailed(ids, "connection reset")
        bad = [i for i in ids if i in self.fail]
        if bad:
            raise AckFailed(bad, "ReceiptHandleIsInvalid")


async def test_small_batches_within_the_linger_share_one_call() -> None:
    d = Deletes()
    c = DeleteCoalescer(d, linger=0.05)
    await asyncio.gather(c.delete_batch(msgs("a", 2)), c.delete_batch(msgs("b", 3)))
    assert d.calls == [["a0", "a1", "b0", "b1", "b2"]]


async def test_ten_entries_go_at_once_ten_a_call_and_the_rest_lingers() -> None:
    """Twelve entries waiting: a call of ten at once (a caller's entries split between two
    calls if need be), the last two with what comes within their linger — ceil(N / 10)
    calls, not one per caller whose entries fit whole (before: 8, then 4)."""
    d = Deletes()
    c = DeleteCoalescer(d, linger=30)  # a call that waited for the timer would hang
    a, b, rest = (asyncio.create_task(c.delete_batch(msgs(p, 4))) for p in "abc")
    await asyncio.wait_for(asyncio.gather(a, b), 5)
    assert d.calls == [[*(f"a{i}" for i in range(4)), *(f"b{i}" for i in range(4)), "c0", "c1"]]
    assert not rest.done()  # two of its entries still linger
    await asyncio.wait_for(c.drain(), 5)
    await rest
    assert d.calls[1:] == [["c2", "c3"]]


async def test_a_caller_split_between_two_calls_hears_of_failures_in_both() -> None:
    d = Deletes(fail={"c0", "c3"})
    c = DeleteCoalescer(d, linger=30)
    tasks = [asyncio.create_task(c.delete_batch(msgs(p, 4))) for p in "abc"]
    await asyncio.sleep(0)
    await asyncio.wait_for(c.drain(), 5)
    out = await asyncio.gather(*tasks, return_exceptions=True)
    assert out[:2] == [None, None]
    assert isinstance(out[2], AckFailed) and out[2].message_ids == ["c0", "c3"]


async def test_a_full_batch_is_deleted_directly() -> None:
    d = Deletes()
    c = DeleteCoalescer(d, linger=30)
    await asyncio.wait_for(c.delete_batch(msgs("a", 10)), 5)
    assert d.calls == [[f"a{i}" for i in range(10)]]


async def test_each_caller_is_told_only_of_its_own_failed_messages() -> None:
    d = Deletes(fail={"b1"})
    c = DeleteCoalescer(d, linger=0.05)
    ok, failed = await asyncio.gather(c.delete_batch(msgs("a", 2)), c.delete_batch(msgs("b", 2)),
                                      return_exceptions=True)
    assert ok is None
    assert isinstance(failed, AckFailed) and failed.message_ids == ["b1"]


async def test_a_failed_call_fails_every_caller_in_it() -> None:
    c = DeleteCoalescer(Deletes(down=True), linger=0.05)
    out = await asyncio.gather(c.delete_batch(msgs("a", 1)), c.delete_batch(msgs("b", 1)),
                               return_exceptions=True)
    assert [type(o) for o in out] == [AckFailed, AckFailed]
    assert [o.message_ids for o in out] == [["a0"], ["b0"]]  # type: ignore[union-attr]


async def test_a_cancelled_caller_s_committed_messages_are_still_deleted() -> None:
    d = Deletes()
    c = DeleteCoalescer(d, linger=0.05)
    task = asyncio.create_task(c.delete_batch(msgs("a", 1)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await c.delete_batch(msgs("b", 1))
    assert d.calls == [["a0", "b0"]]


async def test_no_linger_deletes_each_batch_at_once() -> None:
    d = Deletes()
    c = DeleteCoalescer(d, linger=0)
    await c.delete_batch(msgs("a", 1))
    await c.delete_batch(msgs("b", 1))
    assert d.calls == [["a0"], ["b0"]]


async def test_drain_sends_what_lingers() -> None:
    d = Deletes()
    c = DeleteCoalescer(d, linger=30)
    task = asyncio.create_task(c.delete_batch(msgs("a", 1)))
    await asyncio.sleep(0)
    await asyncio.wait_for(c.drain(), 5)
    await task
    assert d.calls == [["a0"]]


async def test_a_failure_nobody_awaits_any_more_is_reported_not_swallowed() -> None:
    """A batch cancelled at the shutdown deadline while its delete lingers: the delete
    still goes out, and its failure still reaches the daemon (exit 3), never a silent 0."""
    reported: list[AckFailed] = []
    c = DeleteCoalescer(Deletes(fail={"a0"}), linger=0.05)
    c.on_unawaited_failure = reported.append
    task = asyncio.create_task(c.delete_batch(msgs("a", 1)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(c.drain(), 5)
    await asyncio.sleep(0)
    assert [r.message_ids for r in reported] == [["a0"]]


async def test_a_call_torn_down_before_sqs_answered_is_an_ack_failure() -> None:
    started = asyncio.Event()

    async def hangs(messages: Sequence[Received]) -> None:
        started.set()
        await asyncio.Event().wait()

    c = DeleteCoalescer(hangs, linger=0.01)
    caller = asyncio.create_task(c.delete_batch(msgs("a", 2)))
    await asyncio.wait_for(started.wait(), 5)
    for t in list(c._sending):
        t.cancel()
    with pytest.raises(AckFailed) as failed:
        await asyncio.wait_for(caller, 5)
    assert failed.value.message_ids == ["a0", "a1"]


class Changes:
    """ChangeMessageVisibilityBatch behind the executor: records the calls; ``hold`` keeps
    a call unanswered until it is set."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.answered: list[list[str]] = []
        self.hold: asyncio.Event | None = None

    async def __call__(self, changes: Sequence[tuple[Received, int]]) -> None:
        ids = [m.message_id for m, _ in changes]
        self.calls.append(ids)
        if self.hold is not None:
            await self.hold.wait()
        self.answered.append(ids)


def changes(prefix: str, n: int) -> list[tuple[Received, int]]:
    return [(m, 30) for m in msgs(prefix, n)]


async def test_an_extension_whose_caller_stopped_while_it_lingers_is_taken_back() -> None:
    """A batch stops its heartbeat before its acks and releases: an extension of its that
    still lingers must not go out after them (it would hide a released message again)."""
    ch = Changes()
    c = ExtensionCoalescer(ch, linger=30)
    task = asyncio.create_task(c.submit(changes("a", 2)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(c.submit(changes("b", 1), linger=0.01), 5)
    await asyncio.wait_for(c.drain(), 5)
    assert ch.calls == [["b0"]]


async def test_an_extension_caller_stopped_while_its_call_is_out_waits_for_the_answer() -> None:
    ch = Changes()
    ch.hold = asyncio.Event()
    c = ExtensionCoalescer(ch, linger=0.01)
    task = asyncio.create_task(c.submit(changes("a", 2)))
    while not ch.calls:
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()  # still waiting for SQS's answer to the call its entries are in
    ch.hold.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert ch.answered == [["a0", "a1"]]

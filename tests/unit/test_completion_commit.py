"""The completing transaction's attempt loop (``service.adapters.completion``) when the COMMIT itself
raises, on a fake of its transaction seam: a conflict is rerun, anything else is split until
the message it belongs to is alone; on FIFO the later messages of that message's group are
held back, those of other groups complete."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from pydantic import BaseModel

from service.adapters import completion
from service.core.messages import Message, Received, payload_hash
from service.core.seams import ApplyResult
from service.errors import DatabaseUnavailable


class P(BaseModel):
    n: int = 0


class Conflict(Exception):
    """The fake's serialization failure."""


class Deferred(Exception):
    """The fake's deferred constraint violation, raised by COMMIT."""


def message(rid: str, group: str | None = None) -> Message:
    return Message(Received("m-" + rid, "rh", "{}", 1, group_id=group), rid, "t", P(), {},
                   payload_hash({}))


Refuse = Callable[[list[str]], Exception | None]


class Txns:
    """``completion.Transactions``: every claim is held; ``refuse`` says what the COMMIT of
    an attempt that completed these request_ids raises, if anything."""

    conn: Any = None

    def __init__(self, refuse: Refuse) -> None:
        self.refuse = refuse
        self.pending: list[str] = []
        self.commits: list[tuple[list[str], bool]] = []  # (completed, committed)
        self.guards = 0

    def attempt(self) -> Attempt:
        return Attempt(self)

    async def is_outage(self, exc: BaseException) -> bool:
        return False

    def is_conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, Conflict)

    def is_aborted(self, exc: BaseException) -> bool:
        return False

    def ended(self) -> str | None:
        return None

    async def probe(self) -> None:
        return None

    async def fence(self, request_ids: Sequence[str]) -> set[str]:
        return set(request_ids)

    async def guard_commit(self) -> None:
        self.guards += 1

    async def complete(self, live: Sequence[Message], outputs: Sequence[str | None]) -> int:
        self.pending = [m.request_id for m in live]
        return len(live)

    async def clear_failures(self, request_ids: Sequence[str]) -> None:
        return None

    def committed(self) -> list[str]:
        return [r for done, ok in self.commits if ok for r in done]


class Attempt:
    def __init__(self, txns: Txns) -> None:
        self.txns = txns

    async def __aenter__(self) -> Txns:
        self.txns.pending = []
        return self.txns

    async def __aexit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            err = self.txns.refuse(self.txns.pending)
            self.txns.commits.append((self.txns.pending, err is None))
            if err is not None:
                raise err


async def ok(m: Message, _conn: Any) -> dict[str, Any]:
    return {"rid": m.request_id}


async def run(txns: Txns, ms: list[Message], fifo: bool = False) -> ApplyResult:
    return await completion.complete(txns, ms, ok, fifo)


def ids(ms: Sequence[Message]) -> list[str]:
    return [m.request_id for m in ms]


async def test_a_conflict_at_commit_is_rerun_as_is() -> None:
    conflicts = [Conflict("40001"), Conflict("40001")]
    txns = Txns(lambda done: conflicts.pop() if conflicts else None)
    res = await run(txns, [message("a"), message("b")])
    assert [ok for _, ok in txns.commits] == [False, False, True]
    assert ids([m for m, _ in res.completed]) == ["a", "b"] and not res.failed
    assert res.committed_at > 0 and txns.guards == 3


async def test_a_deferred_constraint_at_commit_fails_only_its_message() -> None:
    txns = Txns(lambda done: Deferred("23503") if "c" in done else None)
    ms = [message(r) for r in "abcde"]
    res = await run(txns, ms)
    assert ids([m for m, _ in res.completed]) == ["a", "b", "d", "e"]
    assert [(m.request_id, type(e)) for m, e in res.failed] == [("c", Deferred)]
    assert sorted(txns.committed()) == ["a", "b", "d", "e"]
    assert not res.blocked and not res.lost


async def test_a_conflict_that_keeps_coming_at_commit_ends_as_one_messages_failure() -> None:
    """Reruns as is, then split; alone, after its own reruns, the message fails: the loop
    always ends."""
    txns = Txns(lambda done: Conflict("40P01") if "b" in done else None)
    res = await run(txns, [message("a"), message("b")])
    assert ids([m for m, _ in res.completed]) == ["a"]
    assert [m.request_id for m, _ in res.failed] == ["b"]
    assert len([c for c in txns.commits if "b" in c[0]]) == 2 * (completion.MAX_RERUNS + 1)


async def test_on_fifo_a_split_holds_back_the_group_behind_the_failed_message() -> None:
    txns = Txns(lambda done: Deferred("23505") if "g1-a" in done else None)
    ms = [message("g1-a", "g1"), message("g2-a", "g2"), message("g1-b", "g1"),
          message("g2-b", "g2")]
    res = await run(txns, ms, fifo=True)
    assert [m.request_id for m, _ in res.failed] == ["g1-a"]
    assert ids(res.blocked) == ["g1-b"]
    assert ids([m for m, _ in res.completed]) == ["g2-a", "g2-b"]
    assert "g1-b" not in txns.committed()


async def test_an_outage_at_commit_is_an_outage() -> None:
    txns = Txns(lambda done: DatabaseUnavailable("the database went away at COMMIT"))
    with pytest.raises(DatabaseUnavailable):
        await run(txns, [message("a"), message("b")])
    assert len(txns.commits) == 1  # neither rerun nor split


async def test_an_error_before_the_commit_is_not_taken_for_one_at_commit() -> None:
    class Broken(Txns):
        async def complete(self, live: Sequence[Message], outputs: Sequence[str | None]) -> int:
            raise RuntimeError("the completing statement failed")

    txns = Broken(lambda done: None)
    with pytest.raises(RuntimeError, match="completing statement"):
        await run(txns, [message("a"), message("b")])
    assert txns.commits == []


async def test_on_fifo_a_group_split_across_halves_stays_in_order() -> None:
    """The failed head's follower in its own half is blocked (not completed before it);
    so is one in the other half; a half left empty by that ends the split cleanly."""
    txns = Txns(lambda done: Deferred("23503") if "g1-a" in done else None)
    res = await run(txns, [message("g1-a", "g1"), message("g1-b", "g1"), message("g2-a", "g2"),
                           message("g2-b", "g2")], fifo=True)
    assert [m.request_id for m, _ in res.failed] == ["g1-a"]
    assert ids(res.blocked) == ["g1-b"]
    assert ids([m for m, _ in res.completed]) == ["g2-a", "g2-b"]
    txns = Txns(lambda done: Deferred("23503") if "g1-a" in done else None)
    res = await run(txns, [message("g1-a", "g1"), message("g1-b", "g1")], fifo=True)
    assert res is not None and ids(res.blocked) == ["g1-b"] and not res.completed


async def test_on_fifo_a_failure_in_the_second_half_blocks_its_follower_once() -> None:
    txns = Txns(lambda done: Deferred("23503") if "g-x" in done else None)
    res = await run(txns, [message("a", "ga"), message("b", "gb"), message("g-x", "g"),
                           message("g-y", "g")], fifo=True)
    assert [m.request_id for m, _ in res.failed] == ["g-x"]
    assert ids(res.blocked) == ["g-y"]
    assert ids([m for m, _ in res.completed]) == ["a", "b"]


async def test_a_connection_lost_at_commit_is_an_outage_named_so() -> None:
    class Lost(Exception):
        pass

    class Gone(Txns):
        async def is_outage(self, exc: BaseException) -> bool:
            return isinstance(exc, Lost)

    txns = Gone(lambda done: Lost("connection reset at COMMIT"))
    with pytest.raises(DatabaseUnavailable, match="connection lost in the commit: Lost"):
        await run(txns, [message("a"), message("b")])
    assert len(txns.commits) == 1

"""The completing transaction (SPEC §2.4) as a loop of attempts, without a driver: both
stores run it — ``service.adapters.store.Store`` over PostgreSQL, ``service.testing.FakeStore`` over
its tables — through the small transaction seam below, so the fake cannot drift from it.

One attempt runs in one transaction: fence the claims (those still ours, locked until the
end), run the handlers of the live ones, complete them, clear their failure counts. It
commits, or it rolls back and says what happens next:

* a handler raised: its message is taken out (on a FIFO queue with the later messages of its
  group: blocked behind it) and the attempt runs again without it, so one bad message never
  rolls back its neighbours' effects for good;
* a conflict in a handler (deadlock, serialization, lock not available: nobody's fault):
  rerun as is, ``MAX_RERUNS`` times; then one by one, where a conflict is the failure of the
  message that hit it, so the loop always ends;
* a batch call raised: rerun one message at a time to find the culprit;
* the connection is gone: ``DatabaseUnavailable`` (an outage, not the handler's failure);
  but a connection error while the connection still answers (the handler's own connection
  to elsewhere) is the handler's failure, and so is a connection the handler closed itself
  (``HandlerClosedConnection``) or left busy with a query it did not wait for (the rollback
  cannot run: the connection is closed) — the next attempt runs on another connection;
* a handler ended the transaction itself (COMMIT or ROLLBACK: seen at once, no round trip):
  its failure, ``HandlerEndedTransaction``, before the next handler runs outside it. Its
  COMMIT commits nothing (``Transaction.guard_commit``): it fails and rolls back, so what the
  handlers before it wrote is never committed while their rows are IN_PROGRESS (a rerun, or
  a crash and a redelivery, would apply it twice); they run again in the next attempt;
* the COMMIT itself raised: a conflict (a serialization failure found at commit, a deadlock
  in a deferred trigger) is rerun as one in a handler; anything else (a deferred constraint
  one message violates) splits the messages into halves, each attempted in transactions of
  its own, until the message it belongs to is alone and fails; a database gone, or in
  trouble of its own (the store raises ``DatabaseUnavailable``), is an outage;
* a batch form declined (returned None): the attempt is rolled back and run again with
  those messages one by one — it may have written before declining;
* the transaction was found aborted after a handler returned (it caught a database error and
  carried on; a later statement says "current transaction is aborted"), or the connection
  busy (it left a statement running that it did not await): rerun one by one with
  a probe (``SELECT 1``) after each handler, so the one that left it aborted fails
  (``HandlerLeftTransactionAborted``) — not the neighbour whose statement found it, and not
  the whole batch, uncounted, again and again.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from service.core.limits import json_holds_nul
from service.core.messages import Message
from service.core.seams import ApplyResult, Batching, HandlerCall
from service.errors import DatabaseUnavailable

#: Conflicts (deadlock, serialization, lock not available) rerun as is this many times;
#: after that, one by one, and a conflict is the failure of the message that hit it.
MAX_RERUNS = 3


class HandlerEndedTransaction(Exception):
    """A handler executed COMMIT or ROLLBACK (or END, ABORT) itself: its message fails. What it
    committed stays committed — a handler that commits gives up exactly-once for its
    message; one that rolls back would otherwise have its neighbours marked COMPLETED without
    their effects."""


class HandlerClosedConnection(Exception):
    """A handler closed (or terminated) the connection it was given: its message fails, and
    the next attempt runs on another connection."""


ENDED_BY_HANDLER = "the handler ended the transaction (COMMIT/ROLLBACK)"

#: ``Transactions.ended()``: how the attempt's transaction ended, when it did.
ENDED = "ended"  # COMMIT/ROLLBACK on an open connection
CLOSED = "closed"  # the connection was closed by a call in this process (a handler)
LOST = "lost"  # the connection is gone otherwise (the server, the network): an outage


class HandlerLeftTransactionAborted(Exception):
    """A handler returned with the transaction aborted (it caught a database error and went
    on): its message fails, like any handler error."""


class Transaction(Protocol):
    """One run of the completing transaction: what is done through it commits together when
    the ``Transactions.attempt()`` block ends normally, and rolls back when it raises."""

    #: What handlers are given as their connection (None in the fake).
    conn: Any

    async def fence(self, request_ids: Sequence[str]) -> set[str]:
        """The request_ids still claimed by this worker, locked until the transaction ends
        (a claim collected by GC is not among them)."""

    async def guard_commit(self) -> None:
        """Before the handlers run: until ``complete()`` has run, a COMMIT fails and rolls
        the transaction back — a handler's COMMIT commits nothing (not its neighbours'
        writes while their rows are IN_PROGRESS, not its own)."""

    async def complete(self, live: Sequence[Message], outputs: Sequence[str | None]) -> int:
        """Mark ``live`` COMPLETED with their results (JSON text, or None), fenced on the
        owner (and, with results on, write their outbox rows); returns the rows completed."""

    async def clear_failures(self, request_ids: Sequence[str]) -> None:
        """Forget the failure counts of requests that completed after earlier failures."""

    async def probe(self) -> None:
        """One trivial statement: raises what ``Transactions.is_aborted`` recognises when the
        transaction is aborted (only run after a transaction was found aborted)."""


class Transactions(Protocol):
    """Where attempts run: one connection (or the fake's tables), and what its driver's
    exceptions mean."""

    def attempt(self) -> AbstractAsyncContextManager[Transaction]:
        """Begin one transaction (committed when the block ends normally)."""

    async def is_outage(self, exc: BaseException) -> bool:
        """``exc``, raised in a handler, means the connection itself is gone (a handler's
        own OSError or timeout is the handler's failure, not an outage; so is a connection
        error while this connection still answers, and a connection the handler closed)."""

    def is_conflict(self, exc: BaseException) -> bool:
        """``exc``, raised in a handler, is a deadlock, a serialization failure or a lock not
        available: the transaction may succeed as is when run again."""

    def is_aborted(self, exc: BaseException) -> bool:
        """``exc`` says the transaction was already aborted when the statement ran, or the
        connection busy with a statement an earlier handler left running."""

    def ended(self) -> str | None:
        """None while the attempt's transaction is open; else ``ENDED`` (a handler ended
        it), ``CLOSED`` (a handler closed the connection) or ``LOST`` (the connection is gone:
        an outage) — a local check, no round trip."""


async def complete(
    txns: Transactions, messages: Sequence[Message], call: HandlerCall,
    fifo: bool = False, batch: Batching | None = None,
) -> ApplyResult:
    """Run handlers and mark COMPLETED in one transaction, attempt after attempt until one
    commits (module docstring). With ``batch``, messages whose handlers have a batch form
    run as one call; FIFO queues never batch (order)."""
    result = ApplyResult()
    todo = list(messages)
    reruns = 0
    singly = fifo or batch is None
    probe = False
    declined: set[object] = set()
    while True:
        attempt = _Attempt(txns, call, None if singly else batch, fifo,
                           may_rerun=reruns < MAX_RERUNS, probe=probe, declined=declined)
        step = await attempt.run(todo)
        if isinstance(step, _Committed):
            step.into(result)
            return result
        if isinstance(step, _Split):
            return await _halves(txns, todo, call, fifo, batch, result)
        if isinstance(step, _Failed):
            result.failed.append((step.message, step.error))
            result.blocked.extend(drop_with_followers(todo, step.message, fifo))
        elif isinstance(step, _Rerun):
            reruns += 1
            # From now on one by one: a conflict in a handler is that message's failure,
            # so the loop always ends.
            singly = singly or reruns >= MAX_RERUNS
        elif isinstance(step, _Probe):
            singly = probe = True  # found aborted: probe after each handler from now on
        elif isinstance(step, _Declined):
            declined.add(step.key)  # its writes are rolled back; these go one by one
        else:
            singly = True  # a batch call failed: find the failing message


async def _halves(
    txns: Transactions, todo: list[Message], call: HandlerCall, fifo: bool,
    batch: Batching | None, result: ApplyResult,
) -> ApplyResult:
    """Complete each half of ``todo`` in transactions of its own (their COMMIT together
    failed, not on a conflict), into ``result``. On FIFO, the later messages of a group
    that the first half did not complete are blocked behind it, as within one attempt."""
    mid = len(todo) // 2
    rest = todo[mid:]
    for part in (todo[:mid], rest):
        if not part:
            break
        done = await complete(txns, part, call, fifo, batch)
        result.completed.extend(done.completed)
        result.failed.extend(done.failed)
        result.lost.extend(done.lost)
        result.blocked.extend(done.blocked)
        result.committed_at = max(result.committed_at, done.committed_at)
        if fifo and part is not rest:
            stopped = {m.raw.group_id for m in (*(f for f, _ in done.failed), *done.lost,
                                                *done.blocked)} - {None}
            result.blocked.extend(m for m in rest if m.raw.group_id in stopped)
            rest[:] = [m for m in rest if m.raw.group_id not in stopped]
    return result


@dataclass(slots=True)
class _Committed:
    live: list[Message]
    outputs: list[str | None]
    lost: list[Message]
    blocked: list[Message]

    def into(self, result: ApplyResult) -> None:
        result.completed.extend(
            (m, orjson.loads(o) if o is not None else None)
            for m, o in zip(self.live, self.outputs, strict=True)
        )
        result.lost.extend(self.lost)
        result.blocked.extend(self.blocked)
        result.committed_at = time.time()


@dataclass(slots=True)
class _Failed:
    message: Message
    error: BaseException


class _Rerun:
    """Roll back and run the same transaction again (deadlock, serialization)."""


class _OneByOne:
    """A batch call failed: roll back and rerun one message at a time."""


class _Probe:
    """The transaction was found aborted: rerun one message at a time, probing after each."""


@dataclass(slots=True)
class _Declined:
    """A batch form declined its group: roll back, rerun with that group one by one."""

    key: object


class _Split:
    """The COMMIT failed, not on a conflict that a rerun may mend: each half of the messages
    in a transaction of its own, until the one it belongs to is alone."""


_Step = _Committed | _Failed | _Rerun | _OneByOne | _Probe | _Declined | _Split


class _Abort(Exception):
    """Leaves the transaction block (rolling it back) carrying what happens next."""

    def __init__(self, step: _Step) -> None:
        self.step = step


class _Attempt:
    """One run of the completing transaction over ``todo``; says what happened."""

    __slots__ = ("batch", "call", "declined", "fifo", "may_rerun", "probe", "txns")

    def __init__(
        self, txns: Transactions, call: HandlerCall, batch: Batching | None, fifo: bool,
        may_rerun: bool, probe: bool = False, declined: Collection[object] = (),
    ) -> None:
        self.txns = txns
        self.call = call
        self.batch = batch
        self.fifo = fifo
        self.may_rerun = may_rerun
        self.probe = probe
        self.declined = declined

    async def run(self, todo: list[Message]) -> _Step:
        committing = False
        try:
            async with self.txns.attempt() as txn:
                step = await self._complete(txn, todo)
                committing = True
            return step
        except _Abort as abort:
            return abort.step
        except Exception as exc:
            if not committing:
                raise
            return await self._commit_failed(exc, todo)

    async def _commit_failed(self, exc: Exception, todo: list[Message]) -> _Step:
        """The COMMIT raised (the transaction is rolled back): a deferred constraint, a
        serialization failure found at commit, a deadlock in a deferred trigger. A conflict
        is rerun as in a handler; anything else belongs to one of the messages, not to all:
        the halves run apart until it is alone, and then it is that message's failure."""
        if isinstance(exc, DatabaseUnavailable):
            raise exc  # the store's verdict: gone, or the database's own trouble
        await self._raise_if_outage(exc, "the commit")
        if self.may_rerun and self.txns.is_conflict(exc):
            return _Rerun()
        if len(todo) > 1:
            return _Split()
        return _Failed(todo[0], exc)

    async def _complete(self, txn: Transaction, todo: list[Message]) -> _Committed:
        held = await txn.fence([m.request_id for m in todo])
        live, lost, blocked = split_fenced(todo, held, self.fifo)
        if live:
            await txn.guard_commit()
        results = await self._handlers(txn, live)
        outputs = [results[id(m)] for m in live]
        if live:
            if await self._completed(txn, live, outputs) != len(live):
                # Cannot happen while the fence locks hold; be loud if it does.
                raise RuntimeError("fenced completion lost rows under lock")
            retried = [m.request_id for m in live if m.failures > 0]
            if retried:
                await txn.clear_failures(retried)
        return _Committed(live, outputs, lost, blocked)

    async def _completed(
        self, txn: Transaction, live: list[Message], outputs: list[str | None]
    ) -> int:
        try:
            return await txn.complete(live, outputs)
        except Exception as exc:
            if self.txns.is_aborted(exc) and not self.probe:
                raise _Abort(_Probe()) from exc  # a handler swallowed a database error
            raise

    async def _handlers(self, txn: Transaction, live: list[Message]) -> dict[int, str | None]:
        results: dict[int, str | None] = {}
        one_by_one = live
        if self.batch is not None:
            one_by_one = await self._batched(txn, live, self.batch, results)
        for m in one_by_one:
            try:
                results[id(m)] = encode_result(await self.call(m, txn.conn))
                await self._still_open(txn)
            except Exception as exc:
                await self._raise_if_outage(exc, "a handler")
                if not isinstance(exc, HandlerEndedTransaction) and self.txns.ended() == ENDED:
                    # Its COMMIT failed (guard_commit), or it rolled back, and then it raised
                    # (that error, most often): it ended the transaction all the same.
                    raise _Abort(_Failed(m, HandlerEndedTransaction(
                        f"{ENDED_BY_HANDLER}; then it raised {type(exc).__name__}"))) from exc
                if self.may_rerun and self.txns.is_conflict(exc):
                    raise _Abort(_Rerun()) from exc
                if not self.probe and self.txns.is_aborted(exc):
                    # Aborted before this handler ran: an earlier one swallowed an error.
                    raise _Abort(_Probe()) from exc
                # Also a conflict that keeps coming back in this one message's handler
                # (its own NOWAIT/lock_timeout): blame it.
                raise _Abort(_Failed(m, exc)) from exc
        return results

    async def _batched(
        self, txn: Transaction, live: list[Message], batch: Batching,
        results: dict[int, str | None],
    ) -> list[Message]:
        """Run the batchable groups; return the messages still to run one by one."""
        key_of, call_many = batch
        groups: dict[object, list[Message]] = {}
        rest: list[Message] = []
        for m in live:
            key = key_of(m)
            if key is None or key in self.declined:
                rest.append(m)
            else:
                groups.setdefault(key, []).append(m)
        for key, group in groups.items():
            if len(group) == 1:
                rest.extend(group)
                continue
            try:
                outs = await call_many(group, txn.conn)
                if self.txns.ended() is not None:
                    raise HandlerEndedTransaction  # one by one finds (and blames) it
                if outs is None:
                    # Declined — perhaps after writing: roll that back, then one by one.
                    raise _Abort(_Declined(key))
                for m, out in zip(group, outs, strict=True):
                    results[id(m)] = encode_result(out)
            except _Abort:
                raise
            except Exception as exc:
                await self._raise_if_outage(exc, "a batch handler")
                # Found aborted too: one by one, where the next finding starts the probes.
                raise _Abort(_Rerun() if self.txns.is_conflict(exc) else _OneByOne()) from exc
        return rest

    async def _still_open(self, txn: Transaction) -> None:
        """After a handler returned: its transaction must still be open (a local check) and,
        once one was found aborted, not aborted (a probe)."""
        how = self.txns.ended()
        if how == CLOSED:
            raise HandlerClosedConnection("the handler closed its database connection")
        if how == LOST:
            raise DatabaseUnavailable("the connection closed while the handler ran, and not "
                                      "by a call in this process (the server or the network)")
        if how is not None:
            raise HandlerEndedTransaction(ENDED_BY_HANDLER)
        if self.probe:
            try:
                await txn.probe()
            except Exception as exc:
                if self.txns.is_aborted(exc):
                    raise HandlerLeftTransactionAborted(
                        "the handler returned with the transaction aborted or its connection "
                        "busy (it caught a database error and carried on, or left a "
                        f"statement running): {exc}") from exc
                raise

    async def _raise_if_outage(self, exc: BaseException, where: str) -> None:
        """A handler's OSError or TimeoutError (its own HTTP call, say) is the handler's
        failure; only a connection that is actually gone is a database outage."""
        if await self.txns.is_outage(exc):
            raise DatabaseUnavailable(f"connection lost in {where}: {exc!r}") from exc


def split_fenced(
    todo: list[Message], held: set[str], fifo: bool
) -> tuple[list[Message], list[Message], list[Message]]:
    """(live, lost, blocked): on FIFO, a lost claim holds back the rest of its group."""
    live: list[Message] = []
    lost: list[Message] = []
    blocked: list[Message] = []
    stopped: set[str] = set()
    for m in todo:
        group = m.raw.group_id if fifo else None
        if group is not None and group in stopped:
            blocked.append(m)
        elif m.request_id in held:
            live.append(m)
        else:
            lost.append(m)
            if group is not None:
                stopped.add(group)
    return live, lost, blocked


def drop_with_followers(todo: list[Message], bad: Message, fifo: bool) -> list[Message]:
    """Take a failed message out of ``todo``; on FIFO also the later ones of its group
    (returned: they are blocked behind it)."""
    at = todo.index(bad)
    todo.pop(at)
    if not fifo or bad.raw.group_id is None:
        return []
    after = [m for m in todo[at:] if m.raw.group_id == bad.raw.group_id]
    for m in after:
        todo.remove(m)
    return after


def encode_result(value: Any) -> str | None:
    """Serialise a handler's result inside its own failure scope (a bad result is the
    handler's failure, not the batch's)."""
    if value is None:
        return None
    raw = orjson.dumps(value)
    if json_holds_nul(raw):
        raise ValueError("handler result contains a NUL character (not storable in jsonb)")
    return raw.decode()

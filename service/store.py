"""The database seam: claim, complete, dead-letter, release, heartbeats and GC (asyncpg)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import asyncpg
import orjson

from service.errors import DatabaseUnavailable
from service.messages import Message, Poison
from service.sql import queries

Q = queries()

# Errors that mean "the database is not there", as opposed to a bad statement.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.TooManyConnectionsError,
)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    request_id: str
    claimed: bool
    status: str | None  # of the existing row, when not claimed and visible
    request_type: str | None
    payload_sha256: str | None
    owner: str | None
    failures: int
    dead_lettered: bool = False  # this SQS message is already in dead_letters


@dataclass(slots=True)
class ApplyResult:
    completed: list[tuple[Message, dict[str, Any] | None]] = field(default_factory=list)
    failed: list[tuple[Message, BaseException]] = field(default_factory=list)
    lost: list[Message] = field(default_factory=list)  # claim collected by GC: not ours
    blocked: list[Message] = field(default_factory=list)  # FIFO: behind a failure in its group
    committed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class DeadLetter:
    sqs_message_id: str
    body: str
    reason: str
    error: str | None
    request_id: str | None
    request_type: str | None
    receive_count: int | None

    @classmethod
    def of_poison(cls, p: Poison) -> DeadLetter:
        return cls(
            p.raw.message_id, p.raw.body, p.reason, p.error, p.request_id, p.type,
            p.raw.receive_count,
        )

    @classmethod
    def of_message(cls, m: Message, reason: str, error: str) -> DeadLetter:
        return cls(
            m.raw.message_id, m.raw.body, reason, error, m.request_id, m.type,
            m.raw.receive_count,
        )


HandlerCall = Callable[[Message, asyncpg.Connection], Awaitable[dict[str, Any] | None]]
#: Runs several messages' handlers at once; returns their results in order, or None when
#: these messages cannot go as one batch (then each runs on its own).
BatchCall = Callable[
    [list[Message], asyncpg.Connection], Awaitable[list[dict[str, Any] | None] | None]
]
#: Which messages may share one batch call (same key), None = never batched.
BatchKey = Callable[[Message], object]


class StoreSeam(Protocol):
    worker_id: str

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]: ...
    async def apply(
        self, messages: Sequence[Message], call: HandlerCall, fifo: bool
    ) -> ApplyResult: ...
    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None: ...
    async def release(self, messages: Sequence[Message]) -> None: ...
    async def record_failures(
        self, failures: Sequence[tuple[Message, str]], max_failures: int
    ) -> dict[str, int]: ...


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


#: What the worker treats as "the database call failed" (outage or server-side error).
DB_ERRORS: tuple[type[BaseException], ...] = (
    DatabaseUnavailable, asyncpg.PostgresError, *CONNECTION_ERRORS
)


def _wrap_connection_errors(exc: BaseException) -> BaseException:
    if isinstance(exc, CONNECTION_ERRORS):
        return DatabaseUnavailable(f"database unavailable: {type(exc).__name__}: {exc}")
    return exc


async def _init_connection(conn: asyncpg.Connection) -> None:
    for typ in ("jsonb", "json"):
        await conn.set_type_codec(
            typ, encoder=lambda v: orjson.dumps(v).decode(), decoder=orjson.loads,
            schema="pg_catalog",
        )


async def _no_reset(conn: asyncpg.Connection) -> None:
    return None


async def create_pool(dsn: str, size: int) -> asyncpg.Pool:
    return await asyncpg.create_pool(
        dsn,
        min_size=1,
        max_size=size,
        init=_init_connection,
        # asyncpg still rolls back an open transaction on release; the full RESET ALL /
        # UNLISTEN round trip is skipped (the daemon keeps no session state): one round
        # trip less per acquire.
        reset=_no_reset,
        command_timeout=60,
        # Statements are prepared per connection and reused (asyncpg's statement cache).
        max_inactive_connection_lifetime=300,
    )


class Store:
    """PostgreSQL side of the pipeline. Every method is one short transaction."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: str | None = None,
        control_pool: asyncpg.Pool | None = None,
    ) -> None:
        self.pool = pool
        # Heartbeats and GC get their own connections: with every batch connection busy
        # (slow handlers), a heartbeat queued behind them could outlive the lease and let
        # other replicas collect our live claims.
        self.control = control_pool or pool
        self.worker_id = worker_id or new_worker_id()

    # -- workers -----------------------------------------------------------------------

    async def register_worker(self, name: str) -> None:
        async with self.control.acquire() as conn:
            await conn.execute(
                Q["register_worker"], self.worker_id, name, socket.gethostname(), os.getpid()
            )

    async def heartbeat(self) -> bool:
        """False when this worker was marked stopped (its claims may be collected)."""
        async with self.control.acquire() as conn:
            return await conn.fetchval(Q["heartbeat"], self.worker_id) is not None

    async def stop_worker(self) -> int:
        """Release every claim still held and mark this worker stopped."""
        async with self.control.acquire() as conn, conn.transaction():
            released = await conn.fetch(
                "DELETE FROM modifications WHERE owner = $1 AND status = 'IN_PROGRESS'"
                " RETURNING request_id",
                self.worker_id,
            )
            await conn.execute(Q["stop_worker"], self.worker_id)
        return len(released)

    async def gc(
        self, lease_seconds: float, name: str | None = None, started_before: datetime | None = None
    ) -> list[asyncpg.Record]:
        """Release claims of dead workers. Never touches a claim of a live worker."""
        async with self.control.acquire() as conn:
            rows = await conn.fetch(
                Q["gc_orphans"], self.worker_id, lease_seconds, name, started_before
            )
            await conn.execute(Q["prune_workers"])
            return list(rows)

    async def gc_own_leaks(self, holding: Sequence[str]) -> list[str]:
        async with self.control.acquire() as conn:
            rows = await conn.fetch(Q["gc_own_leaks"], self.worker_id, list(holding))
            return [r["request_id"] for r in rows]

    async def ping(self) -> None:
        try:
            async with self.control.acquire(timeout=5) as conn:
                await conn.fetchval("SELECT 1")
        except CONNECTION_ERRORS as exc:
            raise _wrap_connection_errors(exc) from exc

    # -- the pipeline ------------------------------------------------------------------

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
        try:
            async with self.pool.acquire() as conn:
                return await claim(conn, messages, self.worker_id)
        except CONNECTION_ERRORS as exc:
            raise _wrap_connection_errors(exc) from exc

    async def apply(
        self,
        messages: Sequence[Message],
        call: HandlerCall,
        fifo: bool = False,
        batch: tuple[BatchKey, BatchCall] | None = None,
    ) -> ApplyResult:
        """Run handlers and mark COMPLETED in one transaction, fenced on ``owner``.

        With ``batch``, messages whose handlers have a batch form run as one call (one
        statement instead of one per message); if such a call raises, the transaction is
        rerun one message at a time to find the culprit. FIFO queues never batch (order).

        A handler that raises is taken out and the transaction is run again without it
        (and, on a FIFO queue, without the later messages of its group), so one bad
        message never rolls back its neighbours' effects for good. A deadlock or
        serialization failure reruns the transaction as is (it is nobody's fault); a
        broken connection raises DatabaseUnavailable.
        """
        result = ApplyResult()
        todo = list(messages)
        order = {id(m): i for i, m in enumerate(messages)}
        conflicts = 0
        singly = fifo or batch is None
        try:
            async with self.pool.acquire() as conn:
                while todo:
                    failed_at: tuple[Message, BaseException] | None = None
                    try:
                        async with conn.transaction():
                            held = {
                                r["request_id"]
                                for r in await conn.fetch(
                                    Q["fence"], [m.request_id for m in todo], self.worker_id
                                )
                            }
                            live, lost, blocked = _split_fenced(todo, held, fifo)
                            results: dict[int, str | None] = {}
                            one_by_one = live
                            if not singly and batch is not None:
                                one_by_one = await _run_batched(live, batch, conn, results)
                            for m in one_by_one:
                                try:
                                    results[id(m)] = _encode_result(await call(m, conn))
                                except Exception as exc:
                                    if _connection_broken(conn, exc):
                                        raise DatabaseUnavailable(
                                            f"connection lost in a handler: {exc!r}") from exc
                                    if isinstance(exc, RETRY_TRANSACTION) and conflicts < 3:
                                        raise _Rerun() from exc
                                    # Also a conflict that keeps coming back in this one
                                    # message's handler (its own NOWAIT/lock_timeout): blame it.
                                    failed_at = (m, exc)
                                    raise _Rollback() from exc
                            outputs = [results[id(m)] for m in live]
                            if live:
                                done = await conn.fetch(
                                    Q["complete"], [m.request_id for m in live], outputs,
                                    self.worker_id,
                                )
                                if len(done) != len(live):
                                    # Cannot happen while the fence locks hold; be loud if it does.
                                    raise RuntimeError("fenced completion lost rows under lock")
                                retried = [m.request_id for m in live if m.failures > 0]
                                if retried:
                                    await conn.execute(Q["clear_attempts"], retried)
                    except _Singly:
                        singly = True  # find the failing message one by one
                        continue
                    except _Rerun:
                        conflicts += 1
                        if conflicts >= 3:
                            # From now on one by one, and a conflict in a handler is that
                            # message's failure: the loop always ends.
                            singly = True
                        continue
                    except _Rollback:
                        assert failed_at is not None
                        bad, err = failed_at
                        result.failed.append((bad, err))
                        todo.remove(bad)
                        if fifo and bad.raw.group_id is not None:
                            after = [m for m in todo if m.raw.group_id == bad.raw.group_id
                                     and order[id(m)] > order[id(bad)]]
                            for m in after:
                                todo.remove(m)
                            result.blocked.extend(after)
                        continue
                    result.completed.extend(
                        (m, orjson.loads(o) if o is not None else None)
                        for m, o in zip(live, outputs, strict=True)
                    )
                    result.lost.extend(lost)
                    result.blocked.extend(blocked)
                    result.committed_at = time.time()
                    break
        except CONNECTION_ERRORS as exc:
            raise _wrap_connection_errors(exc) from exc
        return result

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        if not letters:
            return
        try:
            async with self.pool.acquire() as conn:
                await conn.execute(Q["dead_letter"], *_dead_letter_args(letters))
        except CONNECTION_ERRORS as exc:
            raise _wrap_connection_errors(exc) from exc

    async def release(self, messages: Sequence[Message]) -> None:
        """Give back this worker's claims made for exactly these SQS messages."""
        if not messages:
            return
        try:
            async with self.pool.acquire() as conn:
                await conn.execute(Q["release"], *_release_args(messages, self.worker_id))
        except CONNECTION_ERRORS as exc:
            raise _wrap_connection_errors(exc) from exc

    async def record_failures(
        self, failures: Sequence[tuple[Message, str]], max_failures: int
    ) -> dict[str, int]:
        """Release the claims of failed messages and count the failure.

        Messages that reached ``max_failures`` are dead-lettered in the same transaction.
        Returns request_id → failures so far.
        """
        if not failures:
            return {}
        ids = [m.request_id for m, _ in failures]
        try:
            async with self.pool.acquire() as conn, conn.transaction():
                await conn.execute(Q["release"], *_release_args([m for m, _ in failures],
                                                                self.worker_id))
                rows = await conn.fetch(Q["record_failures"], ids, [e for _, e in failures])
                counts = {r["request_id"]: r["failures"] for r in rows}
                exhausted = [
                    DeadLetter.of_message(m, "max_receives_exceeded", err)
                    for m, err in failures
                    if counts[m.request_id] >= max_failures
                ]
                if exhausted:
                    await conn.execute(Q["dead_letter"], *_dead_letter_args(exhausted))
                    await conn.execute(
                        Q["clear_attempts"], [d.request_id for d in exhausted]
                    )
                return counts
        except CONNECTION_ERRORS as exc:
            raise _wrap_connection_errors(exc) from exc


async def claim(
    conn: asyncpg.Connection, messages: Sequence[Message], owner: str
) -> dict[str, ClaimResult]:
    """Claim a batch in one statement: INSERT … ON CONFLICT (request_id) DO NOTHING.

    The unique index decides the race: of two sessions inserting the same request_id,
    the second waits for the first to commit and then inserts nothing.
    """
    ordered = sorted(messages, key=lambda m: m.request_id)
    rows = await conn.fetch(
        Q["claim"],
        [m.request_id for m in ordered],
        [m.type for m in ordered],
        [orjson.dumps(m.payload_json).decode() for m in ordered],
        [m.payload_sha256 for m in ordered],
        [m.raw.message_id for m in ordered],
        [m.sent_at for m in ordered],
        owner,
    )
    return {
        r["request_id"]: ClaimResult(
            r["request_id"], r["claimed"], r["status"], r["request_type"],
            r["payload_sha256"], r["owner"], r["failures"], r["dead_lettered"],
        )
        for r in rows
    }


class _Rollback(Exception):
    """Internal: roll the completing transaction back after a handler failed."""


class _Singly(Exception):
    """Internal: a batch call failed; rerun the transaction one message at a time."""


async def _run_batched(
    live: list[Message],
    batch: tuple[BatchKey, BatchCall],
    conn: asyncpg.Connection,
    results: dict[int, str | None],
) -> list[Message]:
    """Run the batchable groups; return the messages still to run one by one."""
    key_of, call_many = batch
    groups: dict[object, list[Message]] = {}
    rest: list[Message] = []
    for m in live:
        key = key_of(m)
        if key is None:
            rest.append(m)
        else:
            groups.setdefault(key, []).append(m)
    for group in groups.values():
        if len(group) == 1:
            rest.extend(group)
            continue
        try:
            outs = await call_many(group, conn)
            if outs is None:
                rest.extend(group)
                continue
            for m, out in zip(group, outs, strict=True):
                results[id(m)] = _encode_result(out)
        except Exception as exc:
            if _connection_broken(conn, exc):
                raise DatabaseUnavailable(f"connection lost in a batch handler: {exc!r}") from exc
            if isinstance(exc, RETRY_TRANSACTION):
                raise _Rerun() from exc
            raise _Singly() from exc
    return rest


class _Rerun(Exception):
    """Internal: roll back and run the same transaction again (deadlock, serialization)."""


#: Raised inside a handler by PostgreSQL itself, not by the handler's logic.
RETRY_TRANSACTION: tuple[type[BaseException], ...] = (
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.LockNotAvailableError,
)


def _connection_broken(conn: asyncpg.Connection, exc: BaseException) -> bool:
    """A handler's OSError or TimeoutError (its own HTTP call, say) is the handler's
    failure; only a connection that is actually gone is a database outage."""
    if isinstance(exc, asyncpg.PostgresConnectionError | asyncpg.ConnectionDoesNotExistError):
        return True
    return bool(conn.is_closed())


def _encode_result(value: Any) -> str | None:
    """Serialise a handler's result inside its own failure scope (a bad result is the
    handler's failure, not the batch's)."""
    if value is None:
        return None
    encoded = orjson.dumps(value).decode()
    if "\\u0000" in encoded:
        raise ValueError("handler result contains a NUL character (not storable in jsonb)")
    return encoded


def _split_fenced(
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


def _release_args(messages: Sequence[Message], owner: str) -> list[Any]:
    return [[m.request_id for m in messages], owner, [m.raw.message_id for m in messages]]


def _dead_letter_args(letters: Sequence[DeadLetter]) -> list[list[Any]]:
    return [
        [d.sqs_message_id for d in letters],
        [d.body for d in letters],
        [d.reason for d in letters],
        [d.error for d in letters],
        [d.request_id for d in letters],
        [d.request_type for d in letters],
        [d.receive_count for d in letters],
    ]

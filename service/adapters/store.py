"""The database seam: claim, complete, dead-letter, release, heartbeats and GC (asyncpg).
Every statement is named in ``sql/queries.sql``."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson
import structlog

from service.adapters import completion
from service.adapters.migrate import check_schema
from service.adapters.pgerrors import CONNECTION_ERRORS, RETRY_TRANSACTION, translate, unavailable
from service.adapters.sql import queries
from service.core.limits import storable
from service.core.messages import Message
from service.core.registry import EntityRow
from service.core.seams import (
    ApplyResult,
    BatchCall,
    Batching,
    BatchKey,
    ClaimResult,
    DeadLetter,
    HandlerCall,
    KnownPointer,
    OutboxRow,
    OutboxSeam,
    SendRows,
    StoreSeam,
    refused_of,
)
from service.observe import tracing

__all__ = [
    "ApplyResult", "BatchCall", "BatchKey", "ClaimResult", "DeadLetter", "HandlerCall",
    "OutboxSeam", "Store", "StoreSeam", "claim", "create_pool",
]

Q = queries()
log = structlog.get_logger("sqs_ingest.store")

def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class connection:  # lower case: used like a function, ``async with connection(pool)``
    """A pooled connection, and the one place the store's driver errors are translated
    (``service.adapters.pgerrors.translate``): a lost database surfaces as DatabaseUnavailable, a
    refused value as DataRejected, any other failed statement as DatabaseError.

    A small class rather than ``@asynccontextmanager``: it wraps every store call (the
    generator form cost 2.6 % of the daemon's CPU in a profile of ``make bench``)."""

    __slots__ = ("_acquire",)

    def __init__(self, pool: asyncpg.Pool, acquire_timeout: float | None = None) -> None:
        self._acquire = pool.acquire(timeout=acquire_timeout)

    async def __aenter__(self) -> Any:
        try:
            return await self._acquire.__aenter__()
        except CONNECTION_ERRORS as exc:
            raise unavailable(exc) from exc

    async def __aexit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            await self._acquire.__aexit__(typ, exc, tb)
        except CONNECTION_ERRORS as release_exc:
            raise unavailable(release_exc) from release_exc
        if exc is not None:
            ours = translate(exc)
            if ours is not None:
                raise ours from exc


async def _init_connection(conn: asyncpg.Connection) -> None:
    for typ in ("jsonb", "json"):
        await conn.set_type_codec(
            typ, encoder=lambda v: orjson.dumps(v).decode(), decoder=orjson.loads,
            schema="pg_catalog",
        )


async def _no_reset(conn: asyncpg.Connection) -> None:
    return None


class DaemonConnection(asyncpg.Connection):  # type: ignore[misc]
    """The pool's connections: they remember a ``close()`` or ``terminate()`` called on them
    in this process — by a handler, through the proxy it was given — so that a handler that
    closed its connection fails alone, while a connection the server or the network took
    stays an outage (``_PgTransactions.ended``)."""

    closed_by_call = False

    async def close(self, *, timeout: float | None = None) -> None:  # noqa: ASYNC109 (its API)
        self.closed_by_call = True
        await super().close(timeout=timeout)

    def terminate(self) -> None:
        self.closed_by_call = True
        super().terminate()

    def daemon_connection(self) -> DaemonConnection:
        """Itself (reached through a pool proxy, which hides the connection once detached)."""
        return self

    def get_reset_query(self) -> str:
        """asyncpg's reset (session advisory locks, cursors, LISTEN, RESET ALL), after the
        role: RESET ALL leaves a SET ROLE or SET SESSION AUTHORIZATION as it is; this takes
        the connection back to its own user and the role it connected with (the DSN's)."""
        return "SET SESSION AUTHORIZATION DEFAULT;\n" + str(super().get_reset_query())


async def create_pool(dsn: str, size: int) -> asyncpg.Pool:
    return await asyncpg.create_pool(
        dsn,
        min_size=1,
        max_size=size,
        init=_init_connection,
        connection_class=DaemonConnection,
        # asyncpg still rolls back an open transaction on release; its full reset round
        # trip is skipped (the daemon keeps no session state): one round trip less per
        # acquire. What handlers leave is reset after each committed batch
        # (_PgTransactions.finish).
        reset=_no_reset,
        command_timeout=60,
        # Statements are prepared per connection and reused (asyncpg's statement cache).
        max_inactive_connection_lifetime=300,
    )


class PgOutbox:
    """The results outbox's side of PostgreSQL (``service.core.seams.OutboxSeam``): what the
    publisher (``service.runtime.results``) claims, sends and marks. ``Store`` is one, over the
    connections it is given for it."""

    def __init__(self, outbox_pool: asyncpg.Pool) -> None:
        # The publisher holds its claim across the send: its own connections, so a slow
        # destination never takes one from the batches or the heartbeat.
        self.outbox_pool = outbox_pool
        # Set when a statement wrote an outbox row: the publisher wakes up.
        self.outbox_written = asyncio.Event()

    async def publish_outbox(self, send: SendRows, limit: int, fifo: bool) -> tuple[int, int]:
        """Claim → send → mark, one transaction: a crash before the mark leaves the rows
        pending (sent again: at least once, absorbed by a FIFO destination's dedup id); a
        row another publisher holds is skipped, never sent twice at the same time. A row the
        destination refused for good is marked refused (never claimed again) and counts as
        settled in the second number returned."""
        async with connection(self.outbox_pool) as conn, conn.transaction():
            rows = [_outbox_row(r) for r in await conn.fetch(Q["outbox_claim"], limit, fifo)]
            if not rows:
                return 0, 0
            sent = await send(rows)
            if sent:
                await conn.execute(Q["outbox_mark_published"], _texts(sorted(sent)))
            refused = refused_of(sent)
            if refused:
                ids = sorted(refused)
                await conn.execute(Q["outbox_mark_refused"], _texts(ids),
                                   [storable(refused[i]) for i in ids])
            return len(rows), len(sent) + len(refused)

    async def outbox_stats(self) -> tuple[int, float]:
        async with connection(self.outbox_pool) as conn:
            r = await conn.fetchrow(Q["outbox_stats"])
        return int(r["pending"]), float(r["oldest_age"])


class Store(PgOutbox):
    """PostgreSQL side of the pipeline. Every method is one short transaction."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: str | None = None,
        control_pool: asyncpg.Pool | None = None,
        *,
        results: bool = False,
        outbox_pool: asyncpg.Pool | None = None,
        lease: float | None = None,
    ) -> None:
        self.pool = pool
        # Heartbeats and GC get their own connections: with every batch connection busy
        # (slow handlers), a heartbeat queued behind them could outlive the lease and let
        # other replicas collect our live claims.
        self.control = control_pool or pool
        self.worker_id = worker_id or new_worker_id()
        # INGEST_WORKER_LEASE: a claim in the way whose owner's heartbeat is older is taken
        # over by the claim statement itself (None: left to the orphan GC).
        self.lease = lease
        # Results on: completions and dead letters write their outbox row in the same
        # statement. Off: the statements of before, nothing more.
        self.results = results
        super().__init__(outbox_pool or self.control)
        self._dead_letter_q = Q["dead_letter_with_result" if results else "dead_letter"]

    # -- workers -----------------------------------------------------------------------

    async def register_worker(self, name: str) -> None:
        async with connection(self.control) as conn:
            await conn.execute(
                Q["register_worker"], self.worker_id, name, socket.gethostname(), os.getpid()
            )

    async def heartbeat(self) -> bool:
        """False when this worker was marked stopped (its claims may be collected)."""
        async with connection(self.control) as conn:
            return await conn.fetchval(Q["heartbeat"], self.worker_id) is not None

    async def stop_worker(self) -> int:
        """Release every claim still held and mark this worker stopped."""
        async with connection(self.control) as conn, conn.transaction():
            released = await conn.fetch(Q["release_all"], self.worker_id)
            await conn.execute(Q["stop_worker"], self.worker_id)
        return len(released)

    async def gc(self, lease_seconds: float, name: str | None = None) -> list[asyncpg.Record]:
        """Release claims of dead workers. Never touches a claim of a live worker."""
        async with connection(self.control) as conn:
            rows = await conn.fetch(Q["gc_orphans"], self.worker_id, lease_seconds, name)
            # Workers rows go in service.adapters.prune (INGEST_WORKER_RETENTION_DAYS).
            return list(rows)

    async def gc_own_leaks(self, holding: Sequence[str]) -> list[str]:
        async with connection(self.control) as conn:
            rows = await conn.fetch(Q["gc_own_leaks"], self.worker_id, list(holding))
            return [r["request_id"] for r in rows]

    async def ping(self) -> None:
        async with connection(self.control, acquire_timeout=5) as conn:
            await conn.fetchval(Q["ping"])

    async def check_schema(self) -> None:
        """Raise SchemaBehind when the database lacks a migration this code needs."""
        async with connection(self.control, acquire_timeout=5) as conn:
            await check_schema(conn)

    # -- the pipeline ------------------------------------------------------------------

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
        async with connection(self.pool) as conn:
            return await claim(conn, messages, self.worker_id, self.lease)

    async def known_pointers(self, uris: Sequence[str]) -> dict[str, KnownPointer]:
        async with connection(self.pool) as conn:
            rows = await conn.fetch(Q["known_pointers"], list(uris))
        return {r["payload_pointer"]: KnownPointer(r["request_id"], r["request_type"],
                                                   r["status"]) for r in rows}

    async def note_refusals(self, errors: Mapping[str, str]) -> dict[str, float]:
        """Record that S3 refused these pointers (uri → error); returns, per pointer, the
        seconds since its first refusal (kept across restarts and fresh copies)."""
        if not errors:
            return {}
        uris = sorted(errors)  # one row each; a stable lock order between replicas
        async with connection(self.pool) as conn:
            rows = await conn.fetch(Q["note_refusals"], uris,
                                    [storable(errors[u])[:2000] for u in uris])
        return {r["pointer"]: float(r["refused_for"]) for r in rows}

    async def apply(
        self,
        messages: Sequence[Message],
        call: HandlerCall,
        fifo: bool = False,
        batch: Batching | None = None,
        entity_rows: Sequence[EntityRow] | None = None,
        time_limit: float | None = None,
    ) -> ApplyResult:
        """Run handlers and mark COMPLETED in one transaction, fenced on ``owner``: the
        attempt loop of ``service.adapters.completion`` over this connection (a broken connection
        raises DatabaseUnavailable). With ``entity_rows`` — a batch the reference handlers
        carry alone — first as one statement (``apply_entities``, within ``time_limit``), the
        attempt loop only when that fails."""
        if entity_rows is not None:
            with tracing.handlers(messages):  # the handlers' spans: their statement runs
                fused = await apply_entities(self.pool, self.worker_id, self.results,
                                             messages, entity_rows, time_limit)
            if fused is not None:
                if self.results and fused.completed:
                    self.outbox_written.set()
                return fused
        async with connection(self.pool) as conn:
            txns = _PgTransactions(self.pool, conn, self.worker_id, self.results)
            result = None
            try:
                result = await completion.complete(txns, messages, call, fifo, batch)
            finally:
                # Reset after any commit, a half's included when a later half then raised.
                await txns.finish(committed=result is not None or txns.committed_any)
        if self.results and result.completed:
            self.outbox_written.set()
        return result

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        if not letters:
            return
        async with connection(self.pool) as conn:
            await conn.execute(self._dead_letter_q, *_dead_letter_args(letters))
        if self.results:
            self.outbox_written.set()

    async def release(self, messages: Sequence[Message]) -> None:
        """Give back the claims made for exactly these messages (``Message.claim_token``)."""
        if not messages:
            return
        async with connection(self.pool) as conn:
            await conn.execute(Q["release"], *_release_args(messages, self.worker_id))

    async def record_failures(
        self, failures: Sequence[tuple[Message, str]], max_failures: int
    ) -> dict[str, int]:
        """Release the claims of failed messages and count the failure.

        Messages that reached ``max_failures`` are dead-lettered in the same transaction.
        Returns request_id → failures so far, only of the messages whose claim this call
        released (one whose claim was gone is left out: neither counted nor dead-lettered).
        """
        if not failures:
            return {}
        async with connection(self.pool) as conn, conn.transaction():
            released = {r["request_id"] for r in await conn.fetch(
                Q["release"], *_release_args([m for m, _ in failures], self.worker_id))}
            # A claim this batch no longer held (GC took it; another worker may have
            # completed the request since) is not this batch's failure to count: counting
            # it could dead-letter a request that also completed.
            failures = [f for f in failures if f[0].request_id in released]
            if not failures:
                return {}
            ids = [m.request_id for m, _ in failures]
            rows = await conn.fetch(Q["record_failures"], ids, [e for _, e in failures])
            counts: dict[str, int] = {r["request_id"]: r["failures"] for r in rows}
            exhausted = [
                DeadLetter.of_message(m, "max_receives_exceeded", err)
                for m, err in failures
                if counts[m.request_id] >= max_failures
            ]
            if exhausted:
                await conn.execute(self._dead_letter_q, *_dead_letter_args(exhausted))
                await conn.execute(Q["clear_attempts"], [d.request_id for d in exhausted])
        if exhausted and self.results:
            self.outbox_written.set()
        return counts


async def apply_entities(
    pool: asyncpg.Pool, owner: str, results: bool, messages: Sequence[Message],
    rows: Sequence[EntityRow], time_limit: float | None,
) -> ApplyResult | None:
    """``Store.apply`` of a batch the reference handlers carry alone — a standard queue,
    ``rows`` (``EntityRow``, one per message, no entity twice) — in one statement, its own
    transaction: fence, upsert, complete (``apply_entities`` in ``sql/queries.sql``). No
    commit guard and no reset: nothing but the store's statement runs, so it leaves no
    session state. None when the statement failed on anything but a lost connection
    (nothing of it committed): the caller runs the attempt loop, whose attempts then decide
    what the error is (a handler's failure, a conflict to rerun, a busy database)."""
    retried = [m.request_id for m in messages if m.failures > 0]
    async with connection(pool) as conn:
        try:
            done = await conn.fetch(
                Q["apply_entities"],
                [m.request_id for m in messages], [m.claim_token for m in messages],
                [r[0] for r in rows], _texts(r[1] for r in rows), _texts(r[2] for r in rows),
                [r[3] for r in rows], owner, retried, results,
                [m.raw.group_id for m in messages], timeout=time_limit)
        except Exception as exc:
            if _lost(conn, exc):
                raise  # the connection's translation: DatabaseUnavailable
            log.info("apply_entities_fell_back", error=f"{type(exc).__name__}: {exc}")
            return None
    applied = {r["request_id"]: r["applied"] for r in done}
    result = ApplyResult(committed_at=time.time())
    for m in messages:
        if m.request_id in applied:
            result.completed.append((m, {"applied": applied[m.request_id]}))
        else:
            result.lost.append(m)
    return result


def _lost(conn: Any, exc: BaseException) -> bool:
    """The connection is gone (an outage), as opposed to a statement that failed on it, or
    that ran past the handlers' time limit (cancelled: the connection stays)."""
    try:
        if conn.is_closed():
            return True
    except asyncpg.InterfaceError:
        return True  # detached: closed
    return isinstance(exc, CONNECTION_ERRORS) and not isinstance(exc, TimeoutError)


def _outbox_row(r: asyncpg.Record) -> OutboxRow:
    return OutboxRow(r["id"], r["request_id"], r["request_type"], r["status"], r["result"],
                     r["reason"], r["completed_at"], r["group_id"])


async def claim(
    conn: asyncpg.Connection, messages: Sequence[Message], owner: str,
    lease: float | None = None,
) -> dict[str, ClaimResult]:
    """Claim a batch in one statement: INSERT … ON CONFLICT (request_id) DO NOTHING.

    The unique index decides the race: of two sessions inserting the same request_id,
    the second waits for the first to commit and then inserts nothing. With ``lease``, a
    claim whose owner the orphan GC would collect is taken over in the same statement.

    Each message without a claim token gets this call's (``Message.claim_token``), before
    the statement runs: a release after a lost answer still names the rows it may delete.
    """
    token = str(uuid.uuid4())
    for m in messages:
        if m.claim_token is None:
            m.claim_token = token
    ordered = sorted(messages, key=lambda m: m.request_id)
    rows = await conn.fetch(
        Q["claim"],
        [m.request_id for m in ordered],
        [m.type for m in ordered],
        [orjson.dumps(m.payload_json).decode() for m in ordered],
        [m.payload_sha256 for m in ordered],
        [m.raw.message_id for m in ordered],
        [_utc_text(m.sent_at) for m in ordered],
        owner,
        [m.attributes_json for m in ordered],
        [m.pointer.uri if m.pointer is not None else None for m in ordered],
        [m.raw.group_id for m in ordered],
        [_sequence(m) for m in ordered],
        [m.claim_token for m in ordered],
        lease,
    )
    return {
        r["request_id"]: ClaimResult(
            r["request_id"], r["claimed"], r["status"], r["request_type"],
            r["payload_sha256"], r["owner"], r["failures"], r["dead_lettered"], r["held"],
            r["collected_from"],
        )
        for r in rows
    }


def _texts(values: Iterable[int | bool | None]) -> list[str | None]:
    """A text[] parameter of values the statement casts back (numbers, booleans, NULL):
    text[] is the one array type asyncpg needs no catalog look-up for (sql/queries.sql)."""
    return [None if v is None else str(v) for v in values]


def _utc_text(at: datetime | None) -> str | None:
    """A timestamptz as text in UTC, as asyncpg's own encoder sends it: ``datetime.max``
    and ``datetime.min`` (whatever their tzinfo) as infinity/-infinity, a naive value read
    as local time."""
    if at is None:
        return None
    naive = at.replace(tzinfo=None)
    if naive == datetime.max:
        return "infinity"
    if naive == datetime.min:
        return "-infinity"
    return at.astimezone(UTC).isoformat()


def _sequence(m: Message) -> str | None:
    """The SequenceNumber as numeric text (128 bits: beyond bigint), only with a group."""
    if m.raw.group_id is None or m.raw.sequence_number is None:
        return None
    return str(m.raw.sequence_number)


# -- the completing transaction's seam (service.adapters.completion) over one connection ----------


class _PgTransactions:
    """``completion.Transactions`` on a pooled connection: each attempt is one transaction;
    asyncpg's errors read as outage / conflict here, nowhere else. A connection a handler
    left unusable (closed, or busy with a query it left running) is replaced from the pool
    before the next attempt."""

    __slots__ = ("committed_any", "conn", "owner", "pool", "raw", "replacements", "results")

    def __init__(self, pool: asyncpg.Pool, conn: Any, owner: str, results: bool) -> None:
        self.pool = pool
        self.owner = owner
        self.results = results
        self.replacements: list[Any] = []
        self.committed_any = False  # an attempt's COMMIT went through (finish resets then)
        self._use(conn)

    def _use(self, conn: Any) -> None:
        self.conn = conn
        # The connection behind the proxy (a DaemonConnection: create_pool): whether a close
        # came from a call in this process, read after the proxy is detached.
        self.raw = conn.daemon_connection()

    def attempt(self) -> _PgAttempt:
        return _PgAttempt(self)

    def _gone(self) -> bool:
        """The connection is closed (a closed pooled connection detaches its proxy, whose
        every call then raises InterfaceError)."""
        try:
            return bool(self.conn.is_closed())
        except asyncpg.InterfaceError:
            return True

    async def is_outage(self, exc: BaseException) -> bool:
        if self._gone():
            return not self.raw.closed_by_call
        if not isinstance(
            exc, asyncpg.PostgresConnectionError | asyncpg.ConnectionDoesNotExistError
        ):
            return False
        # A connection error while this connection is open: the handler's own (another
        # connection of its own), unless a statement here finds this one gone too.
        try:
            await self.probe()
        except Exception:
            return self._gone() and not self.raw.closed_by_call
        return False

    def is_conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, RETRY_TRANSACTION)

    def is_aborted(self, exc: BaseException) -> bool:
        # InterfaceError on an open connection: the driver refused before sending anything —
        # "another operation is in progress" (a handler left a statement running).
        return isinstance(exc, asyncpg.InFailedSQLTransactionError) or (
            isinstance(exc, asyncpg.InterfaceError) and not self._gone())

    def ended(self) -> str | None:
        try:
            if self.conn.is_in_transaction():
                return None
        except asyncpg.InterfaceError:
            pass  # detached: closed
        if not self._gone():
            return completion.ENDED
        return completion.CLOSED if self.raw.closed_by_call else completion.LOST

    async def probe(self) -> None:
        await self.conn.execute("SELECT 1")

    async def fence(self, request_ids: Sequence[str]) -> set[str]:
        rows = await self.conn.fetch(Q["fence"], list(request_ids), self.owner)
        return {r["request_id"] for r in rows}

    async def guard_commit(self) -> None:
        # A cursor WITH HOLD runs its query when the transaction commits, and an error there
        # fails the COMMIT (the transaction rolls back); the completing statement sets
        # sqs_ingest.completing, which lets it pass. Simple protocol: nothing to prepare.
        await self.conn.execute(Q["guard_commit"])

    async def complete(self, live: Sequence[Message], outputs: Sequence[str | None]) -> int:
        ids = [m.request_id for m in live]
        done = await (
            self.conn.fetch(Q["complete_with_result"], ids, list(outputs), self.owner,
                            [m.raw.group_id for m in live])
            if self.results else self.conn.fetch(Q["complete"], ids, list(outputs), self.owner))
        return len(done)

    async def clear_failures(self, request_ids: Sequence[str]) -> None:
        await self.conn.execute(Q["clear_attempts"], list(request_ids))

    async def replace_if_unusable(self) -> None:
        if self._gone():
            conn = await self.pool.acquire()
            self.replacements.append(conn)
            self._use(conn)

    async def finish(self, committed: bool) -> None:
        """After the attempts: session state a handler left (a ``SET`` meant as ``SET
        LOCAL``, ``SET ROLE``, a session advisory lock, ``LISTEN``) outlives a commit — reset
        it (``DaemonConnection.get_reset_query``: one round trip), so the next batch's
        handlers and the store's own statements never run under it (a failed reset closes
        the connection instead: the commit stands); then give back the connections taken to
        replace broken ones."""
        if committed:
            try:
                await self.conn.reset()
            except Exception:
                if not self._gone():
                    self.conn.terminate()
        for conn in self.replacements:
            await self.pool.release(conn)


#: Errors at COMMIT of the database's own making: no rerun or split would mend them.
_DATABASE_AT_COMMIT: tuple[type[BaseException], ...] = (
    asyncpg.InsufficientResourcesError,  # 53: disk full, out of memory, too many connections
    asyncpg.OperatorInterventionError,  # 57: a cancel (57014), an admin shutdown
    asyncpg.ReadOnlySQLTransactionError,  # 25006: the server went read-only (a failover)
    asyncpg.PostgresSystemError,  # 58: an I/O error
    asyncpg.InternalServerError,  # XX: data corrupted, an internal error
)


class _PgAttempt:
    """``async with``: one asyncpg transaction, yielding the seam itself (a small class, not
    ``@asynccontextmanager``: it runs once per attempt on the hot path)."""

    __slots__ = ("_tx", "_txns")

    def __init__(self, txns: _PgTransactions) -> None:
        self._txns = txns
        self._tx: Any = None

    async def __aenter__(self) -> _PgTransactions:
        await self._txns.replace_if_unusable()
        self._tx = self._txns.conn.transaction()
        await self._tx.__aenter__()
        return self._txns

    async def __aexit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            await self._tx.__aexit__(typ, exc, tb)
            if exc is None:
                self._txns.committed_any = True
        except asyncpg.InterfaceError:
            # The rollback after a handler's failure could not run: the handler closed the
            # connection (its transaction is gone with it) or left a query running on it
            # (closed now). The failure in flight says what happens next; the next attempt
            # runs on another connection.
            if exc is None:
                raise
            if not self._txns._gone():
                self._txns.conn.terminate()
        except _DATABASE_AT_COMMIT as commit_exc:
            # The database's own trouble at COMMIT (an operator's cancel, a full disk, a
            # shutdown; statement_timeout is not armed during COMMIT): an outage, never a
            # message's failure (SPEC §7).
            if exc is not None:
                raise
            raise unavailable(commit_exc) from commit_exc


def _release_args(messages: Sequence[Message], owner: str) -> list[Any]:
    return [[m.request_id for m in messages], owner, [m.claim_token for m in messages]]


def _dead_letter_args(letters: Sequence[DeadLetter]) -> list[list[Any]]:
    """The dead-letter statement's arrays (the groups are kept with the letters and, with
    results on, given to their outbox rows)."""
    return [
        [d.sqs_message_id for d in letters],
        [d.body for d in letters],
        [d.reason for d in letters],
        [d.error for d in letters],
        [d.request_id for d in letters],
        [d.request_type for d in letters],
        _texts(d.receive_count for d in letters),
        [d.group_id for d in letters],
    ]

"""Data access for ``dead_letters``: the row, listing, and the row-locked replay transactions.

Replay sends the stored raw body (byte for byte) to the queue and marks the row
``replayed_at``. Two operators (or two scripts) replaying at the same moment must not
re-enqueue a dead letter twice, so every replay locks the rows it sends:

* ``replay_one``: ``SELECT … FOR UPDATE`` on the row, send, ``UPDATE replayed_at``,
  commit — one transaction. A second session replaying the same id blocks on the row
  lock; once the first commits, READ COMMITTED re-checks ``replayed_at IS NULL`` on the
  new row version, finds nothing, and the second session reports "already replayed".
* ``replay_batch``: the same with ``FOR UPDATE SKIP LOCKED`` over a small batch, so
  concurrent ``--all`` runs split the rows between them instead of waiting for (and
  then double-sending) each other's.

Ordering caveat: the message is sent *before* the transaction that records
``replayed_at`` commits. A crash (or lost connection) between the two leaves the row
unmarked, and the next replay sends it again. That is at-least-once, and harmless:
ingestion is idempotent on ``request_id`` (a second copy is acked as a duplicate), and
on a FIFO queue the ``MessageDeduplicationId`` ``dlq-<id>`` lets SQS drop a re-send
within its 5-minute window. The opposite order (mark, commit, then send) would lose
the message on such a crash, which is worse.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

import asyncpg
from botocore.exceptions import BotoCoreError, ClientError

from service.adapters.sql import queries

Q = queries()

#: Rows locked, sent and marked per transaction by ``replay --all``. Small, so a
#: failure re-sends little and concurrent replays can share the work.
DEFAULT_BATCH = 10


@dataclass(frozen=True, slots=True)
class Letter:
    """One ``dead_letters`` row."""

    id: int
    sqs_message_id: str
    body: str
    reason: str
    error: str | None
    request_id: str | None
    request_type: str | None
    receive_count: int | None
    received_at: datetime
    replayed_at: datetime | None
    group_id: str | None  # the FIFO MessageGroupId it came with (NULL before migration 007)

    @classmethod
    def of(cls, r: asyncpg.Record) -> Letter:
        return cls(**{k: r[k] for k in cls.__slots__})


#: Sends one dead letter's body to the queue; returns the new SQS MessageId.
Send = Callable[[Letter], Awaitable[str]]


class ReplayError(Exception):
    """A replay that could not be done; the CLI prints it and exits 1."""


class NotFound(ReplayError):
    def __init__(self, letter_id: int) -> None:
        super().__init__(f"dead letter id={letter_id} not found")
        self.letter_id = letter_id


class AlreadyReplayed(ReplayError):
    def __init__(self, letter: Letter) -> None:
        when = letter.replayed_at.isoformat() if letter.replayed_at else "?"
        super().__init__(
            f"dead letter id={letter.id} was already replayed at {when}; not sending it again"
        )
        self.letter = letter


class SendFailed(ReplayError):
    """Sending failed part-way; ``replayed`` are the rows sent and marked before it."""

    def __init__(self, letter: Letter, cause: BaseException, replayed: Sequence[Letter]) -> None:
        super().__init__(f"sending dead letter id={letter.id} failed: {cause}")
        self.letter = letter
        self.replayed = list(replayed)


async def list_letters(
    conn: asyncpg.Connection,
    *,
    reason: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    include_replayed: bool = False,
    limit: int | None = 100,
    up_to_id: int | None = None,
) -> list[Letter]:
    """Rows by id, filtered; no locks taken. ``limit=None``: all of them."""
    rows = await conn.fetch(
        Q["dlq_list"], reason, since, until, include_replayed, limit, up_to_id
    )
    return [Letter.of(r) for r in rows]


async def find_letter(conn: asyncpg.Connection, letter_id: int) -> Letter | None:
    """The row with this id, replayed or not (no lock taken)."""
    row = await conn.fetchrow(Q["dlq_find_one"], letter_id)
    return None if row is None else Letter.of(row)


async def replay_one(conn: asyncpg.Connection, letter_id: int, send: Send) -> Letter:
    """Lock the row, send its body, mark it replayed — one transaction.

    Raises ``AlreadyReplayed`` (also when a concurrent replay of the same id committed
    while this one waited for the lock), ``NotFound``, or ``SendFailed`` (nothing marked;
    the transaction is rolled back and the row stays replayable).
    """
    async with conn.transaction():
        row = await conn.fetchrow(Q["dlq_lock_one"], letter_id)
        if row is None:
            existing = await conn.fetchrow(Q["dlq_find_one"], letter_id)
            if existing is None:
                raise NotFound(letter_id)
            raise AlreadyReplayed(Letter.of(existing))
        letter = Letter.of(row)
        try:
            await send(letter)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise SendFailed(letter, exc, []) from exc
        await conn.execute(Q["dlq_mark_replayed"], [str(letter.id)])  # text[]: sql/queries.sql
    return letter


async def replay_batch(
    conn: asyncpg.Connection,
    send: Send,
    reason: str | None = None,
    limit: int = DEFAULT_BATCH,
    up_to_id: int | None = None,
) -> list[Letter]:
    """Lock up to ``limit`` unreplayed rows (skipping rows another session holds), send
    each, mark them replayed, commit. Returns the rows replayed; empty when none is left
    that this session may take.

    When a send fails, the rows already sent in this batch are still marked and
    committed (they did reach the queue), then ``SendFailed`` is raised.
    """
    sent: list[Letter] = []
    failure: tuple[Letter, BaseException] | None = None
    async with conn.transaction():
        rows = await conn.fetch(Q["dlq_lock_batch"], reason, up_to_id, limit)
        for r in rows:
            letter = Letter.of(r)
            try:
                await send(letter)
            except (ClientError, BotoCoreError, OSError) as exc:
                failure = (letter, exc)
                break
            sent.append(letter)
        if sent:
            await conn.execute(Q["dlq_mark_replayed"], [str(x.id) for x in sent])
    if failure is not None:
        raise SendFailed(failure[0], failure[1], sent) from failure[1]
    return sent


async def replay_all(
    conn: asyncpg.Connection,
    send: Send,
    reason: str | None = None,
    batch_size: int = DEFAULT_BATCH,
    on_batch: Callable[[list[Letter]], None] | None = None,
) -> list[Letter]:
    """``replay_batch`` until nothing is left, bounded to the rows that exist now.

    The bound matters while a daemon runs: a replayed message that is still poison comes
    back as a *new* dead letter (new SQS message id), and without the bound this loop
    would replay it again, forever.
    """
    up_to_id = await conn.fetchval(Q["dlq_max_id"])
    if up_to_id is None:
        return []
    done: list[Letter] = []
    while True:
        try:
            batch = await replay_batch(conn, send, reason, batch_size, up_to_id)
        except SendFailed as exc:
            if exc.replayed and on_batch is not None:
                on_batch(exc.replayed)
            done.extend(exc.replayed)
            exc.replayed = done
            raise
        if not batch:
            return done
        done.extend(batch)
        if on_batch is not None:
            on_batch(batch)


async def pending(conn: asyncpg.Connection, reason: str | None = None) -> list[Letter]:
    """What ``replay --all`` would send now (no locks taken: for ``--dry-run``)."""
    bound = await conn.fetchval(Q["dlq_max_id"])
    return await list_letters(conn, reason=reason, limit=None, up_to_id=bound)

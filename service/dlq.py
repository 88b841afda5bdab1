"""``sqs-ingest dlq list`` / ``dlq replay``: inspect dead letters and send them back.

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

import argparse
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson
from botocore.exceptions import BotoCoreError, ClientError

from service.settings import Settings, redact_dsn
from service.sqs import sqs_client

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

#: Rows locked, sent and marked per transaction by ``replay --all``. Small, so a
#: failure re-sends little and concurrent replays can share the work.
DEFAULT_BATCH = 10
FIFO_DEFAULT_GROUP = "dlq-replay"
# SQS: MessageGroupId / MessageDeduplicationId are 1-128 chars of printable ASCII.
_SQS_TOKEN = re.compile(r"^[\x21-\x7e]{1,128}$")

_COLUMNS = (
    "id, sqs_message_id, body, reason, error, request_id, request_type, receive_count,"
    " received_at, replayed_at"
)

SQL_LIST = f"""
SELECT {_COLUMNS}
FROM dead_letters
WHERE ($1::text IS NULL OR reason = $1)
  AND ($2::timestamptz IS NULL OR received_at >= $2)
  AND ($3::timestamptz IS NULL OR received_at < $3)
  AND ($4::boolean OR replayed_at IS NULL)
ORDER BY id
LIMIT $5
"""

# replayed_at IS NULL is in the locking query on purpose: a session that waited for the
# lock re-evaluates it on the committed row version and gets no row back.
SQL_LOCK_ONE = f"""
SELECT {_COLUMNS}
FROM dead_letters
WHERE id = $1 AND replayed_at IS NULL
FOR UPDATE
"""

SQL_FIND_ONE = f"SELECT {_COLUMNS} FROM dead_letters WHERE id = $1"

SQL_LOCK_BATCH = f"""
SELECT {_COLUMNS}
FROM dead_letters
WHERE replayed_at IS NULL
  AND ($1::text IS NULL OR reason = $1)
  AND ($2::bigint IS NULL OR id <= $2)
ORDER BY id
LIMIT $3
FOR UPDATE SKIP LOCKED
"""

SQL_PENDING = f"""
SELECT {_COLUMNS}
FROM dead_letters
WHERE replayed_at IS NULL
  AND ($1::text IS NULL OR reason = $1)
  AND ($2::bigint IS NULL OR id <= $2)
ORDER BY id
"""

SQL_MAX_ID = "SELECT max(id) FROM dead_letters"

SQL_MARK = (
    "UPDATE dead_letters SET replayed_at = now() WHERE id = ANY($1::bigint[])"
    " RETURNING id"
)


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

    @classmethod
    def of(cls, r: asyncpg.Record) -> Letter:
        return cls(**{k: r[k] for k in cls.__slots__})

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "sqs_message_id": self.sqs_message_id,
            "reason": self.reason,
            "error": self.error,
            "request_id": self.request_id,
            "request_type": self.request_type,
            "receive_count": self.receive_count,
            "received_at": self.received_at.isoformat(),
            "replayed_at": self.replayed_at.isoformat() if self.replayed_at else None,
            "body": self.body,
        }


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


# -- database functions (tests drive these with an injected ``send``) -------------------


async def list_letters(
    conn: asyncpg.Connection,
    *,
    reason: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    include_replayed: bool = False,
    limit: int = 100,
) -> list[Letter]:
    rows = await conn.fetch(SQL_LIST, reason, since, until, include_replayed, limit)
    return [Letter.of(r) for r in rows]


async def replay_one(conn: asyncpg.Connection, letter_id: int, send: Send) -> Letter:
    """Lock the row, send its body, mark it replayed — one transaction.

    Raises ``AlreadyReplayed`` (also when a concurrent replay of the same id committed
    while this one waited for the lock), ``NotFound``, or ``SendFailed`` (nothing marked;
    the transaction is rolled back and the row stays replayable).
    """
    async with conn.transaction():
        row = await conn.fetchrow(SQL_LOCK_ONE, letter_id)
        if row is None:
            existing = await conn.fetchrow(SQL_FIND_ONE, letter_id)
            if existing is None:
                raise NotFound(letter_id)
            raise AlreadyReplayed(Letter.of(existing))
        letter = Letter.of(row)
        try:
            await send(letter)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise SendFailed(letter, exc, []) from exc
        await conn.execute(SQL_MARK, [letter.id])
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
        rows = await conn.fetch(SQL_LOCK_BATCH, reason, up_to_id, limit)
        for r in rows:
            letter = Letter.of(r)
            try:
                await send(letter)
            except (ClientError, BotoCoreError, OSError) as exc:
                failure = (letter, exc)
                break
            sent.append(letter)
        if sent:
            await conn.execute(SQL_MARK, [x.id for x in sent])
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
    up_to_id = await conn.fetchval(SQL_MAX_ID)
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
    bound = await conn.fetchval(SQL_MAX_ID)
    return [Letter.of(r) for r in await conn.fetch(SQL_PENDING, reason, bound)]


# -- the queue side -------------------------------------------------------------------


def sqs_sender(client: Any, queue_url: str) -> Send:
    """A ``Send`` through an aiobotocore SQS client.

    On a FIFO queue: ``MessageGroupId`` = the letter's ``request_id`` (so replays of one
    request stay ordered) or ``dlq-replay``, and ``MessageDeduplicationId`` = ``dlq-<id>``
    so a re-send after a crash is dropped by SQS within its deduplication window, even on
    a queue without content-based deduplication.
    """
    fifo = queue_url.rstrip("/").endswith(".fifo")

    async def send(letter: Letter) -> str:
        kwargs: dict[str, Any] = {"QueueUrl": queue_url, "MessageBody": letter.body}
        if fifo:
            rid = letter.request_id
            kwargs["MessageGroupId"] = (
                rid if rid is not None and _SQS_TOKEN.match(rid) else FIFO_DEFAULT_GROUP
            )
            kwargs["MessageDeduplicationId"] = f"dlq-{letter.id}"
        resp = await client.send_message(**kwargs)
        return str(resp["MessageId"])

    return send


# -- the CLI --------------------------------------------------------------------------


async def main(settings: Settings, args: argparse.Namespace) -> int:
    """Entry point of ``sqs-ingest dlq …``; returns the exit code."""
    try:
        conn = await asyncpg.connect(settings.database_url, timeout=10)
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        _err(f"cannot connect to {redact_dsn(settings.database_url)}: {exc}")
        return EXIT_FAILED
    try:
        if args.dlq_command == "list":
            return await _list(conn, args)
        if args.dlq_command == "replay":
            return await _replay(conn, settings, args)
        raise AssertionError(args.dlq_command)
    except asyncpg.PostgresError as exc:
        _err(f"database error: {exc}")
        return EXIT_FAILED
    finally:
        await conn.close()


async def _list(conn: asyncpg.Connection, args: argparse.Namespace) -> int:
    try:
        since = _parse_time(args.since, "--since")
        until = _parse_time(args.until, "--until")
    except ValueError as exc:
        _err(str(exc))
        return EXIT_USAGE
    if args.limit < 1:
        _err("--limit must be at least 1")
        return EXIT_USAGE
    letters = await list_letters(
        conn, reason=args.reason, since=since, until=until,
        include_replayed=args.include_replayed, limit=args.limit,
    )
    if args.format == "json":
        sys.stdout.write(orjson.dumps([x.as_json() for x in letters]).decode() + "\n")
    else:
        sys.stdout.write(format_table(letters))
    return EXIT_OK


async def _replay(conn: asyncpg.Connection, settings: Settings, args: argparse.Namespace) -> int:
    if args.id is not None and args.reason is not None:
        _err("--reason applies to --all only")
        return EXIT_USAGE
    if args.dry_run:
        return await _dry_run(conn, settings, args)
    async with sqs_client(settings.aws_region, settings.sqs_endpoint_url) as client:
        send = sqs_sender(client, settings.queue_url)
        if args.id is not None:
            try:
                letter = await replay_one(conn, args.id, send)
            except ReplayError as exc:
                _err(str(exc))
                print("replayed 0")
                return EXIT_FAILED
            print(f"replayed id={letter.id} request_id={letter.request_id or '-'} "
                  f"reason={letter.reason}")
            print("replayed 1")
            return EXIT_OK

        def show(batch: list[Letter]) -> None:
            for x in batch:
                print(f"replayed id={x.id} request_id={x.request_id or '-'} reason={x.reason}")

        try:
            done = await replay_all(conn, send, args.reason, on_batch=show)
        except SendFailed as exc:
            _err(str(exc))
            print(f"replayed {len(exc.replayed)}")
            return EXIT_FAILED
    print(f"replayed {len(done)} to {settings.queue_url}")
    return EXIT_OK


async def _dry_run(conn: asyncpg.Connection, settings: Settings, args: argparse.Namespace) -> int:
    if args.id is not None:
        row = await conn.fetchrow(SQL_FIND_ONE, args.id)
        if row is None:
            _err(str(NotFound(args.id)))
            return EXIT_FAILED
        letter = Letter.of(row)
        if letter.replayed_at is not None:
            _err(str(AlreadyReplayed(letter)))
            return EXIT_FAILED
        letters = [letter]
    else:
        letters = await pending(conn, args.reason)
    for x in letters:
        print(f"would replay id={x.id} request_id={x.request_id or '-'} reason={x.reason} "
              f"body={_preview(x.body, 200)}")
    print(f"dry run: would replay {len(letters)} to {settings.queue_url}; nothing sent or changed")
    return EXIT_OK


def format_table(letters: Sequence[Letter], preview: int = 60) -> str:
    header = ("id", "received_at", "reason", "request_id", "replayed_at", "body")
    rows = [
        (
            str(x.id),
            x.received_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            x.reason,
            x.request_id or "-",
            x.replayed_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            if x.replayed_at else "-",
            _preview(x.body, preview),
        )
        for x in letters
    ]
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in (header, *rows)]
    lines.append(f"({len(rows)} dead letter{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"


def _preview(body: str, width: int) -> str:
    # One line per row, whatever the body holds (newlines, tabs, control characters).
    flat = body.encode("unicode_escape").decode("ascii") if not body.isprintable() else body
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _parse_time(value: str | None, flag: str) -> datetime | None:
    if value is None:
        return None
    try:
        ts = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{flag}: not an ISO 8601 timestamp: {value!r}") from None
    # A timestamp without an offset is taken as UTC, like every timestamp we print.
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def _err(msg: str) -> None:
    print(f"sqs-ingest dlq: {msg}", file=sys.stderr)

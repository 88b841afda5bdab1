"""``sqs-ingest dlq list`` / ``dlq replay``: the arguments, the exit codes and what is printed."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson

from service.adapters.sqs import sqs_client
from service.ops.dlq.letters import (
    AlreadyReplayed,
    Letter,
    NotFound,
    ReplayError,
    SendFailed,
    find_letter,
    list_letters,
    pending,
    replay_all,
    replay_one,
)
from service.ops.dlq.sender import sqs_sender
from service.secrets import inert, inert_json, safe, scrub
from service.settings import Settings

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


async def main(settings: Settings, args: argparse.Namespace) -> int:
    """Entry point of ``sqs-ingest dlq …``; returns the exit code."""
    try:
        conn = await asyncpg.connect(settings.database_dsn, timeout=10)
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        _err(f"cannot connect to {settings.database_redacted}: {exc}")
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
        sys.stdout.write(inert_json(orjson.dumps([as_json(x) for x in letters]).decode()) + "\n")
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
            _show([letter])
            print("replayed 1")
            return EXIT_OK
        try:
            done = await replay_all(conn, send, args.reason, on_batch=_show)
        except SendFailed as exc:
            _err(str(exc))
            print(f"replayed {len(exc.replayed)}")
            return EXIT_FAILED
    print(f"replayed {len(done)} to {settings.queue_url}")
    return EXIT_OK


def _show(batch: list[Letter]) -> None:
    for x in batch:
        print(f"replayed id={x.id} request_id={inert(x.request_id or '-')} "
              f"reason={inert(x.reason)}")


async def _dry_run(conn: asyncpg.Connection, settings: Settings, args: argparse.Namespace) -> int:
    if args.id is not None:
        letter = await find_letter(conn, args.id)
        if letter is None:
            _err(str(NotFound(args.id)))
            return EXIT_FAILED
        if letter.replayed_at is not None:
            _err(str(AlreadyReplayed(letter)))
            return EXIT_FAILED
        letters = [letter]
    else:
        letters = await pending(conn, args.reason)
    for x in letters:
        print(f"would replay id={x.id} request_id={inert(x.request_id or '-')} "
              f"reason={inert(x.reason)} "
              f"body={_preview(x.body, 200)}")
    print(f"dry run: would replay {len(letters)} to {settings.queue_url}; nothing sent or changed")
    return EXIT_OK


def as_json(x: Letter) -> dict[str, Any]:
    """One row as ``dlq list --format json`` prints it (the body verbatim)."""
    return {
        "id": x.id,
        "sqs_message_id": x.sqs_message_id,
        "reason": x.reason,
        "error": scrub(x.error) if x.error else x.error,  # a driver's error may quote a DSN
        "request_id": x.request_id,
        "request_type": x.request_type,
        "receive_count": x.receive_count,
        "received_at": x.received_at.isoformat(),
        "replayed_at": x.replayed_at.isoformat() if x.replayed_at else None,
        "body": x.body,
    }


def format_table(letters: Sequence[Letter], preview: int = 60) -> str:
    """Rows as ``dlq list`` prints them: aligned columns, one line per row, a count."""
    header = ("id", "received_at", "reason", "request_id", "replayed_at", "body")
    rows = [
        (
            str(x.id),
            x.received_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            inert(x.reason),
            inert(x.request_id or "-"),
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
    print(safe(f"sqs-ingest dlq: {msg}"), file=sys.stderr)

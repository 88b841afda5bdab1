"""Handlers the chaos tests load into the real daemon through INGEST_HANDLERS.

Each invocation is appended to ``$CHAOS_DIR/invocations.log`` *outside* the transaction
(so redeliveries and retries are visible), while the effect row in ``chaos_effects`` is
written inside it (so it lands once or not at all).

``ledger.append`` is the chaos workload's counting effect: every run appends a row to
``chaos_ledger`` (no unique key), so an effect applied twice leaves two rows where the
reference entity handlers, idempotent by version, would hide it. It has a batch form too,
so the batch path and its one-by-one rerun are held to the same count.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import asyncpg
from pydantic import BaseModel

from service.handlers import batch_handler, current_request_id, handler


class Slow(BaseModel):
    seconds: float
    #: a file in $CHAOS_DIR: the handler returns as soon as it exists (at most ``seconds``)
    until: str | None = None


class Flaky(BaseModel):
    fail_times: int


class LedgerEntry(BaseModel):
    group: str
    seq: int


def _record() -> int:
    path = Path(os.environ["CHAOS_DIR"]) / "invocations.log"
    with path.open("a") as f:
        f.write(current_request_id() + "\n")
    return path.read_text().splitlines().count(current_request_id())


async def _effect(conn: asyncpg.Connection) -> None:
    await conn.execute("INSERT INTO chaos_effects (request_id) VALUES ($1)", current_request_id())


@handler("chaos.slow", Slow)
async def slow(p: Slow, conn: asyncpg.Connection) -> dict[str, float]:
    _record()
    if p.until is None:
        await asyncio.sleep(p.seconds)
    else:
        gate = Path(os.environ["CHAOS_DIR"]) / p.until
        deadline = asyncio.get_running_loop().time() + p.seconds
        while not gate.exists() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
    await _effect(conn)
    return {"slept": p.seconds}


@handler("chaos.flaky", Flaky)
async def flaky(p: Flaky, conn: asyncpg.Connection) -> dict[str, int]:
    attempt = _record()
    if attempt <= p.fail_times:
        raise RuntimeError(f"flaky failure {attempt} of {p.fail_times}")
    await _effect(conn)
    return {"attempts": attempt}


class Cancels(BaseModel):
    times: int


@handler("chaos.cancels", Cancels)
async def cancels(p: Cancels, conn: asyncpg.Connection) -> dict[str, int]:
    """Raises CancelledError of its own (as a library's cancelled inner task would) while
    nobody cancels the batch: the first ``times`` invocations."""
    attempt = _record()
    if attempt <= p.times:
        raise asyncio.CancelledError(f"inner task cancelled ({attempt} of {p.times})")
    await _effect(conn)
    return {"attempts": attempt}


LEDGER_DDL = ("CREATE TABLE chaos_ledger (id bigserial PRIMARY KEY, request_id text NOT NULL,"
              " grp text NOT NULL, seq int NOT NULL)")


@handler("ledger.append", LedgerEntry)
async def ledger_append(p: LedgerEntry, conn: asyncpg.Connection) -> dict[str, int]:
    await conn.execute("INSERT INTO chaos_ledger (request_id, grp, seq) VALUES ($1, $2, $3)",
                       current_request_id(), p.group, p.seq)
    return {"seq": p.seq}


@batch_handler("ledger.append")
async def ledger_append_many(
    items: list[tuple[str, LedgerEntry]], conn: asyncpg.Connection
) -> list[dict[str, int] | None]:
    await conn.execute(
        "INSERT INTO chaos_ledger (request_id, grp, seq)"
        " SELECT r, g, s FROM unnest($1::text[], $2::text[], $3::int[]) WITH ORDINALITY AS t(r, g, s, o)"
        "  ORDER BY o",
        [r for r, _ in items], [p.group for _, p in items], [p.seq for _, p in items])
    return [{"seq": p.seq} for _, p in items]


class StallingEntry(LedgerEntry):
    seconds: float


@handler("ledger.stall_first", StallingEntry)
async def ledger_stall_first(p: StallingEntry, conn: asyncpg.Connection) -> dict[str, int]:
    """A ledger append whose first run (per request, across processes: ``$CHAOS_DIR``)
    sleeps ``seconds`` first: the process running it can be killed while it holds the
    claim; a later run appends at once."""
    if _record() == 1:
        await asyncio.sleep(p.seconds)
    await conn.execute("INSERT INTO chaos_ledger (request_id, grp, seq) VALUES ($1, $2, $3)",
                       current_request_id(), p.group, p.seq)
    return {"seq": p.seq}

"""The broken twin of ``chaos_handlers.ledger_append``, for the ledger check's own test
(tests/acceptance/test_crash_point.py): its effect is written on a connection of its own,
outside the request's transaction, and its first attempt at each request fails after the
effect — so the retry applies it a second time. ``check_ledger`` must see that."""

from __future__ import annotations

import os

import asyncpg
from pydantic import BaseModel

from service.handlers import current_request_id, handler


class LedgerEntry(BaseModel):  # chaos_handlers' (importing it would register its handlers)
    group: str
    seq: int

_attempts: dict[str, int] = {}


@handler("ledger.append", LedgerEntry)
async def ledger_append_outside_the_transaction(
    p: LedgerEntry, conn: asyncpg.Connection
) -> dict[str, int]:
    rid = current_request_id()
    own = await asyncpg.connect(os.environ["INGEST_DATABASE_URL"])
    try:  # autocommit: the row stays whatever the request's transaction does
        await own.execute("INSERT INTO chaos_ledger (request_id, grp, seq) VALUES ($1, $2, $3)",
                          rid, p.group, p.seq)
    finally:
        await own.close()
    _attempts[rid] = _attempts.get(rid, 0) + 1
    if _attempts[rid] == 1:
        raise RuntimeError("first attempt fails after its effect")
    return {"seq": p.seq}

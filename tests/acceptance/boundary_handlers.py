"""Handlers for tests/acceptance/test_handler_boundary.py (loaded with INGEST_HANDLERS)."""

from __future__ import annotations

import sys

import asyncpg
from pydantic import BaseModel

from service.handlers import current_request_id, handler


class Empty(BaseModel):
    pass


@handler("boundary.exits", Empty)
async def exits(_p: Empty, _conn: asyncpg.Connection) -> None:
    """A library that calls ``sys.exit()`` on an error it cannot handle."""
    sys.exit(0)


@handler("boundary.ok", Empty)
async def ok(_p: Empty, conn: asyncpg.Connection) -> dict[str, bool]:
    await conn.execute("INSERT INTO chaos_effects (request_id) VALUES ($1)", current_request_id())
    return {"ok": True}

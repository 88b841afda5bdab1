"""Handlers for tests/acceptance/test_handler_boundary.py (loaded with INGEST_HANDLERS)."""

from __future__ import annotations

import asyncio
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


@handler("boundary.closes", Empty)
async def closes(_p: Empty, conn: asyncpg.Connection) -> None:
    """Closes the connection it was given ("done with the database")."""
    await conn.close()


@handler("boundary.leaves_a_query_running", Empty)
async def leaves_a_query_running(_p: Empty, conn: asyncpg.Connection) -> None:
    """Starts a statement it never awaits, then fails."""
    asyncio.ensure_future(conn.execute("SELECT pg_sleep(0.5)"))
    await asyncio.sleep(0)
    raise ValueError("left a query running")


@handler("boundary.ok", Empty)
async def ok(_p: Empty, conn: asyncpg.Connection) -> dict[str, bool]:
    await conn.execute("INSERT INTO chaos_effects (request_id) VALUES ($1)", current_request_id())
    return {"ok": True}

"""Handlers the chaos tests load into the real daemon through INGEST_HANDLERS.

Each invocation is appended to ``$CHAOS_DIR/invocations.log`` *outside* the transaction
(so redeliveries and retries are visible), while the effect row in ``chaos_effects`` is
written inside it (so it lands once or not at all).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import asyncpg
from pydantic import BaseModel

from service.handlers import current_request_id, handler


class Slow(BaseModel):
    seconds: float


class Flaky(BaseModel):
    fail_times: int


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
    await asyncio.sleep(p.seconds)
    await _effect(conn)
    return {"slept": p.seconds}


@handler("chaos.flaky", Flaky)
async def flaky(p: Flaky, conn: asyncpg.Connection) -> dict[str, int]:
    attempt = _record()
    if attempt <= p.fail_times:
        raise RuntimeError(f"flaky failure {attempt} of {p.fail_times}")
    await _effect(conn)
    return {"attempts": attempt}

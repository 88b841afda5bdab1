"""A handler tests/acceptance/test_redrive.py loads into the real daemon (INGEST_HANDLERS).

``redrive.gated`` marks that it runs (``$CHAOS_DIR/running-<gate>``) and then waits until
the test opens its gate (``$CHAOS_DIR/open-<gate>``) before writing its effect to
``chaos_effects`` in the completing transaction. A request so stays in its handler exactly
as long as a scenario needs — its duplicate contended N times, an outage landed under it —
with no fixed sleep in the test.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import asyncpg
from pydantic import BaseModel

from service.handlers import current_request_id, handler


class Gated(BaseModel):
    gate: str


@handler("redrive.gated", Gated)
async def gated(p: Gated, conn: asyncpg.Connection) -> dict[str, str]:
    here = Path(os.environ["CHAOS_DIR"])
    (here / f"running-{p.gate}").touch()
    while not (here / f"open-{p.gate}").exists():
        await asyncio.sleep(0.05)
    await conn.execute("INSERT INTO chaos_effects (request_id) VALUES ($1)", current_request_id())
    return {"gate": p.gate}

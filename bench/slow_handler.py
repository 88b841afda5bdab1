"""``bench.slow``: a handler type for the costs phase's slow case (bench/costs.py) — each
batch takes COSTS_SLOW_HANDLER seconds (default 3), longer than half the visibility
timeout the case runs with, so every batch is extended by the heartbeat while it runs.
Loaded with INGEST_HANDLERS=bench.slow_handler; it writes nothing but its result."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from pydantic import BaseModel

from service.handlers import batch_handler, handler

SECONDS = float(os.environ.get("COSTS_SLOW_HANDLER", "") or 3)


class Slow(BaseModel):
    n: int


@handler("bench.slow")
async def slow(payload: Slow, conn: Any) -> dict[str, Any]:
    await asyncio.sleep(SECONDS)
    return {"n": payload.n}


@batch_handler("bench.slow")
async def slow_many(items: list[tuple[str, Any]], conn: Any) -> list[dict[str, Any] | None]:
    await asyncio.sleep(SECONDS)  # once a batch: every batch runs as long
    return [{"n": p.n} for _, p in items]

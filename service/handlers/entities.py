"""Reference handlers: versioned entity upserts and tombstones.

A write only lands when its ``version`` is strictly newer than the stored one, so
replays and out-of-order deliveries converge on the same state. A stale version still
completes, with ``result = {"applied": false}``.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from pydantic import BaseModel, StrictInt, StrictStr

from service.handlers.registry import handler


class EntityUpsert(BaseModel):
    entity_id: StrictStr
    version: StrictInt
    data: dict[str, Any]


class EntityDelete(BaseModel):
    entity_id: StrictStr
    version: StrictInt


_UPSERT = """
INSERT INTO entities AS e (entity_id, version, deleted, data, request_id, updated_at)
VALUES ($1, $2, $3, $4, $5, now())
ON CONFLICT (entity_id) DO UPDATE
   SET version = EXCLUDED.version, deleted = EXCLUDED.deleted, data = EXCLUDED.data,
       request_id = EXCLUDED.request_id, updated_at = now()
 WHERE e.version < EXCLUDED.version
RETURNING 1
"""


@handler("entity.upsert", EntityUpsert)
async def entity_upsert(p: EntityUpsert, conn: asyncpg.Connection) -> dict[str, Any]:
    from service.handlers import current_request_id

    # The pool's jsonb codec encodes the dict (passing a JSON string would store a string).
    row = await conn.fetchval(
        _UPSERT, p.entity_id, p.version, False, p.data, current_request_id()
    )
    return {"applied": row is not None}


@handler("entity.delete", EntityDelete)
async def entity_delete(p: EntityDelete, conn: asyncpg.Connection) -> dict[str, Any]:
    from service.handlers import current_request_id

    row = await conn.fetchval(_UPSERT, p.entity_id, p.version, True, None, current_request_id())
    return {"applied": row is not None}

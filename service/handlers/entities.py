"""Reference handlers: versioned entity upserts and tombstones.

A write only lands when its ``version`` is strictly newer than the stored one, so
replays and out-of-order deliveries converge on the same state. A stale version still
completes, with ``result = {"applied": false}``.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson
from pydantic import BaseModel

from service.handlers.context import current_request_id
from service.handlers.registry import batch_handler, handler
from service.limits import IndexedText, Int64


class EntityUpsert(BaseModel):
    entity_id: IndexedText  # the primary key of ``entities``
    version: Int64  # ``bigint``
    data: dict[str, Any]


class EntityDelete(BaseModel):
    entity_id: IndexedText
    version: Int64


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
    # The pool's jsonb codec encodes the dict (passing a JSON string would store a string).
    row = await conn.fetchval(
        _UPSERT, p.entity_id, p.version, False, p.data, current_request_id()
    )
    return {"applied": row is not None}


@handler("entity.delete", EntityDelete)
async def entity_delete(p: EntityDelete, conn: asyncpg.Connection) -> dict[str, Any]:
    row = await conn.fetchval(_UPSERT, p.entity_id, p.version, True, None, current_request_id())
    return {"applied": row is not None}


_UPSERT_MANY = """
WITH up AS (
INSERT INTO entities AS e (entity_id, version, deleted, data, request_id, updated_at)
SELECT entity_id, version, deleted, data::jsonb, request_id, now()
  FROM unnest($1::text[], $2::bigint[], $3::boolean[], $4::text[], $5::text[])
    AS t(entity_id, version, deleted, data, request_id)
 ORDER BY entity_id  -- one lock order for every replica: no deadlock between batches
ON CONFLICT (entity_id) DO UPDATE
   SET version = EXCLUDED.version, deleted = EXCLUDED.deleted, data = EXCLUDED.data,
       request_id = EXCLUDED.request_id, updated_at = now()
 WHERE e.version < EXCLUDED.version
RETURNING entity_id
)
SELECT coalesce(array_agg(entity_id), '{}') FROM up
"""


@batch_handler("entity.upsert", "entity.delete")
async def entities_many(
    items: list[tuple[str, EntityUpsert | EntityDelete]], conn: asyncpg.Connection
) -> list[dict[str, Any] | None] | None:
    """One statement for a batch of upserts and deletes touching distinct entities.

    Two writes to the same entity in one batch decline (one by one keeps the exact
    "applied" result of each, and ON CONFLICT cannot touch a row twice).
    """
    ids = [p.entity_id for _, p in items]
    if len(set(ids)) != len(ids):
        return None
    applied = set(await conn.fetchval(
        _UPSERT_MANY,
        ids,
        [p.version for _, p in items],
        [isinstance(p, EntityDelete) for _, p in items],
        [orjson.dumps(p.data).decode() if isinstance(p, EntityUpsert) else None
         for _, p in items],
        [rid for rid, _ in items],
    ))
    return [{"applied": p.entity_id in applied} for _, p in items]

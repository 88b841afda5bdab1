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

from service.core.limits import IndexedText, Int64
from service.core.registry import batch_handler, default_registry, handler
from service.handlers.context import current_request_id


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
  FROM unnest($1::text[], $2::text[]::bigint[], $3::text[]::boolean[], $4::text[], $5::text[])
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
) -> list[dict[str, Any] | None]:
    """The plain handlers' effect and results for a batch of upserts and deletes, one
    statement per round: round k writes each entity's k-th message of the batch (ON
    CONFLICT cannot touch a row twice in one statement), so an entity written by several
    messages sees them in batch order, as one by one would — never a decline."""
    results: list[dict[str, Any] | None] = [None] * len(items)  # each set by its round
    for positions in _rounds([p.entity_id for _, p in items]):
        todo = [items[i] for i in positions]
        applied = set(await conn.fetchval(
            _UPSERT_MANY,
            [p.entity_id for _, p in todo],
            [str(p.version) for _, p in todo],  # text[]: see service/adapters/sql/queries.sql
            [str(isinstance(p, EntityDelete)) for _, p in todo],
            [orjson.dumps(p.data).decode() if isinstance(p, EntityUpsert) else None
             for _, p in todo],
            [rid for rid, _ in todo],
        ))
        for i in positions:
            results[i] = {"applied": items[i][1].entity_id in applied}
    return results


def _upsert_row(p: EntityUpsert) -> tuple[str, int, bool, str | None]:
    return p.entity_id, p.version, False, orjson.dumps(p.data).decode()


def _delete_row(p: EntityDelete) -> tuple[str, int, bool, str | None]:
    return p.entity_id, p.version, True, None


# What the plain handlers write, as rows: a batch of these handlers alone (standard queue,
# no entity twice) is applied in one statement by the store
# (``service.adapters.store.apply_entities``: the same upsert, its fence and completion
# fused), the same effect and results.
default_registry.register_entity_row("entity.upsert", _upsert_row)
default_registry.register_entity_row("entity.delete", _delete_row)


def _rounds(keys: list[str]) -> list[list[int]]:
    """Positions of ``keys`` by round: round k holds each key's k-th occurrence, in order."""
    seen: dict[str, int] = {}
    rounds: list[list[int]] = []
    for i, key in enumerate(keys):
        k = seen.get(key, 0)
        seen[key] = k + 1
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(i)
    return rounds

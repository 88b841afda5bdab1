"""``invoice.created``: one row in ``invoices`` per invoice, written in the transaction that
completes the request (so it lands once), with a batch form (one statement per batch).

The daemon loads it through the package's entry point (``sqs_ingest.handlers`` in
pyproject.toml) once the package is installed.
"""

from __future__ import annotations

from typing import Annotated, Any

import asyncpg
from pydantic import BaseModel, Field

from service.handlers import IndexedText, Int64, batch_handler, current_request_id, handler


class Invoice(BaseModel):
    invoice_id: IndexedText  # the primary key: fits a B-tree entry whatever its characters
    customer: str
    # Annotated, not `= Field(ge=0)`: a default Field would not narrow Int64's own bounds.
    amount_cents: Annotated[Int64, Field(ge=0)]


_INSERT = """
INSERT INTO invoices (invoice_id, customer, amount_cents, request_id)
SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[])
ON CONFLICT (invoice_id) DO NOTHING
RETURNING invoice_id
"""


@handler("invoice.created", Invoice)
async def invoice_created(p: Invoice, conn: asyncpg.Connection) -> dict[str, Any]:
    # Only the given connection: it is the completing transaction (rolled back and rerun
    # when a neighbour in the batch fails). Anything written elsewhere would land twice.
    rows = await conn.fetch(_INSERT, [p.invoice_id], [p.customer], [p.amount_cents],
                            [current_request_id()])
    return {"stored": bool(rows)}


@batch_handler("invoice.created")
async def invoices_created(items: list[tuple[str, Invoice]],
                           conn: asyncpg.Connection) -> list[dict[str, Any] | None] | None:
    ids = [p.invoice_id for _, p in items]
    if len(set(ids)) != len(ids):
        return None  # two messages for one invoice: decline, they run one by one, in order
    rows = await conn.fetch(_INSERT, ids, [p.customer for _, p in items],
                            [p.amount_cents for _, p in items], [rid for rid, _ in items])
    stored = {r["invoice_id"] for r in rows}
    return [{"stored": i in stored} for i in ids]

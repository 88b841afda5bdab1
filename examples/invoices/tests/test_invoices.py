"""The example handler's own tests, through the kit (service.testing.pytest_plugin fixtures)."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import pytest
from pydantic import BaseModel

from service.handlers import Registry
from service.testing.kit import check_lands_once


def invoice(rid: str, invoice_id: str, amount: int = 1200, customer: str = "acme") -> str:
    return json.dumps({"request_id": rid, "type": "invoice.created",
                       "payload": {"invoice_id": invoice_id, "customer": customer,
                                   "amount_cents": amount}})


async def rows(conn: asyncpg.Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await conn.fetch(
        "SELECT invoice_id, customer, amount_cents, request_id FROM invoices ORDER BY 1")]


async def test_each_message_gets_its_outcome(ingest_runner: Any) -> None:
    first = invoice("r-1", "inv-1")
    out = await ingest_runner.run([
        first,
        invoice("r-2", "inv-2", 99),
        invoice("r-3", "inv-3", -5),  # the model's ge=0
        json.dumps({"request_id": "r-4", "type": "invoice.paid", "payload": {}}),
    ])
    # Later receives: a redelivery, then the same request_id with another payload.
    out += await ingest_runner.run([first])
    out += await ingest_runner.run([invoice("r-1", "inv-1", 1)])
    assert [(o.request_id, o.outcome, o.reason) for o in out] == [
        ("r-1", "completed", None),
        ("r-2", "completed", None),
        ("r-3", "dead_lettered", "invalid_payload"),
        ("r-4", "dead_lettered", "unknown_type"),
        ("r-1", "duplicate", None),
        ("r-1", "dead_lettered", "idempotency_key_reused"),
    ]
    assert out[0].result == {"stored": True}
    conn = await asyncpg.connect(ingest_runner.dsn)
    try:
        assert await rows(conn) == [("inv-1", "acme", 1200, "r-1"), ("inv-2", "acme", 99, "r-2")]
    finally:
        await conn.close()


async def test_the_batch_form_has_the_plain_handlers_effect(ingest_runner: Any) -> None:
    out = await ingest_runner.run([invoice(f"b-{i}", f"inv-b{i}", i) for i in range(6)]
                                  + [invoice("b-dup", "inv-b0", 7)])  # declines: one by one
    assert [o.outcome for o in out] == ["completed"] * 7
    assert [o.result for o in out] == [{"stored": True}] * 6 + [{"stored": False}]


async def test_the_effect_lands_once_beside_a_failing_neighbour(ingest_lands_once: Any) -> None:
    assert await ingest_lands_once(invoice("once-1", "inv-once"), rows) == [
        ("inv-once", "acme", 1200, "once-1")]


class Audit(BaseModel):
    invoice_id: str


async def test_the_check_catches_an_effect_outside_the_transaction(
        ingest_database_factory: Any) -> None:
    """What the check is for: a handler that writes through a connection of its own (here
    an 'audit' insert) is rerun after the neighbour fails, and its row lands twice."""
    dsns: list[str] = []

    async def new_database() -> str:
        dsns.append(await ingest_database_factory())
        return dsns[-1]

    async def leaky(p: Audit, conn: asyncpg.Connection) -> None:
        own = await asyncpg.connect(dsns[-1])
        try:
            await own.execute("INSERT INTO invoices VALUES ($1 || '-' || gen_random_uuid(),"
                              " 'audit', 0, 'x')", p.invoice_id)
        finally:
            await own.close()

    registry = Registry()
    registry.register("invoice.audited", Audit, leaky)
    body = json.dumps({"request_id": "a-1", "type": "invoice.audited",
                       "payload": {"invoice_id": "inv-a"}})

    async def count(conn: asyncpg.Connection) -> int:
        return int(await conn.fetchval("SELECT count(*) FROM invoices"))

    with pytest.raises(AssertionError, match="lands again on the rerun"):
        await check_lands_once(new_database, body, count, registry)

"""An existing producer's messages through the real claim -> apply -> complete path with an
envelope mapping: the mapped request id is the idempotency key (a resend is a duplicate)."""

from __future__ import annotations

import asyncio
import json

import asyncpg
from pydantic import BaseModel

from service.envelope import Envelope
from service.handlers import Registry
from service.testing.kit import Runner, create_template, postgres_server


class Order(BaseModel):
    orderId: int
    amount: int


async def store_order(payload: Order, conn: asyncpg.Connection) -> dict:
    await conn.execute("INSERT INTO orders VALUES ($1, $2)", payload.orderId, payload.amount)
    return {"stored": payload.orderId}


def test_mapped_messages_land_once() -> None:
    registry = Registry()
    registry.register("order.created", Order, store_order)
    registry.envelope = Envelope.from_specs("orderId", "const:order.created", ".")

    async def scenario(dsn: str) -> None:
        runner = Runner(dsn, registry)
        body = json.dumps({"orderId": 77, "amount": 5})
        first = await runner.run([body, json.dumps({"orderId": 78, "amount": 6})])
        again = await runner.run([body])
        assert [(o.request_id, o.outcome) for o in first + again] == [
            ("77", "completed"), ("78", "completed"), ("77", "duplicate")]
        conn = await asyncpg.connect(dsn)
        try:
            assert await conn.fetchval("SELECT count(*) FROM orders") == 2
            assert await conn.fetchval(
                "SELECT payload_sha256 IS NOT NULL FROM modifications WHERE request_id = '77'")
        finally:
            await conn.close()

    with postgres_server() as pg:
        asyncio.run(create_template(pg, "mapped", [
            "CREATE TABLE orders (id bigint PRIMARY KEY, amount int)"]))
        asyncio.run(scenario(pg.dsn("mapped")))

"""The field report of issue 16, on real PostgreSQL and the SQS emulator: a 5,000-character
random request_id among 120 ordinary requests. Measured side by side with the same traffic
without it; neither may cost a healthy message anything."""

from __future__ import annotations

import json
import random
import string
import time
from typing import Any

import asyncpg
import pytest

from service.observe import metrics
from tests.integration.conftest import eventually, make_settings, running_worker


def upsert(rid: str, eid: str) -> str:
    return json.dumps({"request_id": rid, "type": "entity.upsert",
                       "payload": {"entity_id": eid, "version": 1, "data": {"v": 1}}})


def hostile_id(n: int = 5000, seed: int = 16) -> str:
    # Random, so it does not compress below the B-tree limit (one repeated letter would).
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))


def received_total() -> float:
    return metrics.REGISTRY.get_sample_value("sqs_ingest_messages_received_total") or 0.0


def outcomes() -> dict[str, float]:
    out: dict[str, float] = {}
    for family in metrics.REGISTRY.collect():
        if family.name == "sqs_ingest_messages_processed":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    o = sample.labels["outcome"]
                    out[o] = out.get(o, 0.0) + sample.value
    return out


async def drain(sqs_client: Any, url: str, database_url: str, endpoint: str,
                bodies: list[str], db: asyncpg.Connection, ordinary: int) -> tuple[float, float]:
    """Send, run a worker until every ordinary request completed; (seconds, receives)."""
    for b in bodies:
        sqs_client.send_message(QueueUrl=url, MessageBody=b)
    before = received_total()
    started = time.monotonic()
    async with running_worker(make_settings(url, database_url, endpoint, pollers=2)):
        async def done() -> bool:
            n = await db.fetchval("SELECT count(*) FROM modifications WHERE status='COMPLETED'")
            return bool(n == ordinary)
        await eventually(done, f"{ordinary} ordinary requests completed", timeout=60)
        elapsed = time.monotonic() - started

        async def settled() -> bool:
            a = sqs_client.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])
            attrs = a["Attributes"]
            return (attrs["ApproximateNumberOfMessages"], attrs[
                "ApproximateNumberOfMessagesNotVisible"]) == ("0", "0")
        await eventually(settled, "queue empty", timeout=90)
    return elapsed, received_total() - before


@pytest.mark.parametrize("door", ["limits", "bisection"])
async def test_one_hostile_request_id_costs_no_neighbour(
    door: str, sqs_client: Any, sqs_endpoint: str, database_url: str,
    db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``limits``: refused at the door (request_id_too_long). ``bisection``: with the door
    limit lifted, PostgreSQL refuses the claim statement and bisection finds the message."""
    if door == "bisection":
        monkeypatch.setattr("service.core.messages.INDEXED_TEXT_MAX_CHARS", 10**9)
    ordinary = [upsert(f"r{i}", f"e{i}") for i in range(120)]
    mixed = list(ordinary)
    bad = upsert(hostile_id(), "e-hostile")
    mixed.insert(57, bad)
    clean_url = sqs_client.create_queue(QueueName=f"clean-{door}")["QueueUrl"]
    url = sqs_client.create_queue(QueueName=f"hostile-{door}")["QueueUrl"]
    clean_db = await asyncpg.connect(database_url)
    try:
        # The same traffic without the hostile message first (other request ids).
        base = [upsert(f"c{i}", f"c{i}") for i in range(120)]
        t_clean, _ = await drain(sqs_client, clean_url, database_url, sqs_endpoint, base,
                                 clean_db, 120)
    finally:
        await clean_db.close()
    await db.execute("DELETE FROM modifications")
    before = outcomes()
    t_hostile, receives = await drain(sqs_client, url, database_url, sqs_endpoint, mixed, db,
                                      120)
    after = outcomes()
    delta = {o: after.get(o, 0.0) - before.get(o, 0.0) for o in after}
    print(f"\n[{door}] 120 ordinary: {t_clean:.2f}s without, {t_hostile:.2f}s with the hostile "
          f"message; receives {receives:.0f} for {len(mixed)} messages")
    letters = await db.fetch("SELECT body, reason, error FROM dead_letters")
    expected = "request_id_too_long" if door == "limits" else "rejected_by_database"
    assert [(r["body"], r["reason"]) for r in letters] == [(bad, expected)]
    # Every message settled on the receive that brought it: 120 completed, one dead letter,
    # nothing retried or handed back. (SQS, and moto, may deliver a message twice at once:
    # such a copy is deferred as contention and acked as a duplicate, never retried.)
    assert (delta["completed"], delta["dead_lettered"], delta["retried"]) == (120, 1, 0), delta


async def test_a_json_bomb_is_dead_lettered_unparsed_beside_healthy_messages(
    sqs_client: Any, queue_url: str, sqs_endpoint: str, database_url: str,
    db: asyncpg.Connection,
) -> None:
    """Security review, issue 42: 210 kB of ``[{},{},…]`` is 5 MiB of Python objects once
    parsed (26 times its size), held until its batch ends — ten receives of such bodies and
    the daemon was over its memory limit. With the default INGEST_MAX_JSON_VALUES it is a
    poison message (payload_too_complex), its body byte for byte, while the healthy
    messages sent with it complete."""
    from service.core.limits import MAX_JSON_VALUES, json_values

    junk: list[dict[str, int]] = [{}] * 70_000
    bomb = json.dumps({"request_id": "bomb", "type": "entity.upsert",
                       "payload": {"entity_id": "e-bomb", "version": 1, "data": {"junk": junk}}},
                      separators=(",", ":"))
    assert MAX_JSON_VALUES < json_values(bomb) and len(bomb) < 256 * 1024
    healthy = [upsert(f"r{i}", f"e{i}") for i in range(9)]
    sqs_client.send_message_batch(QueueUrl=queue_url, Entries=[
        {"Id": str(i), "MessageBody": b} for i, b in enumerate([*healthy[:4], bomb, *healthy[4:]])])
    async with running_worker(make_settings(queue_url, database_url, sqs_endpoint)):
        async def settled() -> bool:
            done = await db.fetchval(
                "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'")
            letters = await db.fetchval("SELECT count(*) FROM dead_letters")
            return bool(done == 9 and letters == 1)
        await eventually(settled, "9 completed and one dead letter")
    letter = await db.fetchrow("SELECT body, reason, error FROM dead_letters")
    assert (letter["body"], letter["reason"]) == (bomb, "payload_too_complex")
    assert f"INGEST_MAX_JSON_VALUES is {MAX_JSON_VALUES}" in letter["error"]
    assert await db.fetchval("SELECT count(*) FROM modifications WHERE request_id = 'bomb'") == 0

"""Dev tool: send sample messages — valid, duplicate, SNS-wrapped, poison, reused key."""

from __future__ import annotations

import json
import random
from argparse import Namespace  # noqa: F401  (documented signature)
from datetime import UTC, datetime

from service.adapters.sqs import SqsQueue, sqs_client
from service.settings import Settings


def sample_bodies(count: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    bodies: list[str] = []
    now = datetime.now(UTC).isoformat()
    for i in range(count):
        rid = f"sample-{seed}-{i}"
        kind = rng.random()
        if kind < 0.1:
            doc = {"request_id": rid, "type": "entity.delete",
                   "payload": {"entity_id": f"e{rng.randrange(10)}", "version": i + 1}}
        else:
            doc = {"request_id": rid, "type": "entity.upsert", "sent_at": now,
                   "payload": {"entity_id": f"e{rng.randrange(10)}", "version": i + 1,
                               "data": {"n": i}}}
        body = json.dumps(doc)
        bodies.append(body)
        if i % 5 == 0:
            bodies.append(body)  # a duplicate delivery
        if i % 7 == 0:
            bodies.append(json.dumps({"Type": "Notification", "Message": body}))  # SNS-wrapped
    bodies.append("this is not json {")
    bodies.append(json.dumps({"request_id": "x", "type": "no.such.type", "payload": {}}))
    bodies.append(json.dumps({"request_id": f"sample-{seed}-0", "type": "entity.upsert",
                              "payload": {"entity_id": "e0", "version": 1, "data": {"n": -1}}}))
    return bodies


async def main(settings: Settings, count: int, seed: int) -> int:
    bodies = sample_bodies(count, seed)
    async with sqs_client(settings.aws_region, settings.sqs_endpoint_url) as client:
        queue = SqsQueue(client, settings.queue_url)
        group = "samples" if settings.is_fifo else None
        for body in bodies:
            await queue.send(body, group)
    print(f"sent {len(bodies)} sample message(s) to {settings.queue_url}")
    return 0

"""Sends a dead letter's raw body back to the queue (with a FIFO group and deduplication id)."""

from __future__ import annotations

import re
from typing import Any

from service.ops.dlq.letters import Letter, Send

FIFO_DEFAULT_GROUP = "dlq-replay"
# SQS: MessageGroupId / MessageDeduplicationId are 1-128 chars of printable ASCII.
_SQS_TOKEN = re.compile(r"^[\x21-\x7e]{1,128}$")


def sqs_sender(client: Any, queue_url: str) -> Send:
    """A ``Send`` through an aiobotocore SQS client.

    On a FIFO queue: ``MessageGroupId`` = the group the message came with (kept with the
    letter), else — a letter stored before dead_letters kept it, or from a standard
    queue — the letter's ``request_id`` (so replays of one request stay ordered) or
    ``dlq-replay``; and ``MessageDeduplicationId`` = ``dlq-<id>``
    so a re-send after a crash is dropped by SQS within its deduplication window, even on
    a queue without content-based deduplication.
    """
    fifo = queue_url.rstrip("/").endswith(".fifo")

    async def send(letter: Letter) -> str:
        kwargs: dict[str, Any] = {"QueueUrl": queue_url, "MessageBody": letter.body}
        if fifo:
            kwargs["MessageGroupId"] = next(
                (g for g in (letter.group_id, letter.request_id)
                 if g is not None and _SQS_TOKEN.match(g)), FIFO_DEFAULT_GROUP)
            kwargs["MessageDeduplicationId"] = f"dlq-{letter.id}"
        resp = await client.send_message(**kwargs)
        return str(resp["MessageId"])

    return send

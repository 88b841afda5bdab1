"""``SqsQueue.requeue`` on a delay queue (queue attribute ``DelaySeconds``): a copy that
replaces a message released at once (shutdown, a FIFO group handed back: delay 0) must be
visible at once, as the released original would have been. Without an explicit
``DelaySeconds=0`` on the entry, SQS applies the queue's own delay to the copy: the message
waits up to 15 minutes a second time."""

from __future__ import annotations

import uuid

from service.adapters.sqs import SqsQueue, sqs_client


async def test_copy_released_at_once_is_not_delayed_by_the_queue_delay(
    sqs_endpoint: str,
) -> None:
    async with sqs_client("us-east-1", sqs_endpoint) as client:
        url = (await client.create_queue(
            QueueName=f"delayq-{uuid.uuid4().hex[:10]}",
            Attributes={"DelaySeconds": "0", "VisibilityTimeout": "30"}))["QueueUrl"]
        await client.send_message(QueueUrl=url, MessageBody='{"k": 1}')
        q = SqsQueue(client, url)
        [original] = await q.receive(10, 1, 30)
        # The queue becomes a delay queue after the send (or was one, and the producer sent
        # with DelaySeconds=0): its delay applies to every send that does not say otherwise.
        await client.set_queue_attributes(QueueUrl=url, Attributes={"DelaySeconds": "60"})

        assert await q.requeue([(original, 0)]) == []

        got = await q.receive(10, 2, 30)
        assert [m.body for m in got] == [original.body], "the copy waits out the queue delay"
        assert got[0].message_id != original.message_id

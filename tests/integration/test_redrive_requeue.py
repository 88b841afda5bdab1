"""``SqsQueue.requeue`` against LocalStack's SQS: a deferred message replaced by a fresh copy
(new receive count) keeps its body, its message attributes (types and binary values) and,
on a FIFO queue with content-based deduplication, is not swallowed as a duplicate of the
original it replaces."""

from __future__ import annotations

import uuid

import pytest

from service.adapters.sqs import SqsQueue, sqs_client

ATTRIBUTES = {
    "tenant": {"DataType": "String", "StringValue": "acme"},
    "weight": {"DataType": "Number", "StringValue": "3.5"},
    "blob": {"DataType": "Binary", "BinaryValue": b"\x00\xffraw"},
}


@pytest.mark.parametrize("fifo", [False, True], ids=["standard", "fifo-content-dedup"])
async def test_requeue_sends_a_fresh_copy_and_deletes_the_original(
    localstack: str, fifo: bool
) -> None:
    async with sqs_client("us-east-1", localstack) as client:
        name = f"requeue-{uuid.uuid4().hex[:10]}" + (".fifo" if fifo else "")
        attrs = {"FifoQueue": "true", "ContentBasedDeduplication": "true"} if fifo else {}
        url = (await client.create_queue(QueueName=name, Attributes=attrs))["QueueUrl"]
        send = {"MessageGroupId": "g1"} if fifo else {}
        await client.send_message(QueueUrl=url, MessageBody='{"k": "v \u00e9"}',
                                  MessageAttributes=ATTRIBUTES, **send)
        q = SqsQueue(client, url)
        [original] = await q.receive(10, 1, 30)
        [again] = [original]
        for _ in range(2):  # a third receive: the count is the original's, 2 by now
            assert await q.change_visibility_batch([(again, 0)]) == []
            [again] = await q.receive(10, 1, 30)
        assert again.receive_count == 3

        assert await q.requeue([(again, 0)]) == []

        [copy] = await q.receive(10, 2, 30)
        assert copy.message_id != original.message_id
        assert copy.receive_count == 1
        assert copy.body == original.body
        assert copy.message_attributes == original.message_attributes
        assert {k: v["DataType"] for k, v in (copy.message_attributes or {}).items()} == {
            "tenant": "String", "weight": "Number", "blob": "Binary"}
        assert copy.group_id == ("g1" if fifo else None)
        await q.delete_batch([copy])
        # The original is gone too (not merely hidden): the queue holds nothing.
        left = await q.attributes()
        assert (left["ApproximateNumberOfMessages"],
                left["ApproximateNumberOfMessagesNotVisible"]) == ("0", "0")


async def test_requeue_of_large_messages_splits_the_batch_by_size(localstack: str) -> None:
    """SendMessageBatch refuses a whole call whose bodies and attributes add up to more than
    SQS's batch payload limit (BatchRequestTooLong). Ten inline messages of 200 KB each (a
    common size just under the extended clients' 256 KB threshold) must still be replaced
    by copies — as one refused call they would all fall back to plain hand-backs and spend
    their last receives."""
    async with sqs_client("us-east-1", localstack) as client:
        url = (await client.create_queue(QueueName=f"requeue-big-{uuid.uuid4().hex[:10]}"))[
            "QueueUrl"]
        for i in range(10):
            await client.send_message(QueueUrl=url, MessageBody=f"{i:02d}" + "x" * 200_000,
                                      MessageAttributes=ATTRIBUTES)
        q = SqsQueue(client, url)
        received: list = []
        while len(received) < 10:
            received += await q.receive(10, 1, 60)

        assert await q.requeue([(m, 0) for m in received]) == []

        copies: list = []
        while len(copies) < 10:
            copies += await q.receive(10, 1, 60)
        assert sorted(c.body for c in copies) == sorted(m.body for m in received)
        assert {c.message_id for c in copies}.isdisjoint(m.message_id for m in received)
        assert all(c.receive_count == 1 for c in copies)
        await q.delete_batch(copies)

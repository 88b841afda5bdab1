"""One queue contract, two queues: every test runs over the in-memory ``FakeQueue`` and over
the real ``SqsQueue`` (aiobotocore) on the moto SQS server. A fake that drifts from what the
worker meets on SQS fails here. (moto accepts stale receipt handles and never answers
MessageNotInflight: those paths are not part of this contract.)"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

import pytest

from service.adapters.sqs import SqsQueue, sqs_client
from service.core.messages import Received
from service.core.seams import QueueSeam
from service.testing import FakeQueue

ATTRS = {"tenant": {"DataType": "String", "StringValue": "acme"}}


class Backend(Protocol):
    queue: QueueSeam

    async def send(self, body: str, attributes: dict[str, Any] | None = None) -> str: ...


class FakeBackend:
    def __init__(self) -> None:
        self.fake = FakeQueue()
        self.queue: QueueSeam = self.fake

    async def send(self, body: str, attributes: dict[str, Any] | None = None) -> str:
        return self.fake.send(body, message_attributes=attributes)


class SqsBackend:
    def __init__(self, client: Any, url: str) -> None:
        self.client = client
        self.real = SqsQueue(client, url)
        self.queue: QueueSeam = self.real

    async def send(self, body: str, attributes: dict[str, Any] | None = None) -> str:
        kw: dict[str, Any] = {"MessageAttributes": attributes} if attributes else {}
        resp = await self.client.send_message(QueueUrl=self.real.queue_url, MessageBody=body,
                                              **kw)
        return str(resp["MessageId"])


@pytest.fixture(params=["fake", "sqs"])
async def backend(request: pytest.FixtureRequest, sqs_endpoint: str) -> AsyncIterator[Backend]:
    if request.param == "fake":
        yield FakeBackend()
        return
    async with sqs_client("us-east-1", sqs_endpoint) as client:
        url = (await client.create_queue(QueueName="contract-" + uuid.uuid4().hex[:12],
                                         Attributes={"VisibilityTimeout": "30"}))["QueueUrl"]
        yield SqsBackend(client, url)


async def receive_all(q: QueueSeam, n: int, visibility: int = 30) -> list[Received]:
    """Up to ``n`` messages (a few short polls: SQS may answer with fewer than there are)."""
    out: list[Received] = []
    for _ in range(5):
        out += await q.receive(10, 0, visibility)
        if len(out) >= n:
            break
    return out


async def test_a_received_message_is_hidden_then_back_with_its_receive_count(
    backend: Backend,
) -> None:
    mid = await backend.send("b1", ATTRS)
    [m] = await receive_all(backend.queue, 1)
    assert (m.message_id, m.body, m.receive_count) == (mid, "b1", 1)
    assert m.message_attributes == ATTRS
    assert m.sent_timestamp is not None
    assert await backend.queue.receive(10, 0, 30) == []  # hidden for its visibility
    assert await backend.queue.change_visibility_batch([(m, 0)]) == []
    [again] = await receive_all(backend.queue, 1)
    assert (again.message_id, again.receive_count) == (mid, 2)
    assert again.receipt_handle != m.receipt_handle


async def test_deleted_messages_are_gone_and_the_depth_says_so(backend: Backend) -> None:
    for i in range(3):
        await backend.send(f"b{i}")
    attrs = await backend.queue.attributes()
    assert attrs["ApproximateNumberOfMessages"] == "3"
    got = await receive_all(backend.queue, 3)
    assert sorted(m.body for m in got) == ["b0", "b1", "b2"]
    attrs = await backend.queue.attributes()
    assert (attrs["ApproximateNumberOfMessages"],
            attrs["ApproximateNumberOfMessagesNotVisible"]) == ("0", "3")
    await backend.queue.delete_batch(got[:2])
    assert await backend.queue.change_visibility_batch([(got[2], 0)]) == []
    [left] = await receive_all(backend.queue, 1)
    assert left.body == got[2].body
    await backend.queue.delete_batch([left])
    attrs = await backend.queue.attributes()
    assert (attrs["ApproximateNumberOfMessages"],
            attrs["ApproximateNumberOfMessagesNotVisible"]) == ("0", "0")


async def test_requeue_replaces_a_message_by_a_fresh_copy(backend: Backend) -> None:
    mid = await backend.send("payload", ATTRS)
    [m] = await receive_all(backend.queue, 1)
    assert await backend.queue.change_visibility_batch([(m, 0)]) == []
    [m] = await receive_all(backend.queue, 1)
    assert m.receive_count == 2
    assert await backend.queue.requeue([(m, 0)]) == []
    [copy] = await receive_all(backend.queue, 1)
    assert copy.message_id != mid
    assert (copy.body, copy.receive_count, copy.message_attributes) == ("payload", 1, ATTRS)
    await backend.queue.delete_batch([copy])
    assert await backend.queue.receive(10, 0, 30) == []  # the original went with its copy

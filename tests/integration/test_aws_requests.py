"""``sqs_ingest_aws_requests_total`` counts what AWS bills: every HTTP request a client of the
daemon's session sends — each attempt of a retried call too — by service and action, exactly
as a counting proxy in front of moto's SQS sees them (tests/faultproxy.py)."""

from __future__ import annotations

from typing import Any

import pytest
from aiobotocore.session import get_session

from service.adapters.sqs import SqsQueue
from service.adapters.sqs import sqs_client as aio_sqs_client
from service.errors import AckFailed
from service.observe import metrics
from tests.faultproxy import FaultProxy

ACTIONS = ("ReceiveMessage", "DeleteMessageBatch", "GetQueueAttributes")


def requests(action: str) -> float:
    return metrics.REGISTRY.get_sample_value(
        "sqs_ingest_aws_requests_total", {"service": "sqs", "operation": action}) or 0.0


async def test_every_request_is_counted_by_action_each_attempt_of_a_retried_call_too(
        sqs_client: Any, queue_url: str, sqs_endpoint: str) -> None:
    for i in range(3):
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=f'{{"n": {i}}}')
    before = {a: requests(a) for a in ACTIONS}
    session = get_session()
    metrics.count_aws_requests(session)
    with FaultProxy(sqs_endpoint) as proxy:
        async with aio_sqs_client("us-east-1", proxy.url, session=session) as client:
            queue = SqsQueue(client, queue_url)
            got = await queue.receive(10, 0, 30)
            assert len(got) == 3
            await queue.attributes()
            proxy.mode = "refuse"  # DeleteMessageBatch answered 500: botocore retries it
            with pytest.raises(AckFailed):
                await queue.delete_batch(got)
            proxy.mode = None
            await queue.delete_batch(got)
    counted = {a: requests(a) - before[a] for a in ACTIONS}
    assert set(proxy.by_action) == set(ACTIONS)
    assert counted == {a: float(proxy.by_action[a]) for a in ACTIONS}
    # one call refused: each of botocore's attempts at it counted, then the delete that passed
    assert proxy.faults_injected > 1
    assert counted["DeleteMessageBatch"] == proxy.faults_injected + 1


async def test_a_session_not_counted_adds_nothing(
        sqs_client: Any, queue_url: str, sqs_endpoint: str) -> None:
    """The count is the daemon's session's (app.py, the results sink): a client of another
    session — an operator command's, a test's — is not in it."""
    before = requests("GetQueueAttributes")
    async with aio_sqs_client("us-east-1", sqs_endpoint, session=get_session()) as client:
        await SqsQueue(client, queue_url).attributes()
    assert requests("GetQueueAttributes") == before

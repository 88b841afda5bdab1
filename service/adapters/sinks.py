"""The results destinations (SPEC §5): an SNS topic (PublishBatch) or an SQS queue
(SendMessageBatch) through aiobotocore — the adapters behind ``seams.ResultsSink`` that
``service.runtime.results.Publisher`` sends the outbox through. botocore's errors stop here
(``TransientError``)."""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import structlog
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from service.adapters.useragent import user_agent
from service.core.seams import OutboxRow, ResultsSink, Sent
from service.errors import TransientError
from service.observe import metrics
from service.settings import Settings

log = structlog.get_logger("sqs_ingest.results")

# MessageDeduplicationId / MessageGroupId: up to 128 of these characters.
_SQS_ID = re.compile(r"[A-Za-z0-9!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~]{1,128}")


def fifo_id(value: str) -> str:
    """``value`` when SQS/SNS accept it as a deduplication or group id; otherwise (a longer
    id, or characters outside ASCII punctuation/alphanumerics) its SHA-256, stable for the
    same value, so deduplication still holds."""
    if _SQS_ID.fullmatch(value):
        return value
    return "sha256-" + hashlib.sha256(value.encode()).hexdigest()


def entry(index: int, row: OutboxRow, fifo: bool) -> dict[str, Any]:
    """One batch entry, in the shape both PublishBatch and SendMessageBatch take (the body
    key differs: see the sinks)."""
    e: dict[str, Any] = {
        "Id": str(index),
        "MessageAttributes": {
            "request_id": {"DataType": "String", "StringValue": row.request_id}},
    }
    if fifo:
        # A republish after a crash (sent, not yet marked) is absorbed by the destination.
        e["MessageDeduplicationId"] = fifo_id(f"{row.request_id}:{row.status}")
        # The source's group (the producer's ordering key) keeps its order; without one
        # (standard source) there is no order to keep: the request is its own group.
        e["MessageGroupId"] = fifo_id(row.group_id or row.request_id)
    return e


#: Entry errors about the entry itself (a character SQS/SNS do not take, an attribute or a
#: body over their limits): refused again on every try. Only these: a SenderFault such as
#: KMS.AccessDeniedException is the destination's configuration, and its results must wait
#: for the fix, not be given up. (LocalStack answers a body holding U+FFFF with
#: InvalidMessageContents and SenderFault=false, an attribute with
#: InvalidParameterValueException.)
_REFUSED_CODES = frozenset({
    "InvalidMessageContents", "InvalidParameterValue", "InvalidParameterValueException",
    "InvalidParameter", "MessageTooLong", "InvalidAttributeValue", "InvalidAttributeName",
})


def _for_good(failure: dict[str, Any]) -> bool:
    return failure.get("Code") in _REFUSED_CODES


def _accepted(rows: Sequence[OutboxRow], resp: dict[str, Any], what: str) -> Sent:
    """The ids accepted, and those refused for good (``_REFUSED_CODES``): such an entry is
    refused on every try, and left pending it would be claimed before every later result
    for ever."""
    failed = resp.get("Failed") or []
    transient = [f for f in failed if not _for_good(f)]
    if transient:
        metrics.results_publish_failures.inc(len(transient))
        log.warning("results_entries_failed", operation=what,
                    errors=sorted({f"{f.get('Code')}: {f.get('Message', '')}"
                                   for f in transient}))
    ok = {int(s["Id"]) for s in resp.get("Successful") or []}
    refused = {rows[int(f["Id"])].id: f"{f.get('Code')}: {f.get('Message', '')}"[:1000]
               for f in failed if _for_good(f)}
    return Sent({rows[i].id for i in ok}, refused)


#: SNS publishes at most 256 KiB a message.
SNS_MAX_MESSAGE_BYTES = 256 * 1024


class SnsSink:
    """An SNS topic (PublishBatch); FIFO when its ARN ends in ``.fifo``."""

    def __init__(self, client: Any, topic_arn: str) -> None:
        self._client = client
        self.topic_arn = topic_arn
        self.fifo = topic_arn.endswith(".fifo")
        self.max_message_bytes = SNS_MAX_MESSAGE_BYTES

    async def send(self, rows: Sequence[OutboxRow], bodies: Sequence[str]) -> Sent:
        entries = [{**entry(i, r, self.fifo), "Message": b}
                   for i, (r, b) in enumerate(zip(rows, bodies, strict=True))]
        try:
            resp = await self._client.publish_batch(
                TopicArn=self.topic_arn, PublishBatchRequestEntries=entries)
        except (ClientError, BotoCoreError) as exc:
            raise TransientError(f"PublishBatch failed: {exc}") from exc
        return _accepted(rows, resp, "publish_batch")


class SqsSink:
    """An SQS queue (SendMessageBatch); FIFO when its URL ends in ``.fifo``."""

    def __init__(self, client: Any, queue_url: str, max_message_bytes: int = 256 * 1024) -> None:
        self._client = client
        self.queue_url = queue_url
        self.fifo = queue_url.rstrip("/").endswith(".fifo")
        # The queue's MaximumMessageSize (up to 1 MiB): a result up to it leaves whole.
        self.max_message_bytes = max_message_bytes

    async def read_max_message_bytes(self) -> None:
        """Take the queue's own MaximumMessageSize (one GetQueueAttributes at start; on
        failure the 256 KiB every queue accepts stays)."""
        try:
            resp = await self._client.get_queue_attributes(
                QueueUrl=self.queue_url, AttributeNames=["MaximumMessageSize"])
            self.max_message_bytes = int(resp["Attributes"]["MaximumMessageSize"])
        except (ClientError, BotoCoreError, KeyError, ValueError) as exc:
            log.warning("results_queue_size_unknown", error=str(exc),
                        using=self.max_message_bytes)

    async def send(self, rows: Sequence[OutboxRow], bodies: Sequence[str]) -> Sent:
        entries = [{**entry(i, r, self.fifo), "MessageBody": b}
                   for i, (r, b) in enumerate(zip(rows, bodies, strict=True))]
        try:
            resp = await self._client.send_message_batch(QueueUrl=self.queue_url,
                                                         Entries=entries)
        except (ClientError, BotoCoreError) as exc:
            raise TransientError(f"SendMessageBatch failed: {exc}") from exc
        return _accepted(rows, resp, "send_message_batch")


@contextlib.asynccontextmanager
async def results_sink(settings: Settings) -> AsyncIterator[ResultsSink]:
    """The configured destination with its own aiobotocore client (its own endpoint too:
    ``INGEST_RESULTS_ENDPOINT_URL``, default ``INGEST_SQS_ENDPOINT_URL``)."""
    service = "sns" if settings.results_topic_arn else "sqs"
    session = get_session()
    metrics.count_aws_requests(session)
    config = AioConfig(connect_timeout=5, read_timeout=settings.results_send_timeout,
                       retries={"max_attempts": 2, "mode": "standard"},
                       # Entries are built here from typed values (as in service.adapters.sqs).
                       parameter_validation=False, user_agent=user_agent(session))
    endpoint = settings.results_endpoint_url or settings.sqs_endpoint_url
    async with session.create_client(
        service, region_name=settings.aws_region, endpoint_url=endpoint, config=config
    ) as client:
        if settings.results_topic_arn:
            yield SnsSink(client, settings.results_topic_arn)
        else:
            assert settings.results_queue_url is not None
            sink = SqsSink(client, settings.results_queue_url)
            await sink.read_max_message_bytes()
            yield sink

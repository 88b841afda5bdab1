"""The queue seam: long-poll receive, batch delete, batch visibility changes (aiobotocore)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.exceptions import BotoCoreError, ClientError

from service.adapters.coalesce import DeleteCoalescer
from service.adapters.useragent import user_agent
from service.core.messages import Received
from service.core.seams import QueueSeam
from service.errors import AckFailed, TransientError
from service.observe import tracing

T = TypeVar("T")

__all__ = ["QueueSeam", "SqsQueue", "sqs_client"]

#: A DeleteMessageBatch that raised any of these may or may not have deleted: botocore's
#: errors, and what aiohttp or the socket raise past it (a response cut off, a reset, a
#: timeout — TimeoutError is an OSError). Each is an ack failure (exit 3), never a
#: generic batch failure that would release messages whose outcome is committed.
_ACK_ERRORS = (ClientError, BotoCoreError, aiohttp.ClientError, OSError)

RECEIVE_ATTRIBUTES = [
    "ApproximateReceiveCount", "SentTimestamp", "MessageGroupId", "SequenceNumber"]


class SqsQueue:
    """One SQS queue through an aiobotocore client."""

    def __init__(self, client: Any, queue_url: str, delete_linger: float = 0.0) -> None:
        self._client = client
        self.queue_url = queue_url
        # Small batches' deletes gathered into one call for up to delete_linger seconds.
        self._deletes = DeleteCoalescer(self._delete_now, delete_linger)

    async def receive(
        self, max_messages: int = 10, wait_seconds: int = 20, visibility_timeout: int | None = None
    ) -> list[Received]:
        kwargs: dict[str, Any] = {
            "QueueUrl": self.queue_url,
            "MaxNumberOfMessages": max_messages,
            "WaitTimeSeconds": wait_seconds,
            "MessageSystemAttributeNames": RECEIVE_ATTRIBUTES,
            # Kept with the request (modifications.message_attributes) and shown to handlers.
            "MessageAttributeNames": ["All"],
        }
        if visibility_timeout:
            kwargs["VisibilityTimeout"] = visibility_timeout
        traced = tracing.enabled()
        if traced:
            # The producer's trace context: W3C message attributes, X-Ray system attribute.
            kwargs["MessageSystemAttributeNames"] = [*RECEIVE_ATTRIBUTES, "AWSTraceHeader"]
        try:
            resp = await self._client.receive_message(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise TransientError(f"ReceiveMessage failed: {exc}") from exc
        out = []
        for m in resp.get("Messages", []):
            attrs = m.get("Attributes", {})
            sent = attrs.get("SentTimestamp")
            out.append(
                Received(
                    message_id=m["MessageId"],
                    receipt_handle=m["ReceiptHandle"],
                    body=m["Body"],
                    receive_count=int(attrs.get("ApproximateReceiveCount", "1")),
                    sent_timestamp=int(sent) / 1000.0 if sent else None,
                    group_id=attrs.get("MessageGroupId"),
                    sequence_number=_int_or_none(attrs.get("SequenceNumber")),
                    attributes=_strings(m["MessageAttributes"])
                    if traced and "MessageAttributes" in m else None,
                    trace_header=attrs.get("AWSTraceHeader"),
                    message_attributes=m.get("MessageAttributes"),
                )
            )
        return out

    @property
    def delete_linger(self) -> float:
        return self._deletes.linger

    @delete_linger.setter
    def delete_linger(self, seconds: float) -> None:
        self._deletes.linger = seconds

    def on_unawaited_ack_failure(self, report: Callable[[AckFailed], None]) -> None:
        """``report`` hears of a failed delete whose batch no longer waits for it."""
        self._deletes.on_unawaited_failure = report

    async def drain_deletes(self) -> None:
        """Send the deletes that linger and wait for those in flight (shutdown)."""
        await self._deletes.drain()

    async def delete_batch(self, messages: Sequence[Received]) -> None:
        """Delete ``messages`` (with other small batches' within the linger). Raises
        AckFailed naming those of ``messages`` whose delete failed."""
        await self._deletes.delete_batch(messages)

    async def _delete_now(self, messages: Sequence[Received]) -> None:
        """Delete up to any number of messages, 10 per call. Raises AckFailed on any failure."""
        for start in range(0, len(messages), 10):
            chunk = messages[start : start + 10]
            entries = [
                {"Id": str(i), "ReceiptHandle": m.receipt_handle} for i, m in enumerate(chunk)
            ]
            try:
                resp = await self._client.delete_message_batch(
                    QueueUrl=self.queue_url, Entries=entries
                )
            except _ACK_ERRORS as exc:
                raise AckFailed([m.message_id for m in chunk],
                                str(exc) or type(exc).__name__) from exc
            failed = resp.get("Failed") or []
            if failed:
                ids = [chunk[int(f["Id"])].message_id for f in failed]
                detail = "; ".join(f"{f.get('Code')}: {f.get('Message', '')}" for f in failed)
                raise AckFailed(ids, detail)

    async def change_visibility_batch(self, changes: Sequence[tuple[Received, int]]) -> list[str]:
        """Set visibility per message; returns the message ids whose change failed."""
        failed_ids: list[str] = []
        for start in range(0, len(changes), 10):
            chunk = changes[start : start + 10]
            entries = [
                {"Id": str(i), "ReceiptHandle": m.receipt_handle, "VisibilityTimeout": int(t)}
                for i, (m, t) in enumerate(chunk)
            ]
            try:
                resp = await self._client.change_message_visibility_batch(
                    QueueUrl=self.queue_url, Entries=entries
                )
            except (ClientError, BotoCoreError):
                failed_ids.extend(m.message_id for m, _ in chunk)
                continue
            failed_ids.extend(chunk[int(f["Id"])][0].message_id for f in resp.get("Failed") or [])
        return failed_ids

    async def requeue(self, changes: Sequence[tuple[Received, int]]) -> list[str]:
        """Replace each message by a fresh copy (new receive count), visible after its delay;
        the original is deleted only once its copy was accepted. Returns the ids of the
        messages not replaced (copy refused, or original not deleted: then both exist, a
        duplicate the idempotent claim absorbs).

        FIFO: same MessageGroupId, and a deduplication id of its own — with content-based
        deduplication the identical body would otherwise be dropped as a duplicate of the
        original for five minutes, after the original was deleted. Standard queues keep the
        delay with DelaySeconds (at most 15 minutes); FIFO queues have no per-message delay.
        """
        failed_ids: list[str] = []
        fifo = self.queue_url.rstrip("/").endswith(".fifo")
        for chunk in batched_by_size(changes, lambda c: _message_size(c[0])):
            entries = [_copy_entry(str(i), m, delay, fifo) for i, (m, delay) in enumerate(chunk)]
            try:
                resp = await self._client.send_message_batch(
                    QueueUrl=self.queue_url, Entries=entries)
            except (ClientError, BotoCoreError):
                failed_ids.extend(m.message_id for m, _ in chunk)
                continue
            refused = {int(f["Id"]) for f in resp.get("Failed") or []}
            failed_ids.extend(chunk[i][0].message_id for i in sorted(refused))
            sent = [m for i, (m, _) in enumerate(chunk) if i not in refused]
            try:
                await self.delete_batch(sent)
            except AckFailed as exc:
                failed_ids.extend(exc.message_ids)
        return failed_ids

    async def attributes(self) -> dict[str, str]:
        try:
            resp = await self._client.get_queue_attributes(
                QueueUrl=self.queue_url, AttributeNames=["All"]
            )
        except (ClientError, BotoCoreError) as exc:
            raise TransientError(f"GetQueueAttributes failed: {exc}") from exc
        return dict(resp.get("Attributes", {}))

    async def send(self, body: str, group_id: str | None = None) -> str:
        kwargs: dict[str, Any] = {"QueueUrl": self.queue_url, "MessageBody": body}
        if group_id is not None:
            kwargs["MessageGroupId"] = group_id
        resp = await self._client.send_message(**kwargs)
        return str(resp["MessageId"])


#: SendMessageBatch refuses a whole call (BatchRequestTooLong) whose bodies and attributes add
#: up to more than the batch payload limit (1 MiB on AWS today; 256 KiB on queues and
#: emulators that predate it): copies are grouped to stay under the smaller one. A message
#: that is larger on its own goes alone (it was accepted alone once).
SEND_BATCH_MAX_BYTES = 256 * 1024


def _message_size(m: Received) -> int:
    """What SQS counts against the batch limit: the body, and each attribute's name, type
    and value."""
    size = len(m.body.encode("utf-8", "surrogatepass"))
    for name, a in (m.message_attributes or {}).items():
        size += len(name.encode()) + len(str(a.get("DataType", "")).encode())
        v = a.get("BinaryValue", a.get("StringValue", ""))
        size += len(v) if isinstance(v, bytes | bytearray) else len(str(v).encode())
    return size


def batched_by_size(items: Sequence[T], size_of: Callable[[T], int]) -> list[list[T]]:
    """``items`` in order, in batch calls of at most 10 entries and ``SEND_BATCH_MAX_BYTES``
    (SendMessageBatch, and SNS PublishBatch, which has the same limits); an item larger on
    its own goes alone."""
    out: list[list[T]] = []
    chunk: list[T] = []
    used = 0
    for item in items:
        size = size_of(item)
        if chunk and (len(chunk) == 10 or used + size > SEND_BATCH_MAX_BYTES):
            out.append(chunk)
            chunk, used = [], 0
        chunk.append(item)
        used += size
    if chunk:
        out.append(chunk)
    return out


def _copy_entry(entry_id: str, m: Received, delay: int, fifo: bool) -> dict[str, Any]:
    """A SendMessageBatch entry that carries ``m`` again: body byte for byte, its message
    attributes as received (types and binary values too), the X-Ray trace header."""
    entry: dict[str, Any] = {"Id": entry_id, "MessageBody": m.body}
    if m.message_attributes:
        entry["MessageAttributes"] = {
            k: {f: v[f] for f in ("DataType", "StringValue", "BinaryValue") if f in v}
            for k, v in m.message_attributes.items()}
    if m.trace_header:
        entry["MessageSystemAttributes"] = {
            "AWSTraceHeader": {"DataType": "String", "StringValue": m.trace_header}}
    if fifo:
        entry["MessageGroupId"] = m.group_id or "sqs-ingest-requeue"
        entry["MessageDeduplicationId"] = f"requeue-{m.message_id}"[:128]
    else:
        # Always explicit: without it a delay queue's own DelaySeconds would hold back a copy
        # meant to be visible at once (a release at shutdown) a second time.
        entry["DelaySeconds"] = max(0, min(int(delay), 900))
    return entry


def _strings(attributes: dict[str, Any]) -> dict[str, str]:
    return {k: v["StringValue"] for k, v in attributes.items() if "StringValue" in v}


@contextlib.asynccontextmanager
async def sqs_client(
    region: str, endpoint_url: str | None, max_pool_connections: int = 50,
    session: Any = None,
) -> AsyncIterator[Any]:
    """An aiobotocore SQS client; credentials come from the standard AWS chain (the daemon's
    one ``session``, shared with its S3 client)."""
    session = session or get_session()
    config = AioConfig(
        max_pool_connections=max_pool_connections,
        # A long poll holds the connection for up to 20 s.
        read_timeout=40,
        connect_timeout=5,
        retries={"max_attempts": 3, "mode": "standard"},
        # Requests are built by this module from typed values; botocore's per-call
        # validation is measurable CPU on the hot path (BENCHMARKS.md).
        parameter_validation=False,
        user_agent=user_agent(session),
    )
    async with session.create_client(
        "sqs", region_name=region, endpoint_url=endpoint_url, config=config
    ) as client:
        yield client


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:  # not SQS's decimal: no order to enforce from it
        return None

"""S3 payload pointers as values: the pointer a body (or the ``Message`` of an SNS envelope)
carries, and what reading it gave (``Fetched``, ``Refused``, ``Unreachable``). No I/O here:
``service.adapters.payloads`` reads S3, ``service.core.plan`` decides what an unread payload means.

The AWS extended clients (Java ``amazon-sqs-java-extended-client-lib`` /
``amazon-sns-java-extended-client-lib``, Python ``amazon-sqs-extended-client`` /
``amazon-sns-extended-client``) put a payload above their threshold (or every payload, with
``always_through_s3``) in S3 and send instead::

    ["software.amazon.payloadoffloading.PayloadS3Pointer", {"s3BucketName": B, "s3Key": K}]

(``com.amazon.sqs.javamessaging.MessageS3Pointer`` from older Java clients and the Python
clients' ``use_legacy_attribute``), plus a message attribute ``ExtendedPayloadSize``
(legacy ``SQSLargePayloadSize``) with the payload's size. A pointer is recognised by the
body's shape alone: a JSON array is never a valid sqs-ingest message, so nothing valid can
be mistaken for one, and a producer that drops the attribute is still understood.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from service.core.limits import MAX_JSON_VALUES, json_values
from service.s3access import BUCKET_NAME as _BUCKET

#: Pointer classes the extended clients write (current first).
POINTER_CLASSES = frozenset({
    "software.amazon.payloadoffloading.PayloadS3Pointer",
    "com.amazon.sqs.javamessaging.MessageS3Pointer",
})
#: Every pointer class name contains this: the one substring test a plain body pays.
MARK = "S3Pointer"
#: The extended clients' size attributes (current, legacy); kept with the other attributes.
SIZE_ATTRIBUTES = ("ExtendedPayloadSize", "SQSLargePayloadSize")
#: S3's own limits: what no object can have cannot be fetched (and would not fit an index).
S3_KEY_MAX_BYTES = 1024


@dataclass(frozen=True, slots=True)
class Pointer:
    """Where a message's payload is. ``envelope``: the SNS envelope it came in (its
    ``MessageAttributes`` are the message's), None for a raw body."""

    bucket: str
    key: str
    envelope: dict[str, Any] | None = None

    @property
    def uri(self) -> str:
        """``s3://bucket/key``: how the pointer is recorded with its request."""
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True, slots=True)
class Fetched:
    """The payload a pointer points to, read from S3 (the message to parse)."""

    pointer: Pointer
    data: bytes | bytearray


@dataclass(frozen=True, slots=True)
class Refused:
    """A pointer that cannot be resolved, ever: a dead letter with ``reason`` (unless, for a
    missing object, its request is already known: see ``service.core.plan.plan_unresolved``)."""

    pointer: Pointer | None
    # payload_object_missing | payload_too_large | invalid_envelope |
    # payload_bucket_not_allowed | payload_unreadable
    reason: str
    error: str


@dataclass(frozen=True, slots=True)
class Unreachable:
    """S3 failed in a way that may pass (throttling, 5xx, network, access): retry later.
    ``kind``: the ``s3_errors_total`` label; a refusal (S3 answered, and said no) is
    counted against ``INGEST_S3_UNREADABLE_AFTER``."""

    pointer: Pointer
    error: str
    kind: str = "network"

    @property
    def refused(self) -> bool:
        """S3 itself refused this object (403, a KMS key it cannot use, another non-missing
        4xx), as opposed to not answering (network, 5xx, throttling: an outage, no fault
        of the object, never a dead letter)."""
        return self.kind in REFUSAL_KINDS


#: The S3 error kinds that count towards INGEST_S3_UNREADABLE_AFTER.
REFUSAL_KINDS = frozenset({"access_denied", "client"})


Resolution = Fetched | Refused | Unreachable


def find_pointer(body: str) -> Pointer | Refused | None:
    """The pointer in a raw body or in the ``Message`` of an SNS envelope; a Refused for a
    pointer that is malformed; None for anything else (parsed as usual)."""
    if MARK not in body:
        return None
    if json_values(body) > MAX_JSON_VALUES:
        # No pointer holds that many values (an SNS envelope has at most ten attributes);
        # parse() dead-letters such a body unparsed (payload_too_complex).
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    envelope = None
    if isinstance(doc, dict) and doc.get("Type") == "Notification":
        inner = doc.get("Message")
        if not isinstance(inner, str) or MARK not in inner:
            return None
        try:
            envelope, doc = doc, orjson.loads(inner)
        except orjson.JSONDecodeError:
            return None
    if not (isinstance(doc, list) and len(doc) == 2 and doc[0] in POINTER_CLASSES):
        return None
    where = doc[1]
    if not isinstance(where, dict):
        return Refused(None, "invalid_envelope", "S3 pointer: second element is not an object")
    bucket, key = where.get("s3BucketName"), where.get("s3Key")
    if not isinstance(bucket, str) or not _BUCKET.match(bucket):
        return Refused(None, "invalid_envelope",
                       f"S3 pointer: s3BucketName {str(bucket)[:80]!r} is not a bucket name")
    if not isinstance(key, str) or not key or "\x00" in key \
            or len(key.encode("utf-8", "surrogatepass")) > S3_KEY_MAX_BYTES:
        return Refused(None, "invalid_envelope",
                       f"S3 pointer: s3Key is not an S3 key (1 to {S3_KEY_MAX_BYTES} bytes)")
    return Pointer(bucket, key, envelope)

"""Large payloads offloaded to S3 by the AWS extended clients: the pointer a body (or the
``Message`` of an SNS envelope) carries, fetching what it points to, and deleting it after
the request is committed and acked (opt-in).

The extended clients (Java ``amazon-sqs-java-extended-client-lib`` /
``amazon-sns-java-extended-client-lib``, Python ``amazon-sqs-extended-client`` /
``amazon-sns-extended-client``) put a payload above their threshold (or every payload, with
``always_through_s3``) in S3 and send instead::

    ["software.amazon.payloadoffloading.PayloadS3Pointer", {"s3BucketName": B, "s3Key": K}]

(``com.amazon.sqs.javamessaging.MessageS3Pointer`` from older Java clients and the Python
clients' ``use_legacy_attribute``), plus a message attribute ``ExtendedPayloadSize``
(legacy ``SQSLargePayloadSize``) with the payload's size. A pointer is recognised by the
body's shape alone: a JSON array is never a valid sqs-ingest message, so nothing valid can
be mistaken for one, and a producer that drops the attribute is still understood.

Memory: a payload is read only after GetObject's ``Content-Length`` is checked against
``INGEST_MAX_PAYLOAD_BYTES``, into one buffer of exactly that size (chunks are copied in and
dropped), so a batch of ten holds at most ten payloads' bytes while it is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import structlog
from aiobotocore.config import AioConfig
from botocore.exceptions import BotoCoreError, ClientError

from service import metrics
from service.s3access import BUCKET_NAME as _BUCKET
from service.s3access import BUCKETS_VARIABLE, AllowList

if TYPE_CHECKING:
    from service.messages import Received
    from service.plan import Plan
    from service.retry import RetryPolicy
    from service.seams import KnownPointer, StoreSeam

log = structlog.get_logger("sqs_ingest.payloads")

#: Pointer classes the extended clients write (current first).
POINTER_CLASSES = frozenset({
    "software.amazon.payloadoffloading.PayloadS3Pointer",
    "com.amazon.sqs.javamessaging.MessageS3Pointer",
})
#: Every pointer class name contains this: the one substring test a plain body pays.
_MARK = "S3Pointer"
#: The extended clients' size attributes (current, legacy); kept with the other attributes.
SIZE_ATTRIBUTES = ("ExtendedPayloadSize", "SQSLargePayloadSize")
#: S3's own limits: what no object can have cannot be fetched (and would not fit an index).
S3_KEY_MAX_BYTES = 1024
_CHUNK = 64 * 1024
#: What a GetObject and the read of its body raise when S3 or the way to it fails: besides
#: botocore's and the socket's own, aiohttp's ClientPayloadError for a body cut off before
#: its Content-Length (aiobotocore wraps only connection errors). All transient.
_S3_FAILURES: tuple[type[BaseException], ...] = (
    BotoCoreError, OSError, TimeoutError, aiohttp.ClientError)
#: S3 answers these for an object (or bucket) that does not exist.
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchBucket"})


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
    missing object, its request is already known: see ``plan_unresolved``)."""

    pointer: Pointer | None
    # payload_object_missing | payload_too_large | invalid_envelope |
    # payload_bucket_not_allowed | payload_unreadable
    reason: str
    error: str


@dataclass(frozen=True, slots=True)
class Unreachable:
    """S3 failed in a way that may pass (throttling, 5xx, network, access): retry later."""

    pointer: Pointer
    error: str


Resolution = Fetched | Refused | Unreachable

def find_pointer(body: str) -> Pointer | Refused | None:
    """The pointer in a raw body or in the ``Message`` of an SNS envelope; a Refused for a
    pointer that is malformed; None for anything else (parsed as usual)."""
    if _MARK not in body:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    envelope = None
    if isinstance(doc, dict) and doc.get("Type") == "Notification":
        inner = doc.get("Message")
        if not isinstance(inner, str) or _MARK not in inner:
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


def _error_kind(exc: BaseException) -> str:
    """A small, fixed set of labels for ``sqs_ingest_s3_errors_total{kind}``."""
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code in ("AccessDenied", "Forbidden", "403", "InvalidAccessKeyId",
                    "SignatureDoesNotMatch", "ExpiredToken") or status == 403:
            return "access_denied"
        if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                    "503") or status in (429, 503):
            return "throttled"
        if status >= 500:
            return "server"
        return "client"
    return "network"


ERROR_KINDS = ("access_denied", "throttled", "server", "client", "network")
FETCH_OUTCOMES = ("fetched", "missing", "too_large", "error")
DELETE_OUTCOMES = ("deleted", "failed")


def _missing(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in _MISSING_CODES or status == 404


class S3Payloads:
    """Fetches (and, opt-in, deletes) offloaded payloads through an aiobotocore S3 client."""

    def __init__(
        self, client: Any, max_bytes: int, delete_after_ack: bool = False, *,
        allowed: AllowList | str = "", expected_owner: str | None = None,
    ) -> None:
        self._client = client
        self.max_bytes = max_bytes
        self.delete_after_ack = delete_after_ack
        self.allowed = AllowList.parse(allowed) if isinstance(allowed, str) else allowed
        # ExpectedBucketOwner on every call: a bucket of that name in another account
        # (deleted and re-created by someone else) is refused by S3 itself.
        self._owner: dict[str, str] = \
            {"ExpectedBucketOwner": expected_owner} if expected_owner else {}
        self._warned_unset = False

    async def resolve(self, batch: Sequence[Received]) -> dict[str, Resolution]:
        """message_id → resolution for the pointers of a batch, fetched concurrently. A batch
        without pointers costs one substring test per body and no S3 call."""
        found: dict[str, Pointer | Refused] = {}
        for r in batch:
            if _MARK in r.body:
                p = find_pointer(r.body)
                if p is not None:
                    found[r.message_id] = p
        if not found:
            return {}
        done = await asyncio.gather(*(
            self.fetch(p) if isinstance(p, Pointer) else _same(p) for p in found.values()))
        return dict(zip(found, done, strict=True))

    async def fetch(self, p: Pointer) -> Resolution:
        if not self.allowed.admits(p):
            # Checked before any S3 call: a bucket outside the list is never read.
            if not self.allowed and not self._warned_unset:
                self._warned_unset = True
                log.warning("s3_pointers_not_read",
                            hint=f"set {BUCKETS_VARIABLE} to the buckets the producers "
                                 "offload to; pointers are dead-lettered as "
                                 "payload_bucket_not_allowed until then")
            # No GetObject: counted by dead_letters_total{reason} alone.
            return Refused(p, "payload_bucket_not_allowed", self.allowed.why_not(p.uri))
        try:
            resp = await self._client.get_object(Bucket=p.bucket, Key=p.key, **self._owner)
        except ClientError as exc:
            if _missing(exc):
                metrics.s3_fetches.labels("missing").inc()
                return Refused(p, "payload_object_missing", f"{p.uri}: {_describe(exc)}")
            return self._unreachable(p, exc)
        except _S3_FAILURES as exc:
            return self._unreachable(p, exc)
        body = resp["Body"]
        size = resp.get("ContentLength")
        if size is None or size > self.max_bytes:
            body.close()  # never read: drops the connection with the rest of the object
            metrics.s3_fetches.labels("too_large").inc()
            return Refused(p, "payload_too_large",
                           f"{p.uri}: {size if size is not None else 'unknown'} bytes, "
                           f"INGEST_MAX_PAYLOAD_BYTES={self.max_bytes}")
        try:
            data = await _read_exactly(body, size)
        except _S3_FAILURES as exc:
            return self._unreachable(p, exc)
        finally:
            body.close()
        metrics.s3_fetches.labels("fetched").inc()
        metrics.s3_fetched_bytes.inc(size)
        return Fetched(p, data)

    def _unreachable(self, p: Pointer, exc: BaseException) -> Unreachable:
        kind = _error_kind(exc)
        metrics.s3_fetches.labels("error").inc()
        metrics.s3_errors.labels(kind).inc()
        log.warning("s3_fetch_failed", uri=p.uri, kind=kind, error=_describe(exc))
        return Unreachable(p, f"{p.uri}: {_describe(exc)}")

    async def delete(self, pointers: Sequence[Pointer]) -> None:
        """Delete the objects of committed and acked requests. Never raises: an object left
        behind is removed by the bucket's lifecycle rule (README)."""
        if not pointers:
            return
        results = await asyncio.gather(
            *(self._client.delete_object(Bucket=p.bucket, Key=p.key, **self._owner)
              for p in pointers),
            return_exceptions=True)
        for p, res in zip(pointers, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res  # CancelledError and the like
                metrics.s3_deletes.labels("failed").inc()
                log.warning("s3_delete_failed", uri=p.uri, error=_describe(res))
            else:
                metrics.s3_deletes.labels("deleted").inc()


async def _same(r: Refused) -> Refused:
    return r


async def _read_exactly(body: Any, size: int) -> bytearray:
    """Read ``size`` bytes into one buffer of that size (no second copy of the payload)."""
    buf = bytearray(size)
    view = memoryview(buf)
    pos = 0
    try:
        while pos < size:
            chunk = await body.read(min(_CHUNK, size - pos))
            if not chunk:
                raise OSError(f"S3 object truncated at {pos} of {size} bytes")
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        # The end of the stream: botocore checks the length, and a response checksum
        # (flexible checksums) when the object has one, on the read that returns nothing.
        if await body.read(1):
            raise OSError(f"S3 object longer than its Content-Length ({size} bytes)")
    finally:
        view.release()
    return buf


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


# -- what a batch does with pointers it could not resolve --------------------------------


def plan_unresolved(
    unresolved: Sequence[tuple[Received, Refused | Unreachable]],
    known: Mapping[str, KnownPointer],
    policy: RetryPolicy,
) -> Plan:
    """Decide messages whose payload could not be read. A missing object whose pointer was
    claimed by a COMPLETED request is a duplicate (the object was deleted after that
    request's ack, opt-in); one still IN_PROGRESS waits like any contention; otherwise
    the message is a dead letter that keeps its pointer body. S3 failures are deferred
    with backoff (not the message's fault), never dead-lettered — unless the pointer's
    request is COMPLETED: then, as for a missing object, the message is its duplicate."""
    from service.plan import INVALID_TYPE_LABEL, Plan
    from service.seams import DeadLetter

    plan = Plan()
    for raw, r in unresolved:
        if isinstance(r, Unreachable):
            done = known.get(r.pointer.uri)
            if done is not None and done.status == "COMPLETED":
                # Its request needs no payload: deferred, it would cycle as long as S3
                # refuses, outliving the request's row (retention) and then applied again.
                plan.ack(raw, done.request_type, "duplicate")
                continue
            # Not the message's fault: a deferral (an S3 outage never pushes it to the
            # queue's own DLQ; service.redrive), after the usual backoff.
            plan.defer(raw, policy.backoff(raw.receive_count))
            continue
        owner = known.get(r.pointer.uri) if r.pointer is not None \
            and r.reason == "payload_object_missing" else None
        if owner is not None and owner.status == "COMPLETED":
            plan.ack(raw, owner.request_type, "duplicate")
        elif owner is not None:
            plan.defer(raw, policy.contention())
            plan.contention += 1
        else:
            log.warning("poison_message", message_id=raw.message_id, reason=r.reason,
                        error=r.error)
            plan.letter(raw, DeadLetter.of_received(raw, r.reason, r.error), INVALID_TYPE_LABEL)
    return plan


async def resolve_batch(
    payloads: S3Payloads | None, store: StoreSeam, policy: RetryPolicy,
    part: list[Received], fifo: bool,
) -> tuple[list[Received], dict[str, Fetched], Plan | None]:
    """Fetch the payloads of a batch's pointer bodies. Returns the messages to parse as
    usual, the fetched payloads by message id, and the plan for those that could not be
    read (None when there are none). On a FIFO queue a message handed back here holds back
    the later messages of its group (visible again at once, behind it)."""
    resolved = await payloads.resolve(part) if payloads is not None else None
    if not resolved:
        return part, {}, None
    fetched = {k: r for k, r in resolved.items() if isinstance(r, Fetched)}
    failed: list[tuple[Received, Refused | Unreachable]] = []
    for m in part:
        r = resolved.get(m.message_id)
        if r is not None and not isinstance(r, Fetched):
            failed.append((m, r))
    if not failed:
        return part, fetched, None
    # Requests these pointers were claimed by: a missing object or an S3 failure is no
    # obstacle to acking a redelivery of a completed request as its duplicate.
    missing = [r.pointer.uri for _, r in failed if r.pointer is not None and (
        isinstance(r, Unreachable) or r.reason == "payload_object_missing")]
    plan = plan_unresolved(failed, await store.known_pointers(missing) if missing else {},
                           policy)
    decided = {m.message_id for m, _ in failed}
    back = {m.message_id for m, _ in plan.deferrals}
    held: set[str] = set()
    rest = []
    for m in part:
        if m.message_id in decided:
            if fifo and m.group_id is not None and m.message_id in back:
                held.add(m.group_id)
        elif m.group_id is not None and m.group_id in held:
            plan.defer(m, 0)  # behind a message of its group handed back above
        else:
            rest.append(m)
    return rest, fetched, plan


@contextlib.asynccontextmanager
async def s3_client(
    session: Any, region: str, endpoint_url: str | None, max_pool_connections: int = 50
) -> AsyncIterator[Any]:
    """An aiobotocore S3 client from the daemon's session (same credentials chain)."""
    config = AioConfig(
        max_pool_connections=max_pool_connections,
        connect_timeout=5,
        read_timeout=30,
        retries={"max_attempts": 3, "mode": "standard"},
        # An emulator or S3-compatible store on a custom endpoint is addressed by path;
        # AWS itself by virtual host (botocore's default).
        s3={"addressing_style": "path"} if endpoint_url else None,
    )
    async with session.create_client(
        "s3", region_name=region, endpoint_url=endpoint_url, config=config
    ) as client:
        yield client

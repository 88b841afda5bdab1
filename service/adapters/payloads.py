"""Large payloads offloaded to S3 by the AWS extended clients: S3 I/O only — fetching what a
pointer (``service.core.pointers``) points to, and deleting it after the request is committed
and acked (opt-in). What an unread payload means for its message is decided in
``service.core.plan``; the batch path calls both (``service.runtime.resolve``).

Memory: a payload is read only after GetObject's ``Content-Length`` is checked against
``INGEST_MAX_PAYLOAD_BYTES``, into one buffer of exactly that size (chunks are copied in and
dropped), so a batch of ten holds at most ten payloads' bytes while it is parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from aiobotocore.config import AioConfig
from botocore.exceptions import BotoCoreError, ClientError

from service.adapters.useragent import user_agent
from service.core.budget import MemoryBudget
from service.core.labels import S3ErrorKind
from service.core.messages import Received
from service.core.pointers import (
    MARK,
    Fetched,
    Pointer,
    Refused,
    Resolution,
    Unreachable,
    find_pointer,
)
from service.observe import metrics
from service.s3access import BUCKETS_VARIABLE, AllowList

log = structlog.get_logger("sqs_ingest.payloads")

_CHUNK = 64 * 1024
#: What a GetObject and the read of its body raise when S3 or the way to it fails: besides
#: botocore's and the socket's own, aiohttp's ClientPayloadError for a body cut off before
#: its Content-Length (aiobotocore wraps only connection errors). All transient.
_S3_FAILURES: tuple[type[BaseException], ...] = (
    BotoCoreError, OSError, TimeoutError, aiohttp.ClientError)
#: S3 answers these for an object (or bucket) that does not exist.
_MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchBucket"})


def _error_kind(exc: BaseException) -> S3ErrorKind:
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


def _missing(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in _MISSING_CODES or status == 404


@dataclass(frozen=True, slots=True)
class _Opened:
    body: Any
    size: int


class Later:
    """A pointer whose payload does not fit the memory budget now: resolved in a later
    round of the same batch, once the payloads of this round are committed."""

    __slots__ = ()


LATER = Later()


class S3Payloads:
    """Fetches (and, opt-in, deletes) offloaded payloads through an aiobotocore S3 client."""

    def __init__(
        self, client: Any, max_bytes: int, delete_after_ack: bool = False, *,
        allowed: AllowList | str = "", expected_owner: str | None = None,
        unreadable_after: float = 3600.0,
    ) -> None:
        self._client = client
        # Seconds S3 may refuse a pointer (from its first refusal, kept in PostgreSQL)
        # before its message is dead-lettered as payload_unreadable.
        self.unreadable_after = unreadable_after
        self.max_bytes = max_bytes
        self.delete_after_ack = delete_after_ack
        self.allowed = AllowList.parse(allowed) if isinstance(allowed, str) else allowed
        # ExpectedBucketOwner on every call: a bucket of that name in another account
        # (deleted and re-created by someone else) is refused by S3 itself.
        self._owner: dict[str, str] = \
            {"ExpectedBucketOwner": expected_owner} if expected_owner else {}
        self._warned_unset = False
        # INGEST_MAX_INFLIGHT_BYTES: set by the worker (None: payloads are not counted).
        self.budget: MemoryBudget | None = None

    async def resolve(
        self, batch: Sequence[Received], owner: object | None = None,
    ) -> dict[str, Resolution | Later]:
        """message_id → resolution for the pointers of a batch, fetched concurrently. A batch
        without pointers costs one substring test per body and no S3 call.

        With a memory ``budget``, each payload's bytes are taken for ``owner`` (the batch)
        once its Content-Length is known, before it is read: what fits now is read, the
        rest is ``Later`` (closed unread; the batch commits what it holds, gives those
        bytes back, then resolves the rest). Only a batch holding no payload bytes waits
        for room — so batches never wait on each other's payloads (no deadlock)."""
        found: dict[str, Pointer | Refused] = {}
        for r in batch:
            if MARK in r.body:
                p = find_pointer(r.body)
                if p is not None:
                    found[r.message_id] = p
        if not found:
            return {}
        opened = await asyncio.gather(*(
            self._open(p) if isinstance(p, Pointer) else _same(p) for p in found.values()))
        items = list(zip(found, found.values(), opened, strict=True))
        out: dict[str, Resolution | Later] = {}
        budget = self.budget if owner is not None else None
        to_read = await _admit(items, budget, owner, out)
        read = await asyncio.gather(*(self._read(p, o.body, o.size) for _, p, o in to_read))
        for (mid, _, o), res in zip(to_read, read, strict=True):
            out[mid] = res
            if budget is not None and not isinstance(res, Fetched):
                budget.give(o.size, owner)
        return {mid: out[mid] for mid in found if mid in out}

    async def fetch(self, p: Pointer) -> Resolution:
        """One pointer's payload (no memory budget)."""
        o = await self._open(p)
        if not isinstance(o, _Opened):
            return o
        return await self._read(p, o.body, o.size)

    async def _open(self, p: Pointer) -> _Opened | Refused | Unreachable:
        """GetObject and its size check: the body is not read yet."""
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
        return _Opened(body, size)

    async def _read(self, p: Pointer, body: Any, size: int) -> Resolution:
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
        return Unreachable(p, f"{p.uri}: {_describe(exc)}", kind)

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


async def _admit(
    items: list[tuple[str, Pointer | Refused, _Opened | Refused | Unreachable]],
    budget: MemoryBudget | None, owner: object | None, out: dict[str, Resolution | Later],
) -> list[tuple[str, Pointer, _Opened]]:
    """The opened payloads to read in this round; what cannot be read is put in out (its
    refusal, or LATER when the memory budget has no room for it now)."""
    to_read: list[tuple[str, Pointer, _Opened]] = []
    for i, (mid, p, o) in enumerate(items):
        if not isinstance(o, _Opened):
            out[mid] = o
            continue
        assert isinstance(p, Pointer)
        if budget is None or budget.try_take(o.size, owner, urgent=True):
            to_read.append((mid, p, o))
            continue
        if to_read:  # holding payload bytes of this round: never wait for more
            o.body.close()  # read in a later round, after this one's commit
            out[mid] = LATER
            continue
        # Holding none: wait for room for this one; the rest waits for a later round.
        for mid2, _, other in items[i + 1:]:
            if isinstance(other, _Opened):
                other.body.close()
                out[mid2] = LATER
            else:
                out[mid2] = other
        try:
            await budget.take(o.size, owner, urgent=True)
        except BaseException:
            o.body.close()
            raise
        to_read.append((mid, p, o))
        break
    return to_read


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


class LazyS3:
    """The S3 client, made at its first call: a daemon that never meets a pointer never
    loads S3's service model (6 MB of RSS measured: ``import`` alone vs with an S3 client).
    Closed with the ``s3_client`` block that made it."""

    def __init__(self, make: Callable[[], Any], stack: contextlib.AsyncExitStack) -> None:
        self._make = make
        self._stack = stack
        self._client: Any = None
        self._lock = asyncio.Lock()

    @property
    def made(self) -> bool:
        return self._client is not None

    async def _get(self) -> Any:
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    self._client = await self._stack.enter_async_context(self._make())
        return self._client

    async def get_object(self, **kwargs: Any) -> Any:
        return await (await self._get()).get_object(**kwargs)

    async def delete_object(self, **kwargs: Any) -> Any:
        return await (await self._get()).delete_object(**kwargs)


@contextlib.asynccontextmanager
async def s3_client(
    session: Any, region: str, endpoint_url: str | None, max_pool_connections: int = 50
) -> AsyncIterator[LazyS3]:
    """An aiobotocore S3 client from the daemon's session (same credentials chain), made
    when the first pointer is read (``LazyS3``)."""
    config = AioConfig(
        max_pool_connections=max_pool_connections,
        connect_timeout=5,
        read_timeout=30,
        retries={"max_attempts": 3, "mode": "standard"},
        # An emulator or S3-compatible store on a custom endpoint is addressed by path;
        # AWS itself by virtual host (botocore's default).
        s3={"addressing_style": "path"} if endpoint_url else None,
        user_agent=user_agent(session),
    )
    async with contextlib.AsyncExitStack() as stack:
        yield LazyS3(lambda: session.create_client(
            "s3", region_name=region, endpoint_url=endpoint_url, config=config), stack)

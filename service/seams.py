"""The two seams the worker is written against — the queue and the store — and the values
that cross them. ``service.sqs.SqsQueue`` / ``service.store.Store`` are the real ones;
``service.testing`` holds in-memory twins that mypy checks against the same protocols."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from service.limits import storable
from service.messages import Message, Poison, Received


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What the claim statement found for one request_id."""

    request_id: str
    claimed: bool
    status: str | None  # of the existing row, when not claimed and visible
    request_type: str | None
    payload_sha256: str | None
    owner: str | None
    failures: int
    dead_lettered: bool = False  # this SQS message is already in dead_letters


@dataclass(slots=True)
class ApplyResult:
    """What one completing transaction did, message by message."""

    completed: list[tuple[Message, dict[str, Any] | None]] = field(default_factory=list)
    failed: list[tuple[Message, BaseException]] = field(default_factory=list)
    lost: list[Message] = field(default_factory=list)  # claim collected by GC: not ours
    blocked: list[Message] = field(default_factory=list)  # FIFO: behind a failure in its group
    committed_at: float = 0.0


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One row of ``dead_letters``: the raw body, byte for byte, and why."""

    sqs_message_id: str
    body: str
    reason: str
    error: str | None
    request_id: str | None
    request_type: str | None
    receive_count: int | None

    @classmethod
    def of_poison(cls, p: Poison) -> DeadLetter:
        # A poison message's request_id/type are whatever the producer sent (NUL too).
        return cls(
            p.raw.message_id, p.raw.body, p.reason, storable(p.error), storable(p.request_id),
            storable(p.type), p.raw.receive_count,
        )

    @classmethod
    def of_message(cls, m: Message, reason: str, error: str) -> DeadLetter:
        return cls(
            m.raw.message_id, m.raw.body, reason, storable(error), m.request_id, m.type,
            m.raw.receive_count,
        )

    @classmethod
    def of_received(cls, r: Received, reason: str, error: str) -> DeadLetter:
        return cls(r.message_id, r.body, reason, storable(error), None, None, r.receive_count)


HandlerCall = Callable[[Message, Any], Awaitable[dict[str, Any] | None]]
#: Runs several messages' handlers at once; returns their results in order, or None when
#: these messages cannot go as one batch (then each runs on its own).
BatchCall = Callable[[list[Message], Any], Awaitable[list[dict[str, Any] | None] | None]]
#: Which messages may share one batch call (same key), None = never batched.
BatchKey = Callable[[Message], object]
Batching = tuple[BatchKey, BatchCall]


class GcRow(Protocol):
    """A released orphan claim (an asyncpg Record in the real store)."""

    def __getitem__(self, key: str) -> Any: ...


class QueueSeam(Protocol):
    """One SQS queue: what the worker needs of it."""

    async def receive(
        self, max_messages: int, wait_seconds: int, visibility_timeout: int | None
    ) -> list[Received]: ...

    async def delete_batch(self, messages: Sequence[Received]) -> None:
        """Delete, or raise AckFailed naming every message whose delete failed."""

    async def change_visibility_batch(
        self, changes: Sequence[tuple[Received, int]]
    ) -> list[str]:
        """Set visibilities; returns the message ids whose change failed."""

    async def attributes(self) -> dict[str, str]: ...


class StoreSeam(Protocol):
    """The database side of the pipeline: every method the worker calls."""

    worker_id: str

    async def register_worker(self, name: str) -> None: ...
    async def heartbeat(self) -> bool: ...
    async def stop_worker(self) -> int: ...
    async def ping(self) -> None: ...

    async def check_schema(self) -> None:
        """Raise ``service.migrate.SchemaBehind`` when a migration is missing."""

    async def gc(
        self, lease_seconds: float, name: str | None = None,
        started_before: datetime | None = None,
    ) -> Sequence[GcRow]: ...

    async def gc_own_leaks(self, holding: Sequence[str]) -> list[str]: ...

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]: ...

    async def apply(
        self, messages: Sequence[Message], call: HandlerCall, fifo: bool = False,
        batch: Batching | None = None,
    ) -> ApplyResult: ...

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None: ...
    async def release(self, messages: Sequence[Message]) -> None: ...

    async def record_failures(
        self, failures: Sequence[tuple[Message, str]], max_failures: int
    ) -> dict[str, int]: ...

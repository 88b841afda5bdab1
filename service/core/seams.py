"""The two seams the worker is written against — the queue and the store — and the values
that cross them. ``service.adapters.sqs.SqsQueue`` / ``service.adapters.store.Store`` are the
real ones;
``service.testing`` holds in-memory twins that mypy checks against the same protocols."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from service.core.limits import storable
from service.core.messages import Message, Poison, Received
from service.core.registry import EntityRow


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
    # FIFO: not claimed because an earlier message of its group (lower SequenceNumber) is
    # IN_PROGRESS under some owner, dead or alive.
    held: bool = False
    # Claimed by taking over the claim of a dead owner (the orphan GC's rule): that owner.
    collected_from: str | None = None


@dataclass(frozen=True, slots=True)
class KnownPointer:
    """The request an S3 payload pointer was claimed for (``modifications.payload_pointer``):
    a redelivered pointer whose object is gone is that request's duplicate."""

    request_id: str
    request_type: str
    status: str


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
    group_id: str | None = None  # the source's MessageGroupId (a FIFO result's group)

    @classmethod
    def of_poison(cls, p: Poison) -> DeadLetter:
        # A poison message's request_id/type are whatever the producer sent (NUL too).
        return cls(
            p.raw.message_id, p.raw.body, p.reason, storable(p.error), storable(p.request_id),
            storable(p.type), p.raw.receive_count, p.raw.group_id,
        )

    @classmethod
    def of_message(cls, m: Message, reason: str, error: str) -> DeadLetter:
        return cls(
            m.raw.message_id, m.raw.body, reason, storable(error), m.request_id, m.type,
            m.raw.receive_count, m.raw.group_id,
        )

    @classmethod
    def of_received(cls, r: Received, reason: str, error: str) -> DeadLetter:
        return cls(r.message_id, r.body, reason, storable(error), None, None, r.receive_count,
                   r.group_id)


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One result waiting in ``outbox``: what is published, once its outcome committed."""

    id: int
    request_id: str
    request_type: str | None
    status: str  # COMPLETED | FAILED
    result: Any
    reason: str | None
    completed_at: datetime
    group_id: str | None


class Sent(set[int]):
    """What a send returns: the ids the destination accepted (the set itself) and, in
    ``refused``, the ids it refused for good — an entry SQS/SNS answered with
    SenderFault=true is refused again on every try — with what it said. A plain set is a
    send that refused nothing for good."""

    def __init__(self, accepted: Iterable[int] = (),
                 refused: Mapping[int, str] | None = None) -> None:
        super().__init__(accepted)
        self.refused: dict[int, str] = dict(refused or {})


def refused_of(sent: set[int]) -> dict[int, str]:
    """The ids ``sent`` says were refused for good (none for a plain set)."""
    return sent.refused if isinstance(sent, Sent) else {}


class ResultsSink(Protocol):
    """A destination: sends up to ten rows (``bodies[i]`` is the message of ``rows[i]``),
    returns the ids of those accepted."""

    fifo: bool
    max_message_bytes: int  # the largest message the destination accepts

    async def send(self, rows: Sequence[OutboxRow], bodies: Sequence[str]) -> set[int]:
        """Send ``rows`` (at most ten, within the call's byte limit) in one call; the ids
        the destination accepted (a ``Sent``: also those it refused for good). Raises
        ``TransientError`` when it refused the whole call."""


#: Sends claimed rows to the destination; returns the ids it accepted (the others stay
#: pending, but for those a ``Sent`` says were refused for good: marked refused). Raises
#: ``TransientError`` when the destination refused the whole call.
SendRows = Callable[[list[OutboxRow]], Awaitable[set[int]]]


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
    ) -> list[Received]:
        """Long-poll up to ``max_messages`` for up to ``wait_seconds``; each message received
        is hidden for ``visibility_timeout`` (None: the queue's own). Raises
        ``TransientError`` when the call fails."""

    async def delete_batch(self, messages: Sequence[Received]) -> None:
        """Delete, or raise AckFailed naming every message whose delete failed."""

    async def change_visibility_batch(
        self, changes: Sequence[tuple[Received, int]]
    ) -> list[str]:
        """Set visibilities; returns the message ids whose change failed."""

    async def requeue(self, changes: Sequence[tuple[Received, int]]) -> list[str]:
        """Replace messages by fresh copies visible after their delays (service.ops.redrive);
        returns the message ids not replaced."""

    async def attributes(self) -> dict[str, str]:
        """Every queue attribute (GetQueueAttributes ``All``): depth, RedrivePolicy,
        MessageRetentionPeriod, VisibilityTimeout. Raises ``TransientError`` on failure."""


class StoreSeam(Protocol):
    """The database side of the pipeline: every method the worker calls."""

    worker_id: str

    async def register_worker(self, name: str) -> None:
        """Record this worker (``worker_id``, its ``name``) as alive from now."""

    async def heartbeat(self) -> bool:
        """Refresh this worker's heartbeat; False when it was marked stopped (its claims
        may be collected)."""

    async def stop_worker(self) -> int:
        """Release every claim this worker still holds and mark it stopped; returns how
        many claims were released."""

    async def ping(self) -> None:
        """Return when the database answers; raise ``DatabaseUnavailable`` when not."""

    async def check_schema(self) -> None:
        """Raise ``service.errors.SchemaBehind`` when a migration is missing."""

    async def gc(self, lease_seconds: float, name: str | None = None) -> Sequence[GcRow]:
        """Release the IN_PROGRESS claims of dead workers — heartbeat older than
        ``lease_seconds``, stopped, or (with ``name``) this worker's own previous
        incarnation: a worker of that name registered before this one — and return them.
        Never a live worker's claim."""

    async def gc_own_leaks(self, holding: Sequence[str]) -> list[str]:
        """Release this worker's claims that no batch holds any more (not in ``holding``)
        and are older than a margin (30 s: a claim made after the caller read ``holding``
        is safe); returns their request_ids."""

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
        """Claim a batch in one statement (INSERT … ON CONFLICT DO NOTHING): request_id →
        what the claim found (claimed by us, or the existing row; FIFO: held behind an
        earlier unfinished message of its group). A message without a claim token gets
        this call's (``Message.claim_token``) before the claim is made. Given the worker
        lease, a claim whose owner the orphan GC would collect is taken over in the same
        statement (``ClaimResult.collected_from``); a live owner's never."""

    async def known_pointers(self, uris: Sequence[str]) -> dict[str, KnownPointer]:
        """The requests claimed with these payload pointers (``s3://bucket/key``)."""

    async def note_refusals(self, errors: Mapping[str, str]) -> dict[str, float]:
        """Record S3 refusals of these pointers (uri → error); returns the seconds since
        each one's first refusal."""

    async def apply(
        self, messages: Sequence[Message], call: HandlerCall, fifo: bool = False,
        batch: Batching | None = None, entity_rows: Sequence[EntityRow] | None = None,
        time_limit: float | None = None,
    ) -> ApplyResult:
        """Run the handlers (``call``; ``batch``: the batch form) and mark the messages
        COMPLETED in one transaction fenced on the owner (``service.adapters.completion``): what
        completed, failed, was lost to GC, or was blocked behind a FIFO failure. With
        ``entity_rows`` (a standard queue's batch the reference handlers carry alone, no
        entity twice: their rows) the store may apply it in one statement with the same
        effect and results instead, within ``time_limit`` seconds."""

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        """Store ``letters`` in dead_letters (a message stored once, whatever its
        redeliveries); with results on, their FAILED results in the same statement."""

    async def release(self, messages: Sequence[Message]) -> None:
        """Give back the claims made for exactly these messages (by their claim tokens):
        never one another batch made for a redelivery, nor a later claim of the request."""

    async def record_failures(
        self, failures: Sequence[tuple[Message, str]], max_failures: int
    ) -> dict[str, int]:
        """Release the failed messages' claims and count each failure; those that reach
        ``max_failures`` are dead-lettered in the same transaction. Returns request_id →
        failures so far, only of the messages whose claim this call released: a failure
        whose claim was gone (GC took it) is neither counted nor dead-lettered."""


class OutboxSeam(Protocol):
    """The store side of the results publisher (``service.runtime.results``)."""

    #: Set whenever this process commits outbox rows (the publisher wakes at once).
    outbox_written: asyncio.Event

    async def publish_outbox(self, send: SendRows, limit: int, fifo: bool) -> tuple[int, int]:
        """Claim up to ``limit`` unpublished rows (skipping those another publisher holds),
        ``send`` them, mark the accepted ones published and those refused for good
        refused, in one transaction. Returns (claimed, published + refused)."""

    async def outbox_stats(self) -> tuple[int, float]:
        """(pending rows, age in seconds of the oldest pending row)."""

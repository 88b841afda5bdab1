"""In-memory twins of the two seams (``service.core.seams``), for unit tests of the worker.

``FakeQueue`` keeps the SQS semantics that matter to the worker (visibility, receive
counts, receipt handles, partial batch failures); ``FakeStore`` keeps the claim/complete/
dead-letter/GC semantics of ``Store``. Both are typed against the seam protocols, and
tests/contract runs one suite over the fakes and over the real PostgreSQL store.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from service.adapters import completion
from service.core.messages import Message, Received
from service.core.registry import EntityRow
from service.core.seams import (
    ApplyResult,
    Batching,
    ClaimResult,
    DeadLetter,
    HandlerCall,
    KnownPointer,
    OutboxRow,
    OutboxSeam,
    QueueSeam,
    ResultsSink,
    SendRows,
    Sent,
    StoreSeam,
    refused_of,
)
from service.errors import AckFailed, DatabaseUnavailable, SchemaBehind, TransientError


@dataclass
class _Stored:
    message_id: str
    body: str
    group_id: str | None
    sent: float
    visible_at: float = 0.0
    receive_count: int = 0
    receipt: str = ""
    message_attributes: dict[str, Any] | None = None


class FakeQueue:
    """An in-memory SQS queue. Time is real (monotonic); receive waits up to ``wait``."""

    def __init__(self, fifo: bool = False) -> None:
        self.fifo = fifo
        self.messages: dict[str, _Stored] = {}
        self._order = itertools.count()
        self._seq: dict[str, int] = {}
        self.deleted: list[str] = []
        self.visibility_calls: list[tuple[str, int]] = []
        self.fail_delete_ids: set[str] = set()  # entries answered in Failed
        self.fail_delete_call = False
        self._arrived = asyncio.Event()
        # SQS redrive: past this many receives a message moves to ``dead_lettered_by_sqs``.
        self.max_receive_count: int | None = None
        self.dead_lettered_by_sqs: list[str] = []
        self.requeued: list[str] = []  # originals replaced by a fresh copy

    def send(self, body: str, group_id: str | None = None,
             message_attributes: dict[str, Any] | None = None) -> str:
        mid = str(uuid.uuid4())
        self.messages[mid] = _Stored(mid, body, group_id, time.time(),
                                     message_attributes=message_attributes)
        self._seq[mid] = next(self._order)
        self._arrived.set()
        return mid

    def visible(self) -> list[_Stored]:
        now = time.monotonic()
        return [m for m in self.messages.values() if m.visible_at <= now]

    async def receive(
        self, max_messages: int = 10, wait_seconds: int = 0, visibility_timeout: int | None = 30
    ) -> list[Received]:
        deadline = time.monotonic() + wait_seconds
        while True:
            out = self._take(max_messages, visibility_timeout or 30)
            if out or time.monotonic() >= deadline:
                return out
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=min(0.05, wait_seconds))
            except TimeoutError:
                pass

    def _take(self, n: int, vt: int) -> list[Received]:
        now = time.monotonic()
        ordered = sorted(self.messages.values(), key=lambda m: self._seq[m.message_id])
        busy_groups = {m.group_id for m in ordered if self.fifo and m.visible_at > now}
        out: list[Received] = []
        for m in ordered:
            if len(out) == n:
                break
            if m.visible_at > now or (self.fifo and m.group_id in busy_groups):
                continue
            if self.max_receive_count is not None and m.receive_count >= self.max_receive_count:
                del self.messages[m.message_id]
                self.dead_lettered_by_sqs.append(m.body)
                continue
            m.visible_at = now + vt
            m.receive_count += 1
            m.receipt = uuid.uuid4().hex
            out.append(Received(m.message_id, m.receipt, m.body, m.receive_count,
                                m.sent, m.group_id,
                                sequence_number=self._seq[m.message_id] if self.fifo else None,
                                message_attributes=m.message_attributes))
        return out

    async def delete_batch(self, messages: Sequence[Received]) -> None:
        if self.fail_delete_call:
            raise AckFailed([m.message_id for m in messages], "injected: call failed")
        failed = [m.message_id for m in messages if m.message_id in self.fail_delete_ids]
        for m in messages:
            if m.message_id not in failed:
                self.messages.pop(m.message_id, None)
                self.deleted.append(m.message_id)
        if failed:
            raise AckFailed(failed, "injected: entry failed")

    async def change_visibility_batch(self, changes: Sequence[tuple[Received, int]]) -> list[str]:
        failed = []
        for m, t in changes:
            stored = self.messages.get(m.message_id)
            if stored is None or stored.receipt != m.receipt_handle:
                failed.append(m.message_id)
                continue
            stored.visible_at = time.monotonic() + t
            self.visibility_calls.append((m.message_id, t))
        return failed

    async def requeue(self, changes: Sequence[tuple[Received, int]]) -> list[str]:
        failed = []
        for m, delay in changes:
            stored = self.messages.get(m.message_id)
            if stored is None or stored.receipt != m.receipt_handle:
                failed.append(m.message_id)
                continue
            copy = self.send(m.body, m.group_id, m.message_attributes)
            self.messages[copy].visible_at = time.monotonic() + (0 if self.fifo else delay)
            del self.messages[m.message_id]
            self.requeued.append(m.message_id)
        return failed

    async def attributes(self) -> dict[str, str]:
        redrive = {} if self.max_receive_count is None else {"RedrivePolicy": (
            '{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:000000000000:dlq",'
            f'"maxReceiveCount":{self.max_receive_count}}}')}
        return {**redrive,
            "ApproximateNumberOfMessages": str(len(self.visible())),
            "ApproximateNumberOfMessagesNotVisible": str(len(self.messages) - len(self.visible())),
            "VisibilityTimeout": "30",
        }


#: The own-leak GC spares claims younger than this (queries.sql gc_own_leaks: 30 seconds).
OWN_LEAK_MARGIN = 30.0


@dataclass
class Row:
    """One ``modifications`` row of the fake database."""

    request_id: str
    type: str
    payload_sha256: str
    status: str
    owner: str
    sqs_message_id: str = ""
    result: Any = None
    message_attributes: dict[str, Any] | None = None
    payload_pointer: str | None = None
    group_id: str | None = None  # FIFO: MessageGroupId and SequenceNumber of the claim
    sequence_number: int | None = None
    claimed_at: float = field(default_factory=time.monotonic)  # received_at of the claim
    claim_token: str | None = None  # the claiming message's (Message.claim_token)


@dataclass
class FakeWorker:
    name: str
    heartbeat_at: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    stopped: bool = False


@dataclass
class FakeOutboxRow:
    row: OutboxRow
    published_at: float | None = None
    locked: bool = False  # claimed by a publisher whose send is in flight
    refused_reason: str | None = None  # refused for good by the destination (SenderFault)


@dataclass
class FakeDatabase:
    """What several ``FakeStore`` workers share: the tables, and whether it is up."""

    rows: dict[str, Row] = field(default_factory=dict)
    dead: dict[str, DeadLetter] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    workers: dict[str, FakeWorker] = field(default_factory=dict)
    outbox: list[FakeOutboxRow] = field(default_factory=list)
    refusals: dict[str, float] = field(default_factory=dict)  # pointer → first refusal (epoch)
    down: bool = False
    schema_behind: bool = False
    schema_checks: int = 0

    def age_worker(self, worker_id: str, seconds: float) -> None:
        """Make a worker's last heartbeat ``seconds`` older (tests of GC)."""
        self.workers[worker_id].heartbeat_at -= seconds

    def age_claim(self, request_id: str, seconds: float) -> None:
        """Make a claim ``seconds`` older (tests of the own-leak GC)."""
        self.rows[request_id].claimed_at -= seconds


class FakeOutbox:
    """In-memory twin of ``PgOutbox``: the outbox rows of a ``FakeDatabase``."""

    def __init__(self, db: FakeDatabase) -> None:
        self.db = db
        self.outbox_written = asyncio.Event()

    def _check(self) -> None:
        if self.db.down:
            raise DatabaseUnavailable("fake database is down")

    def _result(self, request_id: str, type_: str | None, status: str, result: Any,
                reason: str | None, group_id: str | None) -> None:
        row = OutboxRow(len(self.db.outbox) + 1, request_id, type_, status, result, reason,
                        datetime.now(UTC), group_id)
        self.db.outbox.append(FakeOutboxRow(row))
        self.outbox_written.set()

    async def publish_outbox(self, send: SendRows, limit: int, fifo: bool) -> tuple[int, int]:
        self._check()
        pending = [r for r in self.db.outbox
                   if r.published_at is None and r.refused_reason is None]
        taken = [r for r in pending if not r.locked][:limit]
        if fifo:  # a group waits behind an older pending row another publisher holds
            held_groups = {r.row.group_id for r in pending
                           if r.locked and r.row.group_id is not None}
            taken = [r for r in taken if r.row.group_id not in held_groups]
        if not taken:
            return 0, 0
        for r in taken:
            r.locked = True
        try:
            sent = await send([r.row for r in taken])
            self._check()  # the mark is a statement too
            refused = refused_of(sent)
            for r in taken:
                if r.row.id in sent:
                    r.published_at = time.time()
                r.refused_reason = refused.get(r.row.id, r.refused_reason)
        finally:
            for r in taken:
                r.locked = False
        return len(taken), len(sent) + len(refused)

    async def outbox_stats(self) -> tuple[int, float]:
        self._check()
        pending = [r.row.completed_at for r in self.db.outbox
                   if r.published_at is None and r.refused_reason is None]
        age = (datetime.now(UTC) - min(pending)).total_seconds() if pending else 0.0
        return len(pending), age


class FakeStore(FakeOutbox):
    """In-memory twin of ``Store``. ``conn`` passed to handlers is None."""

    def __init__(
        self, worker_id: str = "fake-worker", db: FakeDatabase | None = None,
        results: bool = False, lease: float | None = None,
    ) -> None:
        super().__init__(db or FakeDatabase())
        self.worker_id = worker_id
        self.results = results
        self.lease = lease  # claims of owners dead this long are taken over by claim()
        # The shared tables, as the worker tests read them.
        self.rows, self.dead, self.failures = self.db.rows, self.db.dead, self.db.failures

    # -- workers -----------------------------------------------------------------------

    async def register_worker(self, name: str) -> None:
        self._check()
        self.db.workers.setdefault(self.worker_id, FakeWorker(name))

    async def heartbeat(self) -> bool:
        self._check()
        w = self.db.workers.get(self.worker_id)
        if w is None or w.stopped:
            return False
        w.heartbeat_at = time.monotonic()
        return True

    async def stop_worker(self) -> int:
        self._check()
        mine = [r for r in self.db.rows.values() if _held_by(self.worker_id, r)]
        for r in mine:
            del self.db.rows[r.request_id]
        if self.worker_id in self.db.workers:
            self.db.workers[self.worker_id].stopped = True
        return len(mine)

    async def ping(self) -> None:
        self._check()

    async def check_schema(self) -> None:
        self._check()
        self.db.schema_checks += 1
        if self.db.schema_behind:
            raise SchemaBehind("fake database schema is behind")

    async def gc(self, lease_seconds: float, name: str | None = None) -> list[dict[str, Any]]:
        self._check()
        me = self.db.workers.get(self.worker_id)
        before = me.started_at if me is not None else None

        def dead(owner: str) -> bool:
            if _dead(self.db, owner, lease_seconds):
                return True
            w = self.db.workers[owner]
            return (name is not None and w.name == name and before is not None
                    and w.started_at < before)

        released = [r for r in self.db.rows.values()
                    if r.status == "IN_PROGRESS" and r.owner != self.worker_id and dead(r.owner)]
        for r in released:
            del self.db.rows[r.request_id]
        return [{"request_id": r.request_id, "owner": r.owner,
                 "sqs_message_id": r.sqs_message_id} for r in released]

    async def gc_own_leaks(self, holding: Sequence[str]) -> list[str]:
        self._check()
        held, old = set(holding), time.monotonic() - OWN_LEAK_MARGIN
        leaks = [r.request_id for r in self.db.rows.values()
                 if _held_by(self.worker_id, r) and r.request_id not in held
                 and r.claimed_at < old]
        for request_id in leaks:
            del self.db.rows[request_id]
        return leaks

    # -- the pipeline ------------------------------------------------------------------

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
        self._check()
        token = uuid.uuid4().hex
        for m in messages:
            if m.claim_token is None:
                m.claim_token = token
        out = {}
        # Claims of dead owners (the GC's rule) that this call takes over, as in the claim
        # statement: they hold back no later message of this call (classify orders those).
        stale = {m.request_id for m in messages if self.lease is not None
                 and _stale(self.db, m, self.worker_id, self.lease)}
        # FIFO: groups held before this call's rows
        held = {m.request_id for m in messages if _group_held(self.db, m, stale)}
        for m in messages:
            row = self.db.rows.get(m.request_id)
            fails = self.db.failures.get(m.request_id, 0)
            taken = None
            if row is not None and m.request_id in stale and m.request_id not in held:
                taken, row = row.owner, None
            if m.raw.message_id in self.db.dead:
                out[m.request_id] = ClaimResult(m.request_id, False, None, None, None, None,
                                                fails, dead_lettered=True)
            elif row is None and m.request_id in held:
                out[m.request_id] = ClaimResult(m.request_id, False, None, None, None, None,
                                                fails, held=True)
            elif row is None:
                self.db.rows[m.request_id] = Row(
                    m.request_id, m.type, m.payload_sha256, "IN_PROGRESS", self.worker_id,
                    m.raw.message_id, message_attributes=m.attributes,
                    payload_pointer=m.pointer.uri if m.pointer is not None else None,
                    group_id=m.raw.group_id, sequence_number=m.raw.sequence_number,
                    claim_token=m.claim_token)
                out[m.request_id] = ClaimResult(m.request_id, True, None, None, None, None,
                                                fails, collected_from=taken)
            else:
                out[m.request_id] = ClaimResult(m.request_id, False, row.status, row.type,
                                                row.payload_sha256, row.owner, fails)
        return out

    async def known_pointers(self, uris: Sequence[str]) -> dict[str, KnownPointer]:
        self._check()
        wanted = set(uris)
        return {r.payload_pointer: KnownPointer(r.request_id, r.type, r.status)
                for r in self.db.rows.values() if r.payload_pointer in wanted
                and r.payload_pointer is not None}

    async def note_refusals(self, errors: Mapping[str, str]) -> dict[str, float]:
        self._check()
        now = time.time()
        return {u: now - self.db.refusals.setdefault(u, now) for u in errors}

    async def apply(
        self, messages: Sequence[Message], call: HandlerCall, fifo: bool = False,
        batch: Batching | None = None, entity_rows: Sequence[EntityRow] | None = None,
        time_limit: float | None = None,
    ) -> ApplyResult:
        """The store's own attempt loop (``service.adapters.completion``) over these tables,
        whatever ``entity_rows`` say (the store's one statement has the same results)."""
        self._check()
        once, batch_once = _replayed(call, batch)
        return await completion.complete(
            _FakeTransactions(self), messages, once, fifo, batch_once)

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        self._check()
        for d in letters:
            if d.sqs_message_id in self.db.dead:
                continue  # stored once, one result
            self.db.dead[d.sqs_message_id] = d
            if (self.results and d.request_id is not None
                    and d.reason != "idempotency_key_reused"):
                self._result(d.request_id, d.request_type, "FAILED", None, d.reason,
                             d.group_id)

    async def release(self, messages: Sequence[Message]) -> None:
        self._check()
        for m in messages:
            row = self.db.rows.get(m.request_id)
            if (_held_by(self.worker_id, row) and row is not None
                    and m.claim_token is not None and row.claim_token == m.claim_token):
                del self.db.rows[m.request_id]

    async def record_failures(
        self, failures: Sequence[tuple[Message, str]], max_failures: int
    ) -> dict[str, int]:
        self._check()
        failures = [(m, err) for m, err in failures
                    if _held_by(self.worker_id, row := self.db.rows.get(m.request_id))
                    and row is not None and row.sqs_message_id == m.raw.message_id]
        await self.release([m for m, _ in failures])
        counts = {}
        for m, err in failures:
            n = self.db.failures.get(m.request_id, 0) + 1
            self.db.failures[m.request_id] = n
            counts[m.request_id] = n
            if n >= max_failures:
                await self.dead_letter([DeadLetter.of_message(m, "max_receives_exceeded", err)])
                self.db.failures.pop(m.request_id)
        return counts


class FakeSink:
    """An in-memory results destination (``service.core.seams.ResultsSink``): records what
    it accepted; ``refuse`` makes every call fail, ``refuse_ids`` single entries."""

    def __init__(self, fifo: bool = False, max_message_bytes: int = 256 * 1024) -> None:
        self.fifo = fifo
        self.max_message_bytes = max_message_bytes
        self.sent: list[OutboxRow] = []
        self.refuse = False
        self.refuse_ids: set[int] = set()
        #: Refused for good (SenderFault): row id → what the destination says.
        self.refuse_for_good: dict[int, str] = {}
        self.calls = 0
        self.bodies: list[str] = []

    async def send(self, rows: Sequence[OutboxRow], bodies: Sequence[str] = ()) -> set[int]:
        self.calls += 1
        self.bodies.extend(bodies)
        await asyncio.sleep(0)  # a real send yields: another publisher may run meanwhile
        if self.refuse:
            raise TransientError("fake destination refuses")
        ok = [r for r in rows if r.id not in self.refuse_ids and r.id not in self.refuse_for_good]
        self.sent.extend(ok)
        return Sent({r.id for r in ok}, {r.id: self.refuse_for_good[r.id] for r in rows
                                          if r.id in self.refuse_for_good})


def _group_held(db: FakeDatabase, m: Message, taken: set[str]) -> bool:
    """FIFO: an earlier message of its group is IN_PROGRESS under anyone (the claim
    statement's rule, on the rows as they were before the call), but for the dead owners'
    claims of this call's requests (``taken``)."""
    g, n = m.raw.group_id, m.raw.sequence_number
    if g is None or n is None:
        return False
    return any(r.status == "IN_PROGRESS" and r.group_id == g and r.sequence_number is not None
               and r.sequence_number < n and r.request_id != m.request_id
               and r.request_id not in taken
               for r in db.rows.values())


def _stale(db: FakeDatabase, m: Message, worker_id: str, lease: float) -> bool:
    """The claim in ``m``'s way belongs to an owner the orphan GC would collect."""
    row = db.rows.get(m.request_id)
    return (row is not None and row.status == "IN_PROGRESS" and row.owner != worker_id
            and m.raw.message_id not in db.dead and _dead(db, row.owner, lease))


def _dead(db: FakeDatabase, owner: str, lease: float) -> bool:
    """The orphan GC's rule: no worker row, stopped, or a heartbeat older than the lease."""
    w = db.workers.get(owner)
    return w is None or w.stopped or time.monotonic() - w.heartbeat_at > lease


def _held_by(worker_id: str, row: Row | None) -> bool:
    return row is not None and row.owner == worker_id and row.status == "IN_PROGRESS"


class _FakeTransactions:
    """``completion.Transactions`` over a ``FakeStore``'s tables: an attempt's completions are
    kept aside and written when its block ends normally (a rollback drops them). Handlers
    get ``conn=None``; the fake knows no outage or conflict inside a handler."""

    conn: Any = None

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.done: list[tuple[Message, str | None]] = []
        self.cleared: list[str] = []

    def attempt(self) -> _FakeAttempt:
        return _FakeAttempt(self)

    async def is_outage(self, exc: BaseException) -> bool:
        return False

    def is_conflict(self, exc: BaseException) -> bool:
        return False

    def is_aborted(self, exc: BaseException) -> bool:
        return False

    def ended(self) -> str | None:
        return None

    async def probe(self) -> None:
        return None

    async def fence(self, request_ids: Sequence[str]) -> set[str]:
        rows = self.store.db.rows
        return {r for r in request_ids if _held_by(self.store.worker_id, rows.get(r))}

    async def guard_commit(self) -> None:
        return None  # handlers get no connection: none can commit

    async def complete(self, live: Sequence[Message], outputs: Sequence[str | None]) -> int:
        self.done = list(zip(live, outputs, strict=True))
        return len(self.done)

    async def clear_failures(self, request_ids: Sequence[str]) -> None:
        self.cleared = list(request_ids)

    def commit(self) -> None:
        s = self.store
        for m, out in self.done:
            row = s.db.rows[m.request_id]
            row.status, row.result = "COMPLETED", orjson.loads(out) if out is not None else None
            s.db.failures.pop(m.request_id, None)
            if s.results:
                s._result(m.request_id, m.type, "COMPLETED", row.result, None, m.raw.group_id)


class _FakeAttempt:
    def __init__(self, txns: _FakeTransactions) -> None:
        self.txns = txns

    async def __aenter__(self) -> _FakeTransactions:
        self.txns.store._check()
        self.txns.done, self.txns.cleared = [], []
        return self.txns

    async def __aexit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.txns.commit()


def _replayed(
    call: HandlerCall, batch: Batching | None
) -> tuple[HandlerCall, Batching | None]:
    """The fake cannot roll a handler's Python side effects back, so within one ``apply`` a
    handler that already ran for a message is not run again when the loop reruns the
    transaction: its first result is replayed (what a rolled-back rerun leaves behind)."""
    ran: dict[int, Any] = {}

    async def one(m: Message, conn: Any) -> dict[str, Any] | None:
        if id(m) not in ran:
            ran[id(m)] = await call(m, conn)
        out: dict[str, Any] | None = ran[id(m)]
        return out

    if batch is None:
        return one, None
    key_of, call_many = batch

    async def many(ms: list[Message], conn: Any) -> list[dict[str, Any] | None] | None:
        if all(id(m) in ran for m in ms):
            return [ran[id(m)] for m in ms]
        outs = await call_many(ms, conn)
        if outs is not None:
            ran.update((id(m), o) for m, o in zip(ms, outs, strict=True))
        return outs

    return one, (key_of, many)


def _conforms(
    queue: FakeQueue, store: FakeStore, sink: FakeSink
) -> tuple[QueueSeam, StoreSeam, OutboxSeam, ResultsSink]:
    """mypy checks here that the fakes satisfy the seams the worker is typed against."""
    return queue, store, store, sink

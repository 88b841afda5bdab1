"""In-package fakes of the two seams, for unit tests of the worker loop.

``FakeQueue`` keeps SQS semantics that matter to the worker (visibility, receive counts,
receipt handles, partial batch failures); ``FakeStore`` keeps the claim/complete/
dead-letter semantics of ``Store`` in memory. Integration tests use the real things.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from service.errors import AckFailed, DatabaseUnavailable
from service.messages import Message, Received
from service.store import ApplyResult, ClaimResult, DeadLetter, HandlerCall


@dataclass
class _Stored:
    message_id: str
    body: str
    group_id: str | None
    sent: float
    visible_at: float = 0.0
    receive_count: int = 0
    receipt: str = ""


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

    def send(self, body: str, group_id: str | None = None) -> str:
        mid = str(uuid.uuid4())
        self.messages[mid] = _Stored(mid, body, group_id, time.time())
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
            m.visible_at = now + vt
            m.receive_count += 1
            m.receipt = uuid.uuid4().hex
            out.append(Received(m.message_id, m.receipt, m.body, m.receive_count,
                                m.sent, m.group_id))
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

    async def attributes(self) -> dict[str, str]:
        return {
            "ApproximateNumberOfMessages": str(len(self.visible())),
            "ApproximateNumberOfMessagesNotVisible": str(len(self.messages) - len(self.visible())),
            "VisibilityTimeout": "30",
        }


@dataclass
class _Row:
    request_id: str
    type: str
    payload_sha256: str
    status: str
    owner: str
    sqs_message_id: str = ""
    result: Any = None


@dataclass
class FakeStore:
    """In-memory twin of ``Store``. ``conn`` passed to handlers is None."""

    worker_id: str = "fake-worker"
    rows: dict[str, _Row] = field(default_factory=dict)
    dead: dict[str, DeadLetter] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    down: bool = False

    def _check(self) -> None:
        if self.down:
            raise DatabaseUnavailable("fake database is down")

    async def claim(self, messages: Sequence[Message]) -> dict[str, ClaimResult]:
        self._check()
        out = {}
        for m in messages:
            row = self.rows.get(m.request_id)
            if m.raw.message_id in self.dead:
                out[m.request_id] = ClaimResult(m.request_id, False, None, None, None, None,
                                                0, dead_lettered=True)
            elif row is None:
                self.rows[m.request_id] = _Row(m.request_id, m.type, m.payload_sha256,
                                               "IN_PROGRESS", self.worker_id, m.raw.message_id)
                out[m.request_id] = ClaimResult(m.request_id, True, None, None, None, None,
                                                self.failures.get(m.request_id, 0))
            else:
                out[m.request_id] = ClaimResult(m.request_id, False, row.status, row.type,
                                                row.payload_sha256, row.owner,
                                                self.failures.get(m.request_id, 0))
        return out

    async def apply(
        self, messages: Sequence[Message], call: HandlerCall, fifo: bool = False,
        batch: Any = None,
    ) -> ApplyResult:
        self._check()
        res = ApplyResult(committed_at=time.time())
        blocked: set[str] = set()
        for m in messages:
            if fifo and m.raw.group_id in blocked:
                res.blocked.append(m)
                continue
            row = self.rows.get(m.request_id)
            if row is None or row.owner != self.worker_id or row.status != "IN_PROGRESS":
                res.lost.append(m)
                continue
            try:
                out = await call(m, None)
            except Exception as exc:
                res.failed.append((m, exc))
                if fifo and m.raw.group_id is not None:
                    blocked.add(m.raw.group_id)
                continue
            row.status, row.result = "COMPLETED", out
            self.failures.pop(m.request_id, None)
            res.completed.append((m, out))
        return res

    async def dead_letter(self, letters: Sequence[DeadLetter]) -> None:
        self._check()
        for d in letters:
            self.dead.setdefault(d.sqs_message_id, d)

    async def release(self, messages: Sequence[Message]) -> None:
        self._check()
        for m in messages:
            row = self.rows.get(m.request_id)
            if (row and row.owner == self.worker_id and row.status == "IN_PROGRESS"
                    and row.sqs_message_id == m.raw.message_id):
                del self.rows[m.request_id]

    async def record_failures(
        self, failures: Sequence[tuple[Message, str]], max_failures: int
    ) -> dict[str, int]:
        self._check()
        await self.release([m for m, _ in failures])
        counts = {}
        for m, err in failures:
            n = self.failures.get(m.request_id, 0) + 1
            self.failures[m.request_id] = n
            counts[m.request_id] = n
            if n >= max_failures:
                await self.dead_letter([DeadLetter.of_message(m, "max_receives_exceeded", err)])
                self.failures.pop(m.request_id)
        return counts

    async def gc(self, *_: Any) -> list[Any]:
        self._check()
        return []

    async def gc_own_leaks(self, holding: Sequence[str]) -> list[str]:
        self._check()
        return []

    async def heartbeat(self) -> bool:
        self._check()
        return True

    async def stop_worker(self) -> int:
        self._check()
        mine = [r for r in self.rows.values()
                if r.owner == self.worker_id and r.status == "IN_PROGRESS"]
        for r in mine:
            del self.rows[r.request_id]
        return len(mine)

    async def ping(self) -> None:
        self._check()

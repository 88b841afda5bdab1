"""Entries of several small batches sent in one SQS batch call: deletes (DeleteMessageBatch)
and the visibility heartbeat's extensions (ChangeMessageVisibilityBatch).

On a trickle every batch holds a message or two, and a call per batch costs a request per
message. ``Coalescer`` keeps a caller's entries for at most its ``linger`` seconds so that
the entries of other callers asked meanwhile go in the same call (up to SQS's ten entries);
the call goes when the earliest of its callers' lingers is over, or at once when ten
entries wait. Each caller still waits for, and is answered about, its own entries.

``DeleteCoalescer``: ``AckFailed`` names exactly the caller's messages whose delete failed,
so a failed ack stops the daemon (exit 3) as before. The outcome is already committed when
a delete is asked, so a crash inside the linger means only a redelivery, which the claim
answers as a duplicate. A delete of ten or more messages (a backlog's batch) goes at once.

``ExtensionCoalescer`` (``service.runtime.visibility``): a caller cancelled while its
entries wait takes them back — a batch that stops its heartbeat is about to delete or
release those messages, and a late extension would hide a released message again — and
one cancelled while its entries are in a call waits for SQS's answer before it returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from service.core.messages import Received
from service.errors import AckFailed

#: SQS's most entries per batch call (DeleteMessageBatch, ChangeMessageVisibilityBatch).
MAX_ENTRIES = 10

T = TypeVar("T")
Send = Callable[[Sequence[T]], Awaitable[None]]
Delete = Callable[[Sequence[Received]], Awaitable[None]]
Change = tuple[Received, int]


@dataclass(eq=False)
class _Caller:
    """One ``submit``: its entries not yet in a call, its calls not yet answered, and
    what those that failed said."""

    future: asyncio.Future[None]
    due: float
    unsent: int
    calls: int = 0
    errors: list[BaseException] = field(default_factory=list)


class Coalescer(Generic[T]):
    """``send`` called with the entries of the callers of ``submit`` that fall within one
    another's linger, ten a call: N entries waiting together take ceil(N / 10) calls (a
    caller's entries may be split between two calls; it is answered once both are)."""

    def __init__(
        self,
        send: Send[T],
        linger: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._send_now = send
        self.linger = linger
        self.clock = clock
        self.sleep = sleep
        self._queue: list[tuple[T, _Caller]] = []  # entries waiting, in the order asked
        self._due: float | None = None  # when the entries waiting now go
        self._timer: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def submit(self, entries: Sequence[T], linger: float | None = None) -> None:
        """Send ``entries`` within ``linger`` seconds (default: the coalescer's) with what
        other callers ask meanwhile."""
        linger = self.linger if linger is None else linger
        if linger <= 0 or len(entries) >= MAX_ENTRIES or not entries:
            await self._send_now(entries)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Read even when nobody waits any more (a cancelled caller): no "never retrieved".
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        caller = _Caller(future, self.clock() + linger, len(entries))
        self._queue.extend((e, caller) for e in entries)
        while len(self._queue) >= MAX_ENTRIES:
            self._call(MAX_ENTRIES)
        self._rearm()
        # Shielded: what a cancelled caller's entries become is decided in _cancelled,
        # never by where the cancellation came.
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            await self._cancelled(caller)
            raise

    async def _cancelled(self, caller: _Caller) -> None:
        """Take the entries back if they still wait; if some are in a call, wait for its
        answer (what comes after the caller, a release to 0, must reach SQS after it)."""
        self._queue = [(e, c) for e, c in self._queue if c is not caller]
        caller.unsent = 0
        self._rearm()
        if caller.calls == 0:
            caller.future.cancel()
        elif not caller.future.done():
            await asyncio.wait([caller.future])

    def _rearm(self) -> None:
        due = min((c.due for _, c in self._queue), default=None)
        if due == self._due:
            return
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer, self._due = None, due
        if due is not None:
            self._timer = asyncio.ensure_future(self._flush_at(due))

    async def _flush_at(self, due: float) -> None:
        await self.sleep(max(0.0, due - self.clock()))
        self._flush()

    def _flush(self) -> None:
        while self._queue:
            self._call(MAX_ENTRIES)
        self._rearm()

    def _call(self, n: int) -> None:
        chunk, self._queue = self._queue[:n], self._queue[n:]
        for _, caller in chunk:
            caller.unsent -= 1
        for caller in {id(c): c for _, c in chunk}.values():
            caller.calls += 1
        task = asyncio.ensure_future(self._send(chunk))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, chunk: list[tuple[T, _Caller]]) -> None:
        callers = {id(c): c for _, c in chunk}.values()
        try:
            await self._send_now([e for e, _ in chunk])
        except asyncio.CancelledError:
            for caller in callers:
                caller.errors.append(self._torn_down([e for e, c in chunk if c is caller]))
            raise
        except BaseException as exc:  # each caller answered about its own entries
            for caller in callers:
                answer = self._answer([e for e, c in chunk if c is caller], exc)
                if answer is not None:
                    caller.errors.append(answer)
        finally:
            for caller in callers:
                caller.calls -= 1
                if caller.calls == 0 and caller.unsent == 0:
                    _settle(caller.future, self._combine(caller.errors))

    def _answer(self, entries: list[T], exc: BaseException) -> BaseException | None:
        """What a caller of a call that raised ``exc`` is told: ``exc`` itself."""
        return exc

    def _torn_down(self, entries: list[T]) -> BaseException:
        """A call cancelled before SQS answered (shutdown)."""
        return asyncio.CancelledError()

    def _combine(self, errors: list[BaseException]) -> BaseException | None:
        """What a caller whose calls said ``errors`` is told (none: success)."""
        return errors[0] if errors else None

    async def drain(self) -> None:
        """Send what lingers now and wait for every call in flight (shutdown)."""
        self._flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)


class DeleteCoalescer(Coalescer[Received]):
    def __init__(self, delete: Delete, linger: float) -> None:
        super().__init__(delete, linger)
        #: Told of a failed delete whose caller no longer waits for it (cancelled at the
        #: shutdown deadline): the daemon must still stop with exit 3 (service.app wires it).
        self.on_unawaited_failure: Callable[[AckFailed], None] | None = None

    async def delete_batch(self, messages: Sequence[Received]) -> None:
        await self.submit(messages)

    async def _cancelled(self, caller: _Caller) -> None:
        # The caller's committed messages are deleted with the others; a failure nobody
        # awaits any more is still reported (on_unawaited_failure), never swallowed.
        caller.future.add_done_callback(self._report_unawaited)

    def _answer(self, entries: list[Received], exc: BaseException) -> BaseException | None:
        if not isinstance(exc, AckFailed):
            return exc
        failed = set(exc.message_ids)
        mine = [m.message_id for m in entries if m.message_id in failed]
        return AckFailed(mine, exc.detail) if mine else None

    def _torn_down(self, entries: list[Received]) -> BaseException:
        # Torn down mid-call (shutdown): whether SQS deleted them is unknown — an ack
        # failure for each caller, as a failed call would be.
        return AckFailed([m.message_id for m in entries],
                         "the delete was cancelled before SQS answered")

    def _combine(self, errors: list[BaseException]) -> BaseException | None:
        """A caller split between two calls: the messages that failed in either."""
        if errors and all(isinstance(e, AckFailed) for e in errors):
            acks = [e for e in errors if isinstance(e, AckFailed)]
            return AckFailed([i for e in acks for i in e.message_ids],
                             "; ".join(dict.fromkeys(e.detail for e in acks)))
        return super()._combine(errors)

    def _report_unawaited(self, future: asyncio.Future[None]) -> None:
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, AckFailed) and self.on_unawaited_failure is not None:
            self.on_unawaited_failure(exc)


class ExtensionCoalescer(Coalescer[Change]):
    """The heartbeat's ChangeMessageVisibility entries, ``(message, seconds)``: a failed
    entry is ``send``'s to report (``PlanExecutor.change_visibility`` logs and counts it);
    a cancelled caller's entries are taken back (``Coalescer._cancelled``)."""


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if isinstance(exc, asyncio.CancelledError):
        future.cancel()
    elif exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

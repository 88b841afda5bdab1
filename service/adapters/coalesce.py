"""Deletes of several small batches sent as one DeleteMessageBatch.

On a trickle every batch holds a message or two, and deleting each batch on its own costs a
request per message. ``DeleteCoalescer`` keeps a batch's delete for at most ``linger``
seconds so that the deletes of batches completing meanwhile go in the same call (up to
SQS's ten entries). Each caller still waits for, and is answered about, its own messages:
``AckFailed`` names exactly the caller's messages whose delete failed, so a failed ack stops
the daemon (exit 3) as before. The outcome is already committed when a delete is asked, so
a crash inside the linger means only a redelivery, which the claim answers as a duplicate.
A delete of ten or more messages (a backlog's batch) goes at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from service.core.messages import Received
from service.errors import AckFailed

#: SQS's most entries per DeleteMessageBatch.
MAX_ENTRIES = 10

Delete = Callable[[Sequence[Received]], Awaitable[None]]


class DeleteCoalescer:
    def __init__(self, delete: Delete, linger: float) -> None:
        self._delete = delete
        self.linger = linger
        #: Told of a failed delete whose caller no longer waits for it (cancelled at the
        #: shutdown deadline): the daemon must still stop with exit 3 (service.app wires it).
        self.on_unawaited_failure: Callable[[AckFailed], None] | None = None
        self._pending: list[tuple[list[Received], asyncio.Future[None]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    async def delete_batch(self, messages: Sequence[Received]) -> None:
        if self.linger <= 0 or len(messages) >= MAX_ENTRIES or not messages:
            await self._delete(messages)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Read even when nobody waits any more (a cancelled caller): no "never retrieved".
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending.append((list(messages), future))
        if sum(len(m) for m, _ in self._pending) >= MAX_ENTRIES:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger, self._flush)
        # Shielded: a caller cancelled while it waits (shutdown) leaves its committed
        # messages to be deleted with the others; a failure nobody awaits any more is still
        # reported (on_unawaited_failure), never swallowed.
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(self._report_unawaited)
            raise

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        groups, self._pending = self._pending, []
        while groups:
            call: list[tuple[list[Received], asyncio.Future[None]]] = []
            size = 0
            while groups and size + len(groups[0][0]) <= MAX_ENTRIES:
                size += len(groups[0][0])
                call.append(groups.pop(0))
            task = asyncio.ensure_future(self._send(call))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, call: list[tuple[list[Received], asyncio.Future[None]]]) -> None:
        try:
            await self._delete([m for messages, _ in call for m in messages])
        except AckFailed as exc:
            failed = set(exc.message_ids)
            for messages, future in call:
                mine = [m.message_id for m in messages if m.message_id in failed]
                _settle(future, AckFailed(mine, exc.detail) if mine else None)
        except asyncio.CancelledError:
            # Torn down mid-call (shutdown): whether SQS deleted them is unknown — an ack
            # failure for each caller, as a failed call would be.
            for messages, future in call:
                _settle(future, AckFailed([m.message_id for m in messages],
                                          "the delete was cancelled before SQS answered"))
            raise
        except BaseException as exc:  # handed to every caller of this call
            for _, future in call:
                _settle(future, exc)
        else:
            for _, future in call:
                _settle(future, None)

    def _report_unawaited(self, future: asyncio.Future[None]) -> None:
        exc = None if future.cancelled() else future.exception()
        if isinstance(exc, AckFailed) and self.on_unawaited_failure is not None:
            self.on_unawaited_failure(exc)

    async def drain(self) -> None:
        """Send what lingers now and wait for every call in flight (shutdown)."""
        if self._pending:
            self._flush()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

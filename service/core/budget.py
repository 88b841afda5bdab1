"""The memory budget (SPEC §6, ``INGEST_MAX_INFLIGHT_BYTES``): bytes of message bodies
and S3 payloads held for messages in flight (a body is charged for the objects it parses
into too: ``service.core.limits.held_bytes``). Receiving waits while it is full
(back-pressure); nothing is failed for want of room.

Owners (a poll, a batch) take bytes and give them back. A request that does not fit waits,
first come first served (a batch's payloads before the polls: finishing a batch is what
frees memory) — unless every owner holding bytes is itself waiting: then nobody
would ever give any back, and the first waiter is let in over the limit (by at most one
message's bytes: a batch holding payload bytes never waits for more, it commits what it
holds first, ``service.runtime.resolve``). So the budget never deadlocks.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Waiter:
    owner: object
    n: int
    fut: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                      .create_future())


class MemoryBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._held: collections.Counter[object] = collections.Counter()
        self._waiting: collections.deque[_Waiter] = collections.deque()

    def holds(self, owner: object) -> int:
        return self._held[owner]

    def try_take(self, n: int, owner: object, urgent: bool = False) -> bool:
        """Take ``n`` bytes now if they fit and nobody waits before us (``urgent``: a batch
        in flight, which goes before the polls waiting to receive more)."""
        if (self._waiting and not urgent) or self.used + n > self.limit:
            return False
        self._take(n, owner)
        return True

    async def take(self, n: int, owner: object, urgent: bool = False) -> None:
        """Take ``n`` bytes, waiting for room (``urgent``: ahead of the other waiters)."""
        if self.try_take(n, owner, urgent):
            return
        w = _Waiter(owner, n)
        if urgent:
            self._waiting.appendleft(w)
        else:
            self._waiting.append(w)
        self._wake()
        try:
            await w.fut
        except asyncio.CancelledError:
            if w.fut.done() and not w.fut.cancelled():
                self.give(n, owner)  # granted as we were cancelled: give it back
            elif w in self._waiting:
                self._waiting.remove(w)
                self._wake()
            raise

    def give(self, n: int, owner: object) -> None:
        n = min(n, self._held[owner])
        if n <= 0:
            return
        self.used -= n
        self._held[owner] -= n
        if self._held[owner] <= 0:
            del self._held[owner]
        self._wake()

    def give_all(self, owner: object) -> None:
        self.give(self._held[owner], owner)

    def charge(self, n: int, owner: object) -> None:
        """Count ``n`` bytes that are already in memory (a receive that brought more than the
        room its poll took), over the limit if need be: the next polls wait until they are
        given back."""
        if n > 0:
            self._take(n, owner)

    def move(self, n: int, src: object, dst: object) -> None:
        """Hand ``n`` of ``src``'s bytes to ``dst`` (a poll's bytes to its batch)."""
        n = min(n, self._held[src])
        self._held[src] -= n
        if self._held[src] <= 0:
            del self._held[src]
        if n > 0:
            self._held[dst] += n

    def _take(self, n: int, owner: object) -> None:
        self.used += n
        self._held[owner] += n
        self.peak = max(self.peak, self.used)

    def _wake(self) -> None:
        while self._waiting:
            w = self._waiting[0]
            if w.fut.done():
                self._waiting.popleft()
                continue
            waiting = {x.owner for x in self._waiting}
            stuck = all(o in waiting for o in self._held)
            if self.used + w.n > self.limit and not stuck:
                return
            self._waiting.popleft()
            self._take(w.n, w.owner)
            w.fut.set_result(None)

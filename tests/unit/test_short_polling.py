"""INGEST_WAIT_TIME_SECONDS=0 (accepted by the settings: 0..20) on an empty queue: every
poller sends ReceiveMessage back to back, as fast as the network answers — SPEC §4's
lesson ("short polling at 10 Hz multiplies API calls") without even the 10 Hz."""

from __future__ import annotations

import asyncio
from typing import Any

from service.handlers import Registry
from service.runtime.worker import Worker
from service.settings import Settings
from service.testing import FakeQueue, FakeStore

#: Empty receives the pollers may send in WINDOW seconds: 10 a second in all is already
#: SPEC §4's bad example.
BOUND, WINDOW = 20, 2.0


class CountingQueue(FakeQueue):
    """An empty queue whose receive yields once, like a network call answered at once."""

    def __init__(self) -> None:
        super().__init__()
        self.receives = 0
        self.many = asyncio.Event()

    async def receive(self, *args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0)
        self.receives += 1
        if self.receives >= BOUND:
            self.many.set()
        return await super().receive(*args, **kwargs)


async def test_short_polling_on_an_empty_queue_does_not_spin() -> None:
    s = Settings(queue_url="http://127.0.0.1:1/q", database_url="postgresql://u@h/d",
                 wait_time_seconds=0, pollers=2, shutdown_timeout=5)
    queue = CountingQueue()
    worker = Worker(s, queue, FakeStore(), Registry())
    task = asyncio.create_task(worker.run())
    try:
        try:
            await asyncio.wait_for(queue.many.wait(), WINDOW)
        except TimeoutError:
            pass  # fewer than BOUND receives in the whole window: what we want
        spun = queue.receives
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 10)
    assert spun < BOUND, f"{spun} empty receives in under {WINDOW} s"

"""The claims registry (service.core.claims): a request_id claimed by a batch in flight is held
until every batch holding it lets go, and the own-leak GC is told about it meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from service.core.claims import ClaimsRegistry
from service.handlers import Registry
from service.runtime.worker import Worker
from service.testing import FakeQueue, FakeStore
from tests.unit.test_worker import Note, body, settings, until


def test_a_request_id_is_held_until_every_holder_drops_it() -> None:
    claims = ClaimsRegistry()
    claims.hold("a")
    claims.hold("a")  # two batches in flight claimed it (a redelivered copy)
    claims.hold("b")
    claims.drop("a")
    assert sorted(claims) == ["a", "b"]
    claims.drop("a")
    claims.drop("b")
    assert list(claims) == []
    assert len(claims) == 0


class RecordingStore(FakeStore):
    def __init__(self) -> None:
        super().__init__()
        self.spared: list[list[str]] = []

    async def gc_own_leaks(self, holding: Sequence[str]) -> list[str]:
        self.spared.append(list(holding))
        return await super().gc_own_leaks(holding)


async def test_the_own_leak_gc_spares_what_a_batch_in_flight_holds() -> None:
    started, release = asyncio.Event(), asyncio.Event()
    registry = Registry()

    async def slow(p: Note, conn: Any) -> None:
        started.set()
        await release.wait()

    registry.register("note", Note, slow)
    queue, store = FakeQueue(), RecordingStore()
    worker = Worker(settings(), queue, store, registry, visibility_timeout=30,
                    rng=lambda: 0.0)
    queue.send(body("held-1"))
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(started.wait(), 10)
        seen = len(store.spared)
        await until(lambda: len(store.spared) > seen, "a GC pass while the handler runs")
        assert store.spared[-1] == ["held-1"]
        release.set()
        await until(lambda: store.db.rows.get("held-1") is not None
                    and store.db.rows["held-1"].status == "COMPLETED", "the completion")
        await until(lambda: not list(worker.batches.holding), "the batch letting go")
    finally:
        release.set()
        worker.request_stop()
        await asyncio.wait_for(task, 20)

"""A handler that raises a BaseException that is not an Exception (SystemExit from a library's
``sys.exit()``, KeyboardInterrupt, GeneratorExit, a class of its own): its failure, like any
other exception — not the end of the batch's task (and, in the daemon, of the process)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel

from service.core.retry import ReceiveLimit, RetryPolicy
from service.handlers import Registry
from service.runtime.batch import BatchProcessor
from service.runtime.dbhealth import DatabaseHealth
from service.testing import FakeQueue, FakeStore


class P(BaseModel):
    pass


class OwnBase(BaseException):
    """A handler library's own BaseException subclass."""


def body(rid: str, type_: str) -> str:
    return json.dumps({"request_id": rid, "type": type_, "payload": {}})


async def _noop() -> None:
    return None


@pytest.mark.parametrize("exc", [SystemExit(0), KeyboardInterrupt(), GeneratorExit(),
                                 OwnBase("own")], ids=lambda e: type(e).__name__)
async def test_a_handlers_base_exception_is_its_failure(exc: BaseException) -> None:
    async def ok(_p: P, _conn: Any) -> dict[str, Any]:
        return {"ok": True}

    async def raises(_p: P, _conn: Any) -> None:
        raise exc

    reg = Registry()
    reg.register("ok", P, ok)
    reg.register("raises", P, raises)
    queue, store = FakeQueue(), FakeStore()
    health = DatabaseHealth(store, asyncio.Event(), _noop)
    proc = BatchProcessor(queue, store, reg, RetryPolicy(max_failures=3), health, fifo=False,
                          visibility_timeout=30, handler_timeout=0, fatal=lambda *a, **k: None,
                          limit=ReceiveLimit(3))
    neighbour = queue.send(body("neighbour", "ok"))
    bad = queue.send(body("bad", "raises"))
    escaped: BaseException | None = None
    try:
        await proc.run(await queue.receive(10, 0, 30))
    except BaseException as e:  # caught: a KeyboardInterrupt must not end pytest's run
        escaped = e
    assert escaped is None
    assert queue.deleted == [neighbour]
    assert store.failures == {"bad": 1}
    assert [m for m, _ in queue.visibility_calls] == [bad]

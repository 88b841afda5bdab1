"""How handlers are called (service.handlers.invoke): a CancelledError that a handler raises of
its own is its failure; a real cancellation of the batch still cancels."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from service.core.messages import Message, Received, payload_hash
from service.handlers import Registry
from service.handlers.invoke import HandlerCancelled, Invoker


class P(BaseModel):
    n: int


def message(rid: str) -> Message:
    return Message(Received("m-" + rid, "rh", "{}", 1), rid, "t", P(n=1), {"n": 1},
                   payload_hash({"n": 1}))


async def _raises_cancelled(*_: Any) -> Any:
    raise asyncio.CancelledError("an inner task of the handler's library")


def invoker(fn: Any, timeout: float = 0) -> Invoker:
    reg = Registry()
    reg.register("t", P, fn)
    reg.register_batch("t", fn)
    return Invoker(reg, timeout)


@pytest.mark.parametrize("form", ["one", "many"])
async def test_a_cancelled_error_nobody_asked_for_is_the_handlers_failure(form: str) -> None:
    inv = invoker(_raises_cancelled)
    call = inv.one(message("a"), None) if form == "one" else inv.many([message("a")], None)
    with pytest.raises(HandlerCancelled, match="inner task") as caught:
        await call
    assert isinstance(caught.value.__cause__, asyncio.CancelledError)
    # Exception, not BaseException: what completion's `except Exception` counts as a failure.
    assert isinstance(caught.value, Exception)


@pytest.mark.parametrize("form", ["one", "many"])
async def test_a_real_cancellation_of_the_batch_still_cancels(form: str) -> None:
    started = asyncio.Event()

    async def waits(*_: Any) -> Any:
        started.set()
        await asyncio.Event().wait()

    inv = invoker(waits)
    task = asyncio.create_task(
        inv.one(message("a"), None) if form == "one" else inv.many([message("a")], None))
    await asyncio.wait_for(started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_handler_timeout_is_still_a_timeout() -> None:
    async def sleeps(*_: Any) -> Any:
        await asyncio.Event().wait()

    with pytest.raises(TimeoutError):
        await invoker(sleeps, timeout=0.01).one(message("a"), None)

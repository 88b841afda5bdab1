"""An ack that fails for any transport reason takes the ack-failure path (AckFailed:
ack_failures_total, exit 3), not the generic batch failure."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from service.adapters.sqs import SqsQueue
from service.core.messages import Received
from service.errors import AckFailed


class _Client:
    """A stand-in aiobotocore client whose DeleteMessageBatch raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def delete_message_batch(self, **kwargs: Any) -> dict[str, Any]:
        raise self.exc


@pytest.mark.parametrize("exc", [
    aiohttp.ServerDisconnectedError(),
    aiohttp.ClientPayloadError("response cut off"),
    TimeoutError(),
    ConnectionResetError(104, "Connection reset by peer"),
], ids=lambda e: type(e).__name__)
async def test_a_transport_error_of_delete_batch_is_an_ack_failure(exc: BaseException) -> None:
    queue = SqsQueue(_Client(exc), "http://127.0.0.1:1/q")
    messages = [Received(f"m{i}", f"rh{i}", "{}", 1, None) for i in range(12)]
    with pytest.raises(AckFailed) as info:
        await queue.delete_batch(messages)
    assert info.value.message_ids == [f"m{i}" for i in range(10)]  # the first chunk failed
    assert info.value.__cause__ is exc

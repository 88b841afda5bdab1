"""The daemon's AWS calls carry ``sqs-ingest/<version>`` first in their User-Agent (what
CloudTrail's ``userAgent`` shows), a string fixed at start-up (``service.adapters.sqs.user_agent``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiobotocore.session import get_session
from aiohttp import web

from service import __version__
from service.adapters.sqs import SqsQueue, sqs_client


@pytest.fixture
async def sqs_stub() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP endpoint on loopback answering every SQS JSON call with an empty result."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.headers.get("User-Agent", ""))
        return web.json_response({}, content_type="application/x-amz-json-1.0")

    app = web.Application()
    app.router.add_post("/", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # started
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_every_call_names_the_daemon_first(
    sqs_stub: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, seen = sqs_stub
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    session = get_session()
    async with sqs_client("us-east-1", endpoint, session=session) as client:
        queue = SqsQueue(client, f"{endpoint}/000000000000/q")
        assert await queue.receive(wait_seconds=0) == []
        await queue.delete_batch([])  # no call: nothing to delete
        assert await queue.change_visibility_batch([]) == []
        await queue.receive(wait_seconds=0)
    assert len(seen) == 2
    assert seen[0] == seen[1]
    assert seen[0].startswith(f"sqs-ingest/{__version__} ")
    assert seen[0].removeprefix(f"sqs-ingest/{__version__} ") == session.user_agent()

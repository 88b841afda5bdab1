"""A small HTTP proxy between the daemon and the SQS emulator that injects faults.

Modes for DeleteMessageBatch / DeleteMessage (SQS JSON protocol, ``X-Amz-Target``):

- ``refuse``: answer 500 without forwarding (the delete never reaches the queue);
- ``lie``: forward, then answer 500 (the delete happened, the caller is told it failed);
- ``partial``: forward all entries but the first, answer 200 with the first in ``Failed``.

``latency_ms`` delays every request (real SQS is 10-30 ms away). Runs in a thread with its
own event loop, so the daemon under test can be a separate process.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from typing import Any, Self

import aiohttp
from aiohttp import web

from tests.servers import free_port

DELETE_ACTIONS = {"AmazonSQS.DeleteMessageBatch", "AmazonSQS.DeleteMessage"}


class LoopThread:
    """A test server in a thread with its own event loop, so the process under test can be
    another: ``with`` starts it (``_start`` on that loop) and stops it (``_stop``)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError


class FaultProxy(LoopThread):
    def __init__(self, upstream: str, latency_ms: float = 0.0) -> None:
        super().__init__()
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mode: str | None = None
        self.latency_ms = latency_ms
        self.faults_injected = 0  # delete calls answered with a fault (not merely forwarded)
        self.failed_receipts: list[str] = []  # receipt handles the caller was told failed
        self.message_ids: dict[str, str] = {}  # receipt handle → MessageId, from receives
        self.requests = 0
        #: requests being served now, by action (e.g. "ReceiveMessage": long polls in flight)
        self.in_flight: collections.Counter[str] = collections.Counter()
        #: requests served, by action (the cost figures of ``make bench``: bench/costs.py)
        self.by_action: collections.Counter[str] = collections.Counter()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=200), auto_decompress=False)
        app = web.Application(client_max_size=10 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    async def _forward(self, request: web.Request, body: bytes) -> tuple[int, dict[str, str], bytes]:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in ("host", "content-length", "transfer-encoding")}
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=body, headers=headers) as resp:
            out = await resp.read()
            keep = {k: v for k, v in resp.headers.items()
                    if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                         "content-encoding")}
            return resp.status, keep, out

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        action = request.headers.get("X-Amz-Target", "").rpartition(".")[2]
        self.by_action[action] += 1
        self.in_flight[action] += 1
        try:
            return await self._serve(request)
        finally:
            self.in_flight[action] -= 1

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        if self.latency_ms:
            await asyncio.sleep(self.latency_ms / 1000)
        target = request.headers.get("X-Amz-Target", "")
        mode = self.mode
        if mode in ("refuse", "lie") and target in DELETE_ACTIONS:
            self.faults_injected += 1
            self.failed_receipts.extend(_receipts(body))
            if mode == "refuse":
                return _error(500, "InternalError", "injected: delete refused")
            await self._forward(request, body)
            return _error(500, "InternalError", "injected: delete done, answered 500")
        if mode == "partial" and target == "AmazonSQS.DeleteMessageBatch":
            # A single DeleteMessage is forwarded untouched: "partial" fails one batch entry.
            doc = json.loads(body)
            failed, rest = doc["Entries"][0], doc["Entries"][1:]
            self.faults_injected += 1
            self.failed_receipts.append(failed["ReceiptHandle"])
            ok: list[dict[str, Any]] = []
            if rest:
                doc["Entries"] = rest
                status, _, out = await self._forward(request, json.dumps(doc).encode())
                ok = json.loads(out).get("Successful", []) if status == 200 else []
            return web.json_response(
                {"Successful": ok, "Failed": [{"Id": failed["Id"], "SenderFault": False,
                                               "Code": "InternalError",
                                               "Message": "injected: entry failed"}]},
                content_type="application/x-amz-json-1.0")
        status, headers, out = await self._forward(request, body)
        if target == "AmazonSQS.ReceiveMessage" and status == 200:
            for m in json.loads(out).get("Messages", []):
                self.message_ids[m["ReceiptHandle"]] = m["MessageId"]
        return web.Response(status=status, body=out, headers=headers)

    def failed_message_ids(self) -> set[str]:
        """MessageIds of the deletes the caller was told failed."""
        return {self.message_ids[r] for r in self.failed_receipts}


def _receipts(body: bytes) -> list[str]:
    doc = json.loads(body)
    if "Entries" in doc:
        return [e["ReceiptHandle"] for e in doc["Entries"]]
    return [doc["ReceiptHandle"]]


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(
        status=status, text=json.dumps({"__type": code, "message": message}),
        headers={"Content-Type": "application/x-amz-json-1.0", "x-amzn-query-error": f"{code};Receiver"})

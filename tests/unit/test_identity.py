"""service.adapters.identity: the replica's default name from the ECS container metadata."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from service.adapters.identity import METADATA_ENV, ecs_worker_name
from tests.servers import free_port


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[ThreadingHTTPServer] = []

    def start(body: bytes) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v4/c"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_task_arn_and_container_name(serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(METADATA_ENV, serve(json.dumps({"Name": "ingest", "Labels": {
        "com.amazonaws.ecs.task-arn": "arn:aws:ecs:eu-west-1:1:task/c/abc",
        "com.amazonaws.ecs.container-name": "ingest"}}).encode()))
    assert ecs_worker_name() == "arn:aws:ecs:eu-west-1:1:task/c/abc/ingest"


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"Name": "x"}',
                                  b'{"Name": "x", "Labels": {"com.amazonaws.ecs.task-arn": ""}}'])
def test_no_name_from_an_incomplete_answer(serve: Any, monkeypatch: pytest.MonkeyPatch,
                                          body: bytes) -> None:
    monkeypatch.setenv(METADATA_ENV, serve(body))
    assert ecs_worker_name() is None


def test_no_name_off_ecs_or_when_the_endpoint_is_down(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(METADATA_ENV, raising=False)
    assert ecs_worker_name() is None
    monkeypatch.setenv(METADATA_ENV, f"http://127.0.0.1:{free_port()}/v4/c")
    assert ecs_worker_name(timeout=1) is None

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.harness import Daemon, create_ledger


@pytest.fixture
async def database_url(database_url: str) -> str:
    """The per-test migrated database, plus the ledger the workload's counting effect needs."""
    await create_ledger(database_url)
    return database_url


@pytest.fixture
def make_queue(sqs_client: Any):
    """A fresh queue with a short visibility timeout, so redeliveries come quickly."""

    def make(visibility: int = 5, fifo: bool = False) -> str:
        name = "chaos-" + uuid.uuid4().hex[:10] + (".fifo" if fifo else "")
        attrs = {"VisibilityTimeout": str(visibility)}
        if fifo:
            attrs.update(FifoQueue="true", ContentBasedDeduplication="true")
        return str(sqs_client.create_queue(QueueName=name, Attributes=attrs)["QueueUrl"])

    return make


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Starts daemons (``spawn(env, name="daemon")``); any still running when the test ends
    (a failed test) is killed."""
    started: list[Daemon] = []

    def start(env: dict[str, str], name: str = "daemon") -> Daemon:
        started.append(Daemon(env, tmp_path, name).start())
        return started[-1]

    yield start
    for d in started:
        if not d.exited():
            d.kill9()

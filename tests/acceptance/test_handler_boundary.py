"""The real daemon against a handler author's mistakes: each is that message's failure —
dead-lettered at the limit — and the daemon goes on with the next message."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.acceptance.harness import CHAOS_HANDLERS, Daemon, daemon_env
from tests.servers import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


#: How the dead letter names each mistake.
EXPECTED_ERROR = {
    "exits": "HandlerBaseException: ",
    "closes": "HandlerClosedConnection: ",
    "leaves_a_query_running": "ValueError: left a query running",
}


def body(rid: str, type_: str) -> str:
    return json.dumps({"request_id": rid, "type": type_, "payload": {}})


async def _fetch(dsn: str, sql: str) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


def fetch_now(dsn: str, sql: str) -> Any:
    """For the sync wait loops (run on a private loop, as harness.completed_now does)."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, _fetch(dsn, sql)).result(30)


@pytest.mark.parametrize("mistake", ["exits", "closes", "leaves_a_query_running"])
async def test_a_handler_mistake_is_dead_lettered_and_the_daemon_lives_on(
    mistake: str, sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str,
    tmp_path: Path,
) -> None:
    """``sys.exit()`` in a handler, a handler closing its connection, a handler leaving a
    query running on it: before their fixes the first ended the daemon, the other two read
    as a database outage — handed back uncounted on every delivery, never dead-lettered."""
    conn = await asyncpg.connect(database_url)
    await conn.execute("CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, request_id text)")
    queue_url = make_queue(visibility=30)
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint,
                          INGEST_HANDLERS=f"{CHAOS_HANDLERS},tests.acceptance.boundary_handlers",
                          INGEST_MAX_RECEIVE_COUNT="2"), tmp_path).start()
    try:
        d.wait_ready()
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=body(mistake, f"boundary.{mistake}"))
        wait_until(lambda: d.exited() or fetch_now(
                       database_url, "SELECT count(*) FROM dead_letters") == 1, 60,
                   "dead-lettered, or the daemon gone")
        assert not d.exited(), f"exit code {d.proc.returncode if d.proc else None}: {d.logs()}"
        error = fetch_now(database_url, "SELECT error FROM dead_letters")
        assert error.startswith(EXPECTED_ERROR[mistake]), error
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=body("after", "boundary.ok"))
        wait_until(lambda: d.exited() or fetch_now(
                       database_url, "SELECT count(*) FROM chaos_effects") == 1, 30, "the next one")
        assert d.stop() == 0, d.logs()
    finally:
        if not d.exited():
            d.kill9()
        await conn.close()

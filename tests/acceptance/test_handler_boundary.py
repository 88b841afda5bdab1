"""The real daemon against a handler author's mistakes (bugs: xfail strict until fixed)."""

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


async def test_a_handler_calling_sys_exit_is_dead_lettered_and_the_daemon_lives_on(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, tmp_path: Path
) -> None:
    conn = await asyncpg.connect(database_url)
    await conn.execute("CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, request_id text)")
    queue_url = make_queue(visibility=30)
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint,
                          INGEST_HANDLERS=f"{CHAOS_HANDLERS},tests.acceptance.boundary_handlers",
                          INGEST_MAX_RECEIVE_COUNT="2"), tmp_path).start()
    try:
        d.wait_ready()
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=body("exits", "boundary.exits"))
        wait_until(lambda: d.exited() or fetch_now(
                       database_url, "SELECT count(*) FROM dead_letters") == 1, 60,
                   "dead-lettered, or the daemon gone")
        assert not d.exited(), f"exit code {d.proc.returncode if d.proc else None}: {d.logs()}"
        sqs_client.send_message(QueueUrl=queue_url, MessageBody=body("after", "boundary.ok"))
        wait_until(lambda: d.exited() or fetch_now(
                       database_url, "SELECT count(*) FROM chaos_effects") == 1, 30, "the next one")
        assert d.stop() == 0, d.logs()
    finally:
        if not d.exited():
            d.kill9()
        await conn.close()

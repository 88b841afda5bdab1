"""The replica's name from the ECS task metadata when INGEST_WORKER_NAME is unset (issue 25):
a kill -9 and an in-place restart release the previous incarnation's claims at start-up,
not a lease later — a FIFO group is not held behind them for the whole lease."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.acceptance.harness import Daemon, daemon_env
from tests.servers import wait_until

TASK_ARN = "arn:aws:ecs:us-east-1:123456789012:task/ingest/0123456789abcdef"


@pytest.fixture
def ecs_metadata() -> Iterator[str]:
    """The container metadata endpoint (v4) as the ECS agent serves it, on loopback."""
    doc = json.dumps({"DockerId": "d0", "Name": "sqs-ingest", "Labels": {
        "com.amazonaws.ecs.task-arn": TASK_ARN,
        "com.amazonaws.ecs.container-name": "sqs-ingest"}}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(doc)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v4/d0"
    finally:
        server.shutdown()
        server.server_close()


async def fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


@pytest.mark.timeout(180)
async def test_an_ecs_task_restarted_in_place_releases_its_claims_at_start(
    database_url: str, make_queue: Any, sqs_client: Any, sqs_endpoint: str,
    spawn: Callable[..., Daemon], ecs_metadata: str, tmp_path: Path,
) -> None:
    await fetch(database_url, "CREATE TABLE chaos_effects (id bigserial PRIMARY KEY,"
                              " request_id text)")
    queue = make_queue(visibility=30)
    # A lease far longer than the wait below: only the name can release the claim in time.
    env = daemon_env(database_url, queue, sqs_endpoint, INGEST_WORKER_LEASE="120",
                     ECS_CONTAINER_METADATA_URI_V4=ecs_metadata, CHAOS_DIR=str(tmp_path))
    d = spawn(env)
    d.wait_ready()
    sqs_client.send_message(QueueUrl=queue, MessageBody=json.dumps(
        {"request_id": "slow-1", "type": "chaos.slow", "payload": {"seconds": 60}}))

    def claim_owner() -> str | None:
        import asyncio
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            rows = ex.submit(asyncio.run, fetch(
                database_url, "SELECT owner FROM modifications WHERE request_id = 'slow-1'"
                              " AND status = 'IN_PROGRESS'")).result(30)
        return rows[0]["owner"] if rows else None

    wait_until(lambda: claim_owner() is not None, 60, "slow-1 claimed")
    first = claim_owner()
    d.kill9()
    d.start()
    d.wait_ready(60)
    # Released by the start-up GC (the same name), well before the 120 s lease.
    wait_until(lambda: claim_owner() != first, 30, "the killed incarnation's claim released")
    names = {r["worker_name"] for r in await fetch(database_url,
                                                    "SELECT worker_name FROM workers")}
    assert names == {f"{TASK_ARN}/sqs-ingest"}
    # Logged after the release has committed (and the GC's next statement): wait for it.
    try:
        wait_until(lambda: [line for line in d.full_logs().splitlines()
                            if '"orphan_released"' in line and "slow-1" in line],
                   30, "orphan_released logged")
    except TimeoutError:
        raise AssertionError(d.logs()) from None

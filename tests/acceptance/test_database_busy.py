"""No healthy message lost to the database (SPEC §7): the real ``sqs-ingest`` process on
LocalStack's SQS, a queue whose RedrivePolicy moves a message after 3 receives, and a
session holding ``LOCK TABLE modifications IN ACCESS EXCLUSIVE MODE`` (a table rewrite)
while healthy requests arrive.

- Under a database ``statement_timeout`` (or ``lock_timeout``) shorter than the lock, every
  claim fails with the database's own error (57014 / 55P03), round after round, for longer
  than three visibility timeouts. Those rounds are deferrals, like an outage's: once the
  lock goes, every request completes exactly once, nothing is in ``dead_letters`` and
  nothing in the SQS dead-letter queue.
- Without a timeout, the statements wait on the lock while the visibility timeouts run out:
  the heartbeat keeps the batch hidden and the same holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import boto3
import pytest

from tests.acceptance.harness import Daemon, completed_now, ledger, ledger_rows, send_all
from tests.acceptance.test_redrive import (
    MAX_RECEIVE_COUNT,
    dead_letter_count,
    depth,
    env_for,
    fetch,
    queue_with_dlq,
    recent_events,
)
from tests.servers import wait_until

pytestmark = pytest.mark.timeout(180)

REQUESTS = 24


@pytest.fixture
def sqs(localstack: str) -> Any:
    return boto3.client("sqs", endpoint_url=localstack, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


async def database_setting(dsn: str, name: str, value: str) -> None:
    """``ALTER DATABASE … SET``: every connection the daemon opens afterwards runs under it."""
    conn = await asyncpg.connect(dsn)
    try:
        db = await conn.fetchval("SELECT current_database()")
        await conn.execute(f'ALTER DATABASE "{db}" SET {name} = \'{value}\'')
    finally:
        await conn.close()


async def hold_lock(dsn: str) -> tuple[asyncpg.Connection, Any]:
    """A session holding ACCESS EXCLUSIVE on ``modifications`` until its transaction ends."""
    conn = await asyncpg.connect(dsn, server_settings={"statement_timeout": "0",
                                                       "lock_timeout": "0"})
    tx = conn.transaction()
    await tx.start()
    await conn.execute("LOCK TABLE modifications IN ACCESS EXCLUSIVE MODE")
    return conn, tx


@pytest.mark.parametrize("timeout", ["statement_timeout", "lock_timeout", None])
async def test_a_table_lock_moves_no_healthy_message_to_any_dead_letter_queue(
    sqs: Any, localstack: str, database_url: str, spawn: Callable[..., Daemon],
    tmp_path: Path, timeout: str | None,
) -> None:
    if timeout is not None:
        await database_setting(database_url, timeout, "1500ms")
    src, dlq = queue_with_dlq(sqs)
    d = spawn(env_for(database_url, src, localstack, tmp_path, INGEST_POLLERS="2"))
    d.wait_ready()
    requests = {f"h-{i}": ledger(f"h-{i}", f"g{i % 4}", i) for i in range(REQUESTS)}

    def until(pred: Callable[[], object], seconds: float, what: str) -> None:
        def checked() -> object:
            assert not d.exited(), d.logs()
            return pred()
        try:
            wait_until(checked, seconds, what, interval=0.3)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{recent_events(d, 40)}") from None

    def lost() -> bool:
        return depth(sqs, dlq) > 0 or dead_letter_count(database_url) > 0

    conn, tx = await hold_lock(database_url)
    try:
        send_all(sqs, src, list(requests.values()))
        if timeout is not None:
            # Each message is received more often than maxReceiveCount allows while its
            # claims keep failing (today's code lost some meanwhile: stop waiting then).
            until(lambda: lost() or d.metric("sqs_ingest_messages_received_total")
                  >= (MAX_RECEIVE_COUNT + 1) * REQUESTS, 90, "rounds under the lock")
        else:
            # Statements queue behind the lock while visibility timeouts run out: the
            # batch's heartbeat must keep extending them.
            until(lambda: lost() or d.metric("sqs_ingest_visibility_extensions_total")
                  >= 2 * (MAX_RECEIVE_COUNT + 1) * REQUESTS, 90,
                  "visibility timeouts under the lock")
    finally:
        await tx.rollback()
        await conn.close()
    until(lambda: depth(sqs, src) == 0, 60, "the source queue drained")
    assert depth(sqs, dlq) == 0, "a healthy message reached the SQS DLQ\n" + recent_events(d)
    assert await fetch(database_url, "SELECT reason, error FROM dead_letters") == []
    assert completed_now(database_url) == REQUESTS
    assert Counter(r["request_id"] for r in await ledger_rows(database_url)) == dict.fromkeys(
        requests, 1)
    assert d.stop() == 0, d.logs()

"""Slow and flaky handlers in the real daemon: SIGTERM mid-batch, visibility heartbeat,
retries with backoff, dead-lettering after the maximum receives."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.acceptance.harness import Daemon, daemon_env, queue_depth, wait_drained
from tests.servers import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


def body(rid: str, type_: str, **payload: Any) -> str:
    return json.dumps({"request_id": rid, "type": type_, "payload": payload})


def invocations(d: Path) -> list[str]:
    p = d / "invocations.log"
    return p.read_text().splitlines() if p.exists() else []


@pytest.fixture
async def effects_db(database_url: str) -> str:
    conn = await asyncpg.connect(database_url)
    await conn.execute("CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, request_id text)")
    await conn.close()
    return database_url


def env_for(dsn: str, queue_url: str, endpoint: str, chaos_dir: Path, **extra: str) -> dict[str, str]:
    # daemon_env loads tests.acceptance.chaos_handlers already.
    return daemon_env(dsn, queue_url, endpoint, CHAOS_DIR=str(chaos_dir), **extra)


async def effects(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return [r["request_id"] for r in await conn.fetch(
            "SELECT request_id FROM chaos_effects ORDER BY id")]
    finally:
        await conn.close()


async def test_sigterm_mid_batch_finishes_and_acks_then_exits_0(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, effects_db: str, tmp_path: Path
) -> None:
    queue_url = make_queue(visibility=30)
    d = Daemon(env_for(effects_db, queue_url, sqs_endpoint, tmp_path,
                       INGEST_SHUTDOWN_TIMEOUT="20"), tmp_path).start()
    d.wait_ready()
    # The handler runs until the test has seen the 503 (a file it waits for, 15 s at most):
    # a fixed sleep could end, and the daemon exit, before a loaded machine's first probe.
    sqs_client.send_message(QueueUrl=queue_url, MessageBody=body(
        "slow-1", "chaos.slow", seconds=15, until="release"))
    wait_until(lambda: invocations(tmp_path), 30, "handler started")
    d.signal(signal.SIGTERM)
    # A 503 from the live process (Daemon.get raises on a closed port, which proves nothing).
    wait_until(lambda: d.get("/readyz")[0] == 503, 30, "not ready while draining")
    (tmp_path / "release").touch()
    started = time.monotonic()
    assert d.wait(25) == 0, d.logs()
    assert time.monotonic() - started < 22  # within the shutdown timeout (+ poll return)
    assert await effects(effects_db) == ["slow-1"]
    assert queue_depth(sqs_client, queue_url) == 0  # acked before exiting
    assert invocations(tmp_path) == ["slow-1"]


async def test_heartbeat_keeps_a_slow_message_from_a_second_replica(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, effects_db: str, tmp_path: Path
) -> None:
    """Visibility 4 s, handler 10 s, two replicas: the heartbeat extends the visibility, so
    the other replica never receives it while it runs; the effect happens once."""
    queue_url = make_queue(visibility=4)
    replicas = [Daemon(env_for(effects_db, queue_url, sqs_endpoint, tmp_path), tmp_path, f"r{i}")
                for i in range(2)]
    for r in replicas:
        r.start()
    for r in replicas:
        r.wait_ready()
    try:
        sqs_client.send_message(QueueUrl=queue_url,
                                MessageBody=body("slow-hb", "chaos.slow", seconds=10))
        wait_drained(sqs_client, queue_url, replicas, timeout=60)
        # Received exactly once across both replicas: never redelivered while running.
        received = sum(r.metric("sqs_ingest_messages_received_total") for r in replicas)
        extensions = sum(r.metric("sqs_ingest_visibility_extensions_total") for r in replicas)
        codes = [r.stop() for r in replicas]
    finally:
        for r in replicas:  # no assert here: it would hide the real failure
            if not r.exited():
                r.kill9()
    assert codes == [0, 0], [r.logs() for r in replicas]
    assert received == 1
    assert invocations(tmp_path) == ["slow-hb"]
    assert await effects(effects_db) == ["slow-hb"]
    assert extensions >= 2


async def test_flaky_handler_retried_with_backoff_then_applied_once(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, effects_db: str, tmp_path: Path
) -> None:
    queue_url = make_queue(visibility=30)
    d = Daemon(env_for(effects_db, queue_url, sqs_endpoint, tmp_path,
                       INGEST_MAX_RECEIVE_COUNT="5"), tmp_path).start()
    try:
        d.wait_ready()
        started = time.monotonic()
        for i in range(5):
            sqs_client.send_message(QueueUrl=queue_url,
                                    MessageBody=body(f"flaky-{i}", "chaos.flaky", fail_times=2))
        wait_drained(sqs_client, queue_url, [d], timeout=90)
        elapsed = time.monotonic() - started
        retried = d.metric("sqs_ingest_messages_processed_total", outcome="retried",
                           type="chaos.flaky")
        code = d.stop()
    finally:
        if not d.exited():
            d.kill9()
    assert code == 0, d.logs()
    assert sorted(await effects(effects_db)) == [f"flaky-{i}" for i in range(5)]
    assert len(invocations(tmp_path)) == 15  # 2 failures + 1 success each
    assert retried == 10
    # The backoff is the visibility the daemon sets: base 1 s, equal jitter -> at least
    # 0.5 s + 1 s before the third attempt; without it the queue's 30 s timeout would
    # hold each failed message until after t=60 s.
    assert 1.5 <= elapsed < 30, elapsed
    conn = await asyncpg.connect(effects_db)
    try:
        assert await conn.fetchval("SELECT count(*) FROM retry_attempts") == 0
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 0
    finally:
        await conn.close()


def drain_to_the_end(
    sqs_client: Any, queue_url: str, env: dict[str, str], tmp_path: Path, send: Any
) -> None:
    """One daemon with ``env``: ready, ``send()``, the queue drained, a clean stop (exit 0)."""
    d = Daemon(env, tmp_path).start()
    try:
        d.wait_ready()
        send()
        wait_drained(sqs_client, queue_url, [d], timeout=60)
        code = d.stop()
    finally:
        if not d.exited():
            d.kill9()
    assert code == 0, d.logs()


async def test_always_failing_handler_ends_in_dead_letters(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, effects_db: str, tmp_path: Path
) -> None:
    queue_url = make_queue(visibility=30)
    raw = body("doomed", "chaos.flaky", fail_times=99)
    drain_to_the_end(
        sqs_client, queue_url,
        env_for(effects_db, queue_url, sqs_endpoint, tmp_path, INGEST_MAX_RECEIVE_COUNT="3"),
        tmp_path, lambda: sqs_client.send_message(QueueUrl=queue_url, MessageBody=raw))
    assert invocations(tmp_path) == ["doomed"] * 3
    conn = await asyncpg.connect(effects_db)
    try:
        row = await conn.fetchrow("SELECT body, reason, error FROM dead_letters")
        assert row["body"] == raw
        assert row["reason"] == "max_receives_exceeded"
        assert "flaky failure 3 of 99" in row["error"]
        assert await conn.fetchval("SELECT count(*) FROM modifications") == 0
    finally:
        await conn.close()
    assert await effects(effects_db) == []


async def test_a_handler_raising_cancelled_error_is_its_failure_not_the_batchs(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, effects_db: str, tmp_path: Path
) -> None:
    """CancelledError raised by a handler nobody cancelled (a library's inner task) is that
    handler's failure: counted, retried, dead-lettered at the maximum — not a cancelled batch,
    which hands every message back at once, uncounted, for ever (and takes its neighbours
    with it)."""
    queue_url = make_queue(visibility=30)
    doomed = body("doomed", "chaos.cancels", times=99)
    drain_to_the_end(
        sqs_client, queue_url,
        env_for(effects_db, queue_url, sqs_endpoint, tmp_path, INGEST_MAX_RECEIVE_COUNT="3"),
        tmp_path, lambda: sqs_client.send_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": "0", "MessageBody": doomed},
            {"Id": "1", "MessageBody": body("once", "chaos.cancels", times=1)},
            {"Id": "2", "MessageBody": body("fine", "chaos.slow", seconds=0)},
        ]))
    assert invocations(tmp_path).count("doomed") == 3
    assert invocations(tmp_path).count("once") == 2
    conn = await asyncpg.connect(effects_db)
    try:
        row = await conn.fetchrow("SELECT body, reason, error FROM dead_letters")
        assert row["body"] == doomed
        assert row["reason"] == "max_receives_exceeded"
        assert "CancelledError" in row["error"] and "3 of 99" in row["error"]
        assert await conn.fetchval("SELECT count(*) FROM dead_letters") == 1
        assert set(await conn.fetchval(
            "SELECT array_agg(request_id) FROM modifications WHERE status = 'COMPLETED'")) == {
                "once", "fine"}
    finally:
        await conn.close()
    assert sorted(await effects(effects_db)) == ["fine", "once"]

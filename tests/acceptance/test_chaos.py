"""The chaos suite: the real daemon under kill -9, ack faults, several replicas, a database
outage. Each scenario ends by checking the same invariants (harness.check_invariants)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.harness import (
    Daemon,
    Workload,
    check_invariants,
    completed_rows,
    daemon_env,
    queue_depth,
    send_all,
    wait_drained,
)
from tests.faultproxy import FaultProxy
from tests.servers import postgres_server, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


def completed(dsn: str) -> int:
    # Called from sync wait loops inside async tests: run on a private loop in a thread.
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, completed_rows(dsn)).result(30)


async def test_kill_9_at_random_moments(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, tmp_path: Path
) -> None:
    """≥1,000 messages fed while the daemon runs; kill -9 at random moments, 6 times."""
    queue_url = make_queue()
    w = Workload(seed=11)
    chunks = [w.bodies(200, prefix=f"k{i}") for i in range(5)]
    rng = random.Random(5)
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint,
                          INGEST_WORKER_NAME="replica-0"), tmp_path).start()
    kills = 0
    try:
        d.wait_ready()
        for chunk in chunks:
            send_all(sqs_client, queue_url, chunk)
            target = completed(database_url) + rng.randrange(20, 120)
            wait_until(lambda t=target: completed(database_url) >= t or
                       queue_depth(sqs_client, queue_url) == 0, 120, "progress before kill")
            time.sleep(rng.random() * 0.5)  # a random moment within a batch
            d.kill9()
            kills += 1
            d.start()
            d.wait_ready()
        d.kill9()  # one more, with the queue still busy with redeliveries
        kills += 1
        d.start()
        wait_drained(sqs_client, queue_url, [d], timeout=240)
        send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:10]))
        wait_drained(sqs_client, queue_url, [d])
        assert d.stop() == 0, d.logs()
    finally:
        if not d.exited():
            d.kill9()
    assert kills >= 5
    counts = await check_invariants(database_url, w, sqs_client, queue_url)
    assert counts["completed"] == 1000


@pytest.mark.parametrize("mode", ["refuse", "lie", "partial"])
async def test_ack_fault_exits_3_and_restart_heals(
    mode: str, sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str,
    tmp_path: Path,
) -> None:
    queue_url = make_queue(visibility=3)
    w = Workload(seed=hash(mode) % 1000)
    send_all(sqs_client, queue_url, w.bodies(60, prefix=mode))
    with FaultProxy(sqs_endpoint) as proxy:
        proxy.mode = mode
        env = daemon_env(database_url, queue_url, proxy.url, INGEST_WORKER_NAME="r0")
        d = Daemon(env, tmp_path).start()
        assert d.wait(60) == 3, d.logs()
        assert proxy.faults_injected >= 1
        assert "ack_failed" in d.full_logs()
        proxy.mode = None  # restarted without the fault
        d.start()
        wait_drained(sqs_client, queue_url, [d])
        send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:3]))
        wait_drained(sqs_client, queue_url, [d])
        assert d.stop() == 0, d.logs()
    await check_invariants(database_url, w, sqs_client, queue_url)


async def test_three_replicas_one_killed_repeatedly(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, tmp_path: Path
) -> None:
    queue_url = make_queue()
    w = Workload(seed=3)
    replicas = [Daemon(daemon_env(database_url, queue_url, sqs_endpoint), tmp_path, f"r{i}")
                for i in range(3)]
    victim = replicas[0]
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready()
        for i in range(4):
            send_all(sqs_client, queue_url, w.bodies(150, prefix=f"t{i}"))
            target = min(completed(database_url) + 40, len(w.valid))
            wait_until(lambda t=target: completed(database_url) >= t, 120, "progress")
            victim.kill9()
            victim.start()
        victim.wait_ready()
        wait_drained(sqs_client, queue_url, replicas, timeout=240)
        send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:5]))
        wait_drained(sqs_client, queue_url, replicas)
        for r in replicas:
            assert r.stop() == 0, r.logs()
    finally:
        for r in replicas:
            if not r.exited():
                r.kill9()
    await check_invariants(database_url, w, sqs_client, queue_url)


async def test_database_outage_mid_stream(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, tmp_path: Path
) -> None:
    from service.migrate import migrate

    queue_url = make_queue()
    with postgres_server() as pg:
        dsn = pg.dsn()
        await migrate(dsn)
        w = Workload(seed=4)
        d = Daemon(daemon_env(dsn, queue_url, sqs_endpoint), tmp_path).start()
        try:
            d.wait_ready()
            send_all(sqs_client, queue_url, w.bodies(300, prefix="o"))
            wait_until(lambda: completed(dsn) >= 50, 60, "progress before the outage")
            pg.stop("immediate")
            wait_until(lambda: d.get("/readyz")[0] == 503, 30, "not ready during the outage")
            outage_started = time.monotonic()
            while time.monotonic() - outage_started < 15:
                assert d.get("/readyz")[0] == 503
                assert not d.exited(), d.logs()  # no crash loop
                time.sleep(0.5)
            pg.start()
            wait_until(d.ready, 60, "ready again")
            wait_drained(sqs_client, queue_url, [d], timeout=180)
            assert d.metric("sqs_ingest_db_errors_total") >= 1
            assert d.stop() == 0, d.logs()
        finally:
            if not d.exited():
                d.kill9()
        counts = await check_invariants(dsn, w, sqs_client, queue_url)
        assert counts["completed"] == 300


def test_sigterm_releases_what_idle_polls_bring(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, tmp_path: Path
) -> None:
    """SIGTERM with idle 20 s long polls in flight, then messages sent at once: the stopping
    daemon hands them back (visibility 0), so a second daemon gets them without waiting out
    the 120 s visibility timeout."""
    queue_url = make_queue(visibility=120)
    env = daemon_env(database_url, queue_url, sqs_endpoint, INGEST_WAIT_TIME_SECONDS="20",
                     INGEST_POLLERS="4", INGEST_SHUTDOWN_TIMEOUT="30")
    a = Daemon(env, tmp_path, "a").start()
    a.wait_ready()
    time.sleep(0.5)  # let the pollers enter their long polls
    a.signal(signal.SIGTERM)
    w = Workload(seed=9)
    sent_at = time.monotonic()
    send_all(sqs_client, queue_url, w.bodies(20, prefix="idle"))
    assert a.wait(40) == 0, a.logs()
    assert "released_after_stop" in a.full_logs()
    b = Daemon(env, tmp_path, "b").start()
    try:
        wait_drained(sqs_client, queue_url, [b], timeout=90)
        # Had the stopping daemon kept them, they would be hidden for 120 s after sending.
        assert time.monotonic() - sent_at < 110
    finally:
        assert b.stop() == 0
    assert completed(database_url) == len(w.valid)

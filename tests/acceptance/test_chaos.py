"""The chaos suite: the real daemon under kill -9, ack faults, several replicas, a database
outage. Each scenario ends by checking the same invariants (harness.check_invariants).

Randomised scenarios print their seed; ``CHAOS_SEED=N`` replays one."""

from __future__ import annotations

import random
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.harness import (
    Daemon,
    Workload,
    chaos_seed,
    check_group_order,
    check_invariants,
    completed_now,
    completed_rows,
    create_ledger,
    daemon_env,
    fifo_ledger,
    in_flight,
    log_events,
    queue_depth,
    send_all,
    send_fifo,
    wait_drained,
)
from tests.faultproxy import FaultProxy
from tests.servers import postgres_server, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]


completed = completed_now  # the name the tests below use


@pytest.mark.parametrize("mix", ["mixed", "reference"])
async def test_kill_9_at_random_moments(
    mix: str, sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str,
    tmp_path: Path,
) -> None:
    """≥1,000 messages fed while the daemon runs; kill -9 at random moments, 6 times, each
    one while the daemon holds received, un-acked messages. ``mixed``: the ledger's handler
    beside the reference handlers on 40 entities (batches through the completing
    transaction); ``reference``: the reference handlers alone on entities that almost never
    meet twice in a batch (each batch one statement)."""
    seed = chaos_seed(11)
    queue_url = make_queue()
    w = (Workload(seed=seed) if mix == "mixed"
         else Workload(seed=seed, entities=1_000_000, ledger_share=0))
    chunks = [w.bodies(200, prefix=f"k{i}") for i in range(5)]
    rng = random.Random(f"{seed}-kills")
    held_at_kill: list[int] = []
    # Behind a 40 ms SQS (real SQS is 10-30 ms away) with two pollers, a chunk takes
    # seconds, not the blink of a loopback emulator: the kill lands inside the work.
    with FaultProxy(sqs_endpoint, latency_ms=40) as proxy:
        d = Daemon(daemon_env(database_url, queue_url, proxy.url, INGEST_POLLERS="2",
                              INGEST_WORKER_NAME="replica-0"), tmp_path).start()

        def kill_when_busy() -> None:
            wait_until(lambda: d.metric("sqs_ingest_in_flight_messages") > 0, 30,
                       "messages in flight")
            d.kill9()
            # What the dead process had received and not acked stays invisible: proof
            # that the kill came in the middle of work, not between batches of an idle daemon.
            held_at_kill.append(in_flight(sqs_client, queue_url))

        try:
            d.wait_ready()
            for chunk in chunks:
                # A random moment within the chunk: after 20..119 of its ~200 requests
                # completed (the target is taken before sending: always reachable).
                target = completed(database_url) + rng.randrange(20, 120)
                send_all(sqs_client, queue_url, chunk)
                wait_until(lambda t=target: completed(database_url) >= t, 120,
                           "progress before kill")
                kill_when_busy()
                d.start()
                d.wait_ready()
            kill_when_busy()  # one more, with the queue still busy with redeliveries
            d.start()
            wait_drained(sqs_client, queue_url, [d], timeout=240)
            send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:10]))
            wait_drained(sqs_client, queue_url, [d])
            assert d.stop() == 0, d.logs()
        finally:
            if not d.exited():
                d.kill9()
    assert len(held_at_kill) == 6
    assert sum(1 for n in held_at_kill if n > 0) >= 5, f"messages held at each kill: {held_at_kill}"
    counts = await check_invariants(database_url, w, sqs_client, queue_url)
    assert counts["completed"] == 1000


@pytest.mark.parametrize("mode", ["refuse", "lie", "partial"])
async def test_ack_fault_exits_3_and_restart_heals(
    mode: str, sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str,
    tmp_path: Path,
) -> None:
    queue_url = make_queue(visibility=3)
    w = Workload(seed=chaos_seed(zlib.crc32(mode.encode()) % 1000))
    send_all(sqs_client, queue_url, w.bodies(60, prefix=mode))
    with FaultProxy(sqs_endpoint) as proxy:
        proxy.mode = mode
        env = daemon_env(database_url, queue_url, proxy.url, INGEST_WORKER_NAME="r0")
        d = Daemon(env, tmp_path).start()
        try:
            assert d.wait(60) == 3, d.logs()
            # The exit names messages whose delete really was answered with a fault.
            logged = {i for e in log_events(d, "fatal") if e["reason"] == "ack_failed"
                      for i in e["message_ids"]}
            assert logged, d.logs()
            assert logged <= proxy.failed_message_ids(), (logged, proxy.failed_message_ids())
            proxy.mode = None  # restarted without the fault
            d.start()
            wait_drained(sqs_client, queue_url, [d])
            send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:3]))
            wait_drained(sqs_client, queue_url, [d])
            assert d.stop() == 0, d.logs()
        finally:
            if not d.exited():
                d.kill9()
    await check_invariants(database_url, w, sqs_client, queue_url)


async def test_three_replicas_one_killed_repeatedly(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, tmp_path: Path
) -> None:
    """The victim is killed four times, each time ready and holding messages, while the two
    others go on: its claims are collected, nobody else's, and every effect lands once."""
    queue_url = make_queue()
    w = Workload(seed=chaos_seed(3))
    with FaultProxy(sqs_endpoint, latency_ms=40) as proxy:
        replicas = [Daemon(daemon_env(database_url, queue_url, proxy.url, INGEST_POLLERS="2"),
                           tmp_path, f"r{i}") for i in range(3)]
        victim = replicas[0]
        try:
            for r in replicas:
                r.start()
            for r in replicas:
                r.wait_ready()
            for i in range(4):
                send_all(sqs_client, queue_url, w.bodies(150, prefix=f"t{i}"))
                wait_until(lambda: victim.metric("sqs_ingest_in_flight_messages") > 0, 60,
                           f"the victim holding messages (round {i})", interval=0.01)
                victim.kill9()
                victim.start()
                victim.wait_ready()
            wait_drained(sqs_client, queue_url, replicas, timeout=240)
            send_all(sqs_client, queue_url, w.reuse(sorted(w.valid)[:5]))
            wait_drained(sqs_client, queue_url, replicas)
            codes = [r.stop() for r in replicas]
        finally:
            for r in replicas:
                if not r.exited():
                    r.kill9()
    assert codes == [0, 0, 0], [r.logs() for r in replicas]
    await check_invariants(database_url, w, sqs_client, queue_url)


async def test_database_outage_mid_stream(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, tmp_path: Path
) -> None:
    from service.adapters.migrate import migrate

    queue_url = make_queue()
    with postgres_server() as pg, FaultProxy(sqs_endpoint, latency_ms=40) as proxy:
        dsn = pg.dsn()
        await migrate(dsn)
        await create_ledger(dsn)
        w = Workload(seed=chaos_seed(4))
        # Two pollers behind a 40 ms SQS: 300 messages take seconds, the outage lands inside.
        d = Daemon(daemon_env(dsn, queue_url, proxy.url, INGEST_POLLERS="2"), tmp_path).start()
        try:
            d.wait_ready()
            bodies = w.bodies(300, prefix="o")
            send_all(sqs_client, queue_url, bodies)
            wait_until(lambda: completed(dsn) >= 50, 60, "progress before the outage")
            pg.stop("immediate")
            left = queue_depth(sqs_client, queue_url)
            assert left > 0, "the queue was drained before the outage: not mid-stream"
            wait_until(lambda: d.get("/readyz")[0] == 503, 30, "not ready during the outage")
            outage_started = time.monotonic()
            received_early = None
            while time.monotonic() - outage_started < 15:
                assert d.get("/readyz")[0] == 503
                assert not d.exited(), d.logs()  # no crash loop
                if received_early is None and time.monotonic() - outage_started > 5:
                    received_early = d.metric("sqs_ingest_messages_received_total")
                time.sleep(0.5)
            # Nothing is taken off the queue while it could not be persisted.
            assert d.metric("sqs_ingest_messages_received_total") == received_early
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
        print(f"outage came with {left} of {len(bodies)} messages still on the queue")


async def test_sigterm_releases_what_idle_polls_bring(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, tmp_path: Path
) -> None:
    """SIGTERM with idle 20 s long polls in flight, then messages sent at once: the stopping
    daemon hands them back (visibility 0) without applying them, so a second daemon gets
    them without waiting out the 120 s visibility timeout, and each lands once."""
    queue_url = make_queue(visibility=120)
    w = Workload(seed=chaos_seed(9))
    bodies = w.bodies(20, prefix="idle")
    with FaultProxy(sqs_endpoint) as proxy:
        env = daemon_env(database_url, queue_url, proxy.url, INGEST_WAIT_TIME_SECONDS="20",
                         INGEST_POLLERS="4", INGEST_SHUTDOWN_TIMEOUT="30")
        a = Daemon(env, tmp_path, "a").start()
        try:
            a.wait_ready()
            wait_until(lambda: proxy.in_flight["ReceiveMessage"] >= 4, 30,
                       "all four pollers inside a long poll")
            a.signal(signal.SIGTERM)
            sent_at = time.monotonic()
            send_all(sqs_client, queue_url, bodies)
            assert a.wait(40) == 0, a.logs()
        finally:
            if not a.exited():
                a.kill9()
    released = sum(e["count"] for e in log_events(a, "released_after_stop"))
    assert released > 0, a.logs()  # the polls did bring messages, and they were handed back
    assert await completed_rows(database_url) == 0  # …without being applied by a
    b = Daemon(env | {"INGEST_SQS_ENDPOINT_URL": sqs_endpoint}, tmp_path, "b").start()
    try:
        wait_drained(sqs_client, queue_url, [b], timeout=90)
        # Had the stopping daemon kept them, they would be hidden for 120 s after sending.
        assert time.monotonic() - sent_at < 110
        code = b.stop()
    finally:
        if not b.exited():
            b.kill9()
    assert code == 0, b.logs()
    counts = await check_invariants(database_url, w, sqs_client, queue_url)
    assert counts["completed"] == len(w.valid)


async def test_fifo_kill_9_keeps_group_order_and_applies_once(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, tmp_path: Path
) -> None:
    """A FIFO queue of ledger appends in 6 groups, some sent twice, the daemon killed -9
    mid-stream four times: every effect lands once and, within each group, in send order.
    History: a strict xfail until issue 25 (the daemon leaned on the broker's group lock);
    then an investigation (passed alone, failed in 2 of 3 full-suite runs, output not kept)
    until the tests' moto locked each queue's receive, delete and visibility change
    (tests/moto_fifo.py: plain moto_server hands a group's later message out while an
    earlier one is in flight, and can resurrect a deleted one — scripts/probes/). With the
    lock: 4 of 4 runs alone beside other work, then in make test."""
    seed = chaos_seed(17)
    queue_url = make_queue(visibility=5, fifo=True)
    w = Workload(seed=seed)
    items = fifo_ledger(w, groups=6, per_group=40)
    rng = random.Random(f"{seed}-fifo")
    # A later second delivery of some messages (new deduplication id): must be a duplicate.
    items += [items[i] for i in sorted(rng.sample(range(len(items)), 30))]
    held_at_kill: list[int] = []
    with FaultProxy(sqs_endpoint, latency_ms=20) as proxy:
        d = Daemon(daemon_env(database_url, queue_url, proxy.url, INGEST_WORKER_NAME="fifo-0"),
                   tmp_path).start()
        try:
            d.wait_ready()
            quarter = len(items) // 4
            for k in range(4):
                send_fifo(sqs_client, queue_url, items[k * quarter:(k + 1) * quarter]
                          if k < 3 else items[k * quarter:])
                wait_until(lambda: d.metric("sqs_ingest_in_flight_messages") > 0, 30,
                           "messages in flight")
                d.kill9()
                held_at_kill.append(in_flight(sqs_client, queue_url))
                d.start()
                d.wait_ready()
            wait_drained(sqs_client, queue_url, [d], timeout=240)
            code = d.stop()
        finally:
            if not d.exited():
                d.kill9()
    assert code == 0, d.logs()
    assert sum(1 for n in held_at_kill if n > 0) >= 3, f"messages held at each kill: {held_at_kill}"
    await check_invariants(database_url, w, sqs_client, queue_url)
    await check_group_order(database_url, groups=6, per_group=40)

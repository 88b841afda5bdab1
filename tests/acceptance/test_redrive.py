"""Native redrive (#11): the real ``sqs-ingest`` process against LocalStack's SQS, which
moves a message to the queue's dead-letter queue on the receive after ``maxReceiveCount``
(as AWS does; tests/integration/test_localstack.py checks that once).

- An always-failing message lands in ``dead_letters`` on its last receive, although
  INGEST_MAX_RECEIVE_COUNT (5) is above the queue's maxReceiveCount (3).
- Two replicas, a message held in its handler and delivered twice (its duplicate contended
  for several visibility periods) and a database outage of several visibility timeouts
  under another one: nothing reaches the SQS dead-letter queue, every request completes
  exactly once.
- ``sqs-ingest redrive`` moves planted DLQ messages back, they complete; it refuses a
  queue without a RedrivePolicy.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import boto3
import pytest

from tests.acceptance.harness import (
    CHAOS_HANDLERS,
    REPO,
    Daemon,
    completed_now,
    create_ledger,
    daemon_env,
    ledger,
    ledger_rows,
    log_events,
    send_all,
)
from tests.servers import postgres_server, wait_until

pytestmark = pytest.mark.timeout(240)

MAX_RECEIVE_COUNT = 3
VISIBILITY = 2  # seconds: redeliveries come quickly, the heartbeat extends every second


@pytest.fixture
def sqs(localstack: str) -> Any:
    return boto3.client("sqs", endpoint_url=localstack, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")



def queue_with_dlq(sqs: Any, redrive: bool = True) -> tuple[str, str]:
    """(source url, dead-letter queue url): a standard queue whose RedrivePolicy moves a
    message after MAX_RECEIVE_COUNT receives (or none, ``redrive=False``)."""
    tag = uuid.uuid4().hex[:10]
    dlq = sqs.create_queue(QueueName=f"dlq-{tag}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"]
    attrs = {"VisibilityTimeout": str(VISIBILITY)}
    if redrive:
        attrs["RedrivePolicy"] = json.dumps(
            {"deadLetterTargetArn": arn, "maxReceiveCount": MAX_RECEIVE_COUNT})
    src = sqs.create_queue(QueueName=f"src-{tag}", Attributes=attrs)["QueueUrl"]
    return str(src), str(dlq)


def depth(sqs: Any, url: str) -> int:
    a = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
    return (int(a["ApproximateNumberOfMessages"]) + int(a["ApproximateNumberOfMessagesNotVisible"])
            + int(a.get("ApproximateNumberOfMessagesDelayed", "0")))


def env_for(dsn: str, src: str, endpoint: str, chaos_dir: Path, **extra: str) -> dict[str, str]:
    """The harness's daemon settings (1 s backoff base, 1 s contention delay, 4 s lease) on
    the default INGEST_MAX_RECEIVE_COUNT (5), with a 2 s visibility timeout."""
    return daemon_env(dsn, src, endpoint, CHAOS_DIR=str(chaos_dir),
                      INGEST_VISIBILITY_TIMEOUT=str(VISIBILITY), INGEST_CONTENTION_DELAY="1",
                      INGEST_HANDLERS=f"{CHAOS_HANDLERS},tests.acceptance.redrive_handlers",
                      **extra)


async def chaos_tables(dsn: str, with_ledger: bool = False) -> None:
    """chaos_effects (chaos.slow, chaos.flaky); the ledger too on a database not made by
    the acceptance ``database_url`` fixture (which creates it)."""
    if with_ledger:
        await create_ledger(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, request_id text)")
    finally:
        await conn.close()


async def fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


def body(rid: str, type_: str, **payload: Any) -> str:
    return json.dumps({"request_id": rid, "type": type_, "payload": payload})


async def test_always_failing_message_ends_in_dead_letters_not_in_the_sqs_dlq(
    sqs: Any, localstack: str, database_url: str, spawn: Callable[..., Daemon], tmp_path: Path
) -> None:
    await chaos_tables(database_url)
    src, dlq = queue_with_dlq(sqs)
    failing = body("always-fails", "chaos.flaky", fail_times=1000)
    sqs.send_message(QueueUrl=src, MessageBody=failing)
    d = spawn(env_for(database_url, src, localstack, tmp_path))

    def outcome() -> bool:
        assert not d.exited(), d.logs()
        return bool(dead_letter_count(database_url)) or depth(sqs, dlq) > 0

    wait_until(outcome, 60, "a dead letter, here or in the SQS DLQ", interval=0.3)
    assert depth(sqs, dlq) == 0, "SQS moved it to its DLQ before the daemon dead-lettered it"
    [row] = await fetch(database_url, "SELECT body, reason, receive_count FROM dead_letters")
    assert (row["body"], row["reason"]) == (failing, "max_receives_exceeded")
    assert row["receive_count"] == MAX_RECEIVE_COUNT  # on its last receive, not before
    wait_until(lambda: depth(sqs, src) == 0, 30, "acked")
    lowered = [e for e in d.full_logs().splitlines()
               if "receive_limit_lowered_by_redrive_policy" in e]
    assert len(lowered) == 1, lowered  # said once, not with every GetQueueAttributes
    assert d.stop() == 0, d.logs()


def dead_letter_count(dsn: str) -> int:
    import asyncio
    import concurrent.futures

    async def count() -> int:
        return len(await fetch(dsn, "SELECT 1 FROM dead_letters"))

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, count()).result(30)


def recent_events(d: Daemon, n: int = 25) -> str:
    """The last ``n`` JSON log events of ``d`` (asyncpg's reconnect tracebacks left out)."""
    lines = [ln for ln in d.full_logs().splitlines() if ln.startswith("{")]
    return f"--- {d.name}:\n" + "\n".join(ln[:300] for ln in lines[-n:])


async def test_contention_and_an_outage_push_nothing_into_the_sqs_dlq(
    sqs: Any, localstack: str, spawn: Callable[..., Daemon], tmp_path: Path
) -> None:
    from service.adapters.migrate import migrate

    src, dlq = queue_with_dlq(sqs)
    with postgres_server() as pg:
        dsn = pg.dsn()
        await migrate(dsn)
        await chaos_tables(dsn, with_ledger=True)
        env = env_for(dsn, src, localstack, tmp_path, INGEST_POLLERS="2")
        a = spawn({**env, "INGEST_WORKER_NAME": "replica-a"}, "a")
        b = spawn({**env, "INGEST_WORKER_NAME": "replica-b"}, "b")
        replicas = [a, b]
        for r in replicas:
            r.wait_ready()

        def metric(name: str) -> float:
            return sum(r.metric(name) for r in replicas)

        def until(pred: Callable[[], object], timeout: float, what: str) -> None:
            def checked() -> object:
                for r in replicas:
                    assert not r.exited(), r.logs()
                assert depth(sqs, dlq) == 0, "a healthy message reached the SQS DLQ\n" + \
                    "\n".join(recent_events(r) for r in replicas)
                return pred()
            try:
                wait_until(checked, timeout, what, interval=0.3)
            except TimeoutError as exc:
                raise AssertionError(f"{exc}\n" + "\n".join(
                    recent_events(r) for r in replicas)) from None

        def running(gate: str) -> bool:
            return (tmp_path / f"running-{gate}").exists()

        def open_gate(gate: str) -> None:
            (tmp_path / f"open-{gate}").touch()

        # 1. Contention: a request delivered twice, the copy sent once the first one runs
        #    (in one batch the twin would simply wait in flight with it). Its handler holds
        #    until the copy was contended twice as often as maxReceiveCount allows receives.
        slow = body("slow-1", "redrive.gated", gate="g1")
        send_all(sqs, src, [slow])
        until(lambda: running("g1"), 30, "slow-1 running")
        send_all(sqs, src, [slow])
        until(lambda: metric("sqs_ingest_contention_deferrals_total") >= 2 * MAX_RECEIVE_COUNT,
              60, "the duplicate contended six times")
        open_gate("g1")
        until(lambda: depth(sqs, src) == 0, 60, "slow-1 done, its duplicate acked")
        requeued_by_contention = metric("sqs_ingest_requeued_total")

        # 2. An outage of several visibility timeouts under a request in its handler (and its
        #    contended copy), with more work queued: the batch is handed back, and afterwards
        #    the claims not released while the database was down keep their copies contended
        #    until the own-leak GC frees them.
        ledgers = {f"l-{i}": ledger(f"l-{i}", f"g{i % 3}", i) for i in range(30)}
        slow2 = body("slow-2", "redrive.gated", gate="g2")
        send_all(sqs, src, [slow2])
        until(lambda: running("g2"), 30, "slow-2 running")
        send_all(sqs, src, [slow2, *ledgers.values(), *list(ledgers.values())[:10]])
        pg.stop("immediate")
        until(lambda: all(r.get("/readyz")[0] == 503 for r in replicas), 30, "both not ready")
        open_gate("g2")  # its transaction now meets the lost connection: an outage
        down_since = time.monotonic()
        until(lambda: time.monotonic() - down_since > 3 * VISIBILITY, 30, "the outage")
        pg.start()
        until(lambda: all(r.ready() for r in replicas), 60, "ready again")
        until(lambda: depth(sqs, src) == 0, 90, "the source queue drained")
        requeued = metric("sqs_ingest_requeued_total")
        # slow-2's claim, stranded by the outage, was released as soon as it ended (not
        # after the own-leak GC's 30 s margin, its copies contended all that time).
        assert any(log_events(r, "claims_released_after_outage") for r in replicas)
        assert [r.stop() for r in replicas] == [0, 0], [r.logs() for r in replicas]
        assert depth(sqs, dlq) == 0
        statuses = await fetch(dsn, "SELECT request_id, status FROM modifications")
        assert {r["request_id"]: r["status"] for r in statuses} == dict.fromkeys(
            ["slow-1", "slow-2", *ledgers], "COMPLETED")
        effects = Counter(r["request_id"] for r in await fetch(
            dsn, "SELECT request_id FROM chaos_effects"))
        assert effects == {"slow-1": 1, "slow-2": 1}
        assert Counter(r["request_id"] for r in await ledger_rows(dsn)) == dict.fromkeys(
            ledgers, 1)
        assert await fetch(dsn, "SELECT 1 FROM dead_letters") == []
    print(f"fresh copies sent for deferrals: {requeued_by_contention:.0f} under contention, "
          f"{requeued - requeued_by_contention:.0f} around the outage")
    assert requeued_by_contention >= 2 * MAX_RECEIVE_COUNT


def redrive_cli(src: str, endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"INGEST_QUEUE_URL": src, "INGEST_SQS_ENDPOINT_URL": endpoint,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "service", "redrive", *args], env=env,
                          capture_output=True, text=True, timeout=60, cwd=REPO)


async def test_redrive_moves_planted_dlq_messages_back_and_they_complete(
    sqs: Any, localstack: str, database_url: str, spawn: Callable[..., Daemon], tmp_path: Path
) -> None:
    await chaos_tables(database_url)
    src, dlq = queue_with_dlq(sqs)
    planted = {f"p-{i}": ledger(f"p-{i}", "g", i) for i in range(12)}
    send_all(sqs, dlq, list(planted.values()))

    dry = redrive_cli(src, localstack, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dlq.rsplit("/", 1)[1] in dry.stdout and "12 visible" in dry.stdout
    assert "would move 12" in dry.stdout
    assert depth(sqs, dlq) == 12 and depth(sqs, src) == 0  # nothing moved

    moved = redrive_cli(src, localstack)
    assert moved.returncode == 0, moved.stdout + moved.stderr
    assert moved.stdout.splitlines()[-1] == "moved 12/12 (COMPLETED)", moved.stdout
    assert depth(sqs, dlq) == 0

    d = spawn(env_for(database_url, src, localstack, tmp_path))
    wait_until(lambda: completed_now(database_url) == len(planted), 60, "redriven completed")
    assert Counter(r["request_id"] for r in await ledger_rows(database_url)) == dict.fromkeys(
        planted, 1)
    assert d.stop() == 0, d.logs()


def test_redrive_refuses_a_queue_without_a_dead_letter_queue(sqs: Any, localstack: str) -> None:
    src, _ = queue_with_dlq(sqs, redrive=False)
    res = redrive_cli(src, localstack)
    assert res.returncode == 2
    assert res.stdout == ""
    assert res.stderr.count("\n") == 1 and "no RedrivePolicy" in res.stderr, res.stderr

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import boto3
import pytest

from service.testing.kit import create_template
from tests.servers import Postgres, localstack_server, moto_server, postgres_server
from tests.watchdog import bounded

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

TEMPLATE_DB = "ingest_template"

#: Tests a strict run (INGEST_TESTS_STRICT=1, set by ``make test``) may skip: node id → why.
#: Any other skip fails the run, so a test CI is meant to run cannot silently not run.
ALLOWED_SKIPS: dict[str, str] = {}


@functools.cache
def _mutmut_durations() -> dict[str, float]:
    """mutmut's recorded duration per test (its stats run, ``mutants/mutmut-stats.json``)."""
    try:
        with open("mutmut-stats.json", encoding="utf-8") as f:
            return dict(json.load(f)["duration_by_test"])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _checking_a_mutant() -> bool:
    return "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", "")


#: Under mutmut, a test whose setup, call and teardown together take longer than this (wall
#: seconds) ends the mutant's run as a timeout. The selection's slowest test takes ~8 s.
MUTANT_TEST_WALL_LIMIT = float(os.environ.get("INGEST_MUTANT_TEST_WALL_LIMIT", "120"))
MUTMUT_TIMEOUT_EXIT = 36  # mutmut reads this exit code as "timeout" (mutmut/stats.py)


def _hung(config: pytest.Config, nodeid: str) -> None:
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # the test's output capture would swallow the reason
        capture.suspend_global_capture()
    print(f"\nmutmut: {nodeid} still running after {MUTANT_TEST_WALL_LIMIT:.0f} s (setup, call "
          "and teardown): this mutant's run ends as a timeout", file=sys.stderr, flush=True)
    os._exit(MUTMUT_TIMEOUT_EXIT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """While mutmut checks a mutant, a hung test ends the run as a timeout.

    A mutant that failed a test and left a session idle in a transaction hung in teardown
    (a pool closing) until mutmut's CPU-time limit — about 85 minutes of wall time at a few
    per cent of CPU (tests/watchdog.py says why pytest-timeout does not end it). Outside a
    mutant's run: nothing."""
    if not _checking_a_mutant():
        yield
        return
    with bounded(MUTANT_TEST_WALL_LIMIT, functools.partial(_hung, item.config, item.nodeid)):
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under mutmut, while a mutant is checked, the fastest of its tests run first.

    mutmut hands a mutant's tests over as an unordered set and stops at the first failure
    (``-x``), so a mutant a 20 ms unit test kills could first pay for every integration test
    listed before it. Sorting by mutmut's own recorded durations changes no verdict, only
    how soon a killed mutant is known (what it bought was not A/B-measured:
    docs/mutation.md). Outside mutmut, and in its stats and forced-fail runs, the order is
    untouched."""
    if not _checking_a_mutant():
        return
    durations = _mutmut_durations()
    if durations:
        items.sort(key=lambda item: durations.get(item.nodeid, float("inf")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail")
            and os.environ.get("INGEST_TESTS_STRICT") == "1"
            and item.nodeid not in ALLOWED_SKIPS):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"unexpected skip with INGEST_TESTS_STRICT=1: {reason}"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Postgres]:
    port = os.environ.get("INGEST_TEST_PG_PORT")
    if port:  # a server another session started, with its template (tests/sql_mutants.py)
        yield Postgres(int(port), "", "", os.environ.get("INGEST_TEST_PG_USER", "postgres"))
        return
    with postgres_server() as pg:
        asyncio.run(create_template(pg, TEMPLATE_DB))
        yield pg


@contextlib.asynccontextmanager
async def fresh_database(pg: Postgres) -> AsyncIterator[str]:
    """A migrated database copied from the template, dropped afterwards."""
    name = "t_" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(pg.dsn())
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    finally:
        await conn.close()
    try:
        yield pg.dsn(name)
    finally:
        conn = await asyncpg.connect(pg.dsn())
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await conn.close()


@pytest.fixture
async def database_url(pg_server: Postgres) -> AsyncIterator[str]:
    """A fresh, migrated database per test, copied from the template."""
    async with fresh_database(pg_server) as dsn:
        yield dsn


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    yield conn
    await conn.close()


@pytest.fixture(scope="session")
def sqs_endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture(scope="session")
def localstack() -> Iterator[str]:
    """LocalStack in host mode (SQS, SNS, S3) for the session: its endpoint URL.

    For what moto does not do realistically: redrive to a queue's DLQ after
    maxReceiveCount, message-move tasks, S3 objects behind extended-client pointers,
    SNS delivery to SQS. Each test creates its own queues/topics/buckets."""
    with localstack_server("sqs,sns,s3") as ls:
        yield ls.url


@pytest.fixture(scope="session")
def sqs_client(sqs_endpoint: str):
    return boto3.client("sqs", endpoint_url=sqs_endpoint, region_name="us-east-1")


@pytest.fixture
def queue_url(sqs_client) -> str:
    """A fresh standard queue per test (PurgeQueue is rate-limited)."""
    name = "q-" + uuid.uuid4().hex[:12]
    return str(sqs_client.create_queue(QueueName=name, Attributes={"VisibilityTimeout": "30"})["QueueUrl"])


@pytest.fixture
def fifo_queue_url(sqs_client) -> str:
    name = "q-" + uuid.uuid4().hex[:12] + ".fifo"
    return str(
        sqs_client.create_queue(
            QueueName=name,
            Attributes={"FifoQueue": "true", "ContentBasedDeduplication": "true", "VisibilityTimeout": "30"},
        )["QueueUrl"]
    )

"""One SparkSession for the whole session, and a second database for peer comparisons."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import asyncpg
import pytest
import structlog

from tests.conftest import TEMPLATE_DB
from tests.servers import Postgres

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

JDBC_JAR = "/usr/share/java/postgresql.jar"


class _CurrentStderr:
    """Resolves ``sys.stderr`` at each write, so capsys/capfd swapping it cannot leave
    a logger writing to a closed capture file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(scope="session", autouse=True)
def _json_logs() -> Iterator[None]:
    """JSON logs as in production; ``cli.main`` keeps an existing configuration."""
    saved = structlog.get_config()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=lambda *args: structlog.PrintLogger(file=_CurrentStderr()),  # type: ignore[arg-type]
    )
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("sqs-ingest-reconcile-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.jars", JDBC_JAR)
        .config("spark.sql.session.timeZone", "UTC")
        # Tiny test frames: a handful of shuffle partitions instead of 200 keeps it fast.
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


async def _create_db(pg: Postgres) -> str:
    name = "t_" + uuid.uuid4().hex[:12]
    conn = await asyncpg.connect(pg.dsn())
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE_DB}")
    finally:
        await conn.close()
    return name


@pytest.fixture
async def peer_url(pg_server: Postgres) -> AsyncIterator[str]:
    """A second fresh migrated database (the ``database_url`` fixture is the primary)."""
    name = await _create_db(pg_server)
    yield pg_server.dsn(name)
    conn = await asyncpg.connect(pg_server.dsn())
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()

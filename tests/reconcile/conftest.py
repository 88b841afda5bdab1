"""One SparkSession for the whole session, and a second database for peer comparisons."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import structlog

from tests.conftest import fresh_database
from tests.servers import Postgres
from tests.skips import unavailable

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
        # why the ignore below: _CurrentStderr writes like a text file
        logger_factory=lambda *args: structlog.PrintLogger(file=_CurrentStderr()),  # type: ignore[arg-type]
    )
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        unavailable("pyspark", "pip install -e '.[reconcile]'")

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


@pytest.fixture
async def peer_url(pg_server: Postgres) -> AsyncIterator[str]:
    """A second fresh migrated database (the ``database_url`` fixture is the primary)."""
    async with fresh_database(pg_server) as dsn:
        yield dsn

"""First contact: each start-up mistake a new user makes ends in one line naming the fix,
with the exit code the README's troubleshooting table documents.

The real ``sqs-ingest run`` process against the session's PostgreSQL and moto server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from tests.acceptance.harness import Daemon
from tests.servers import Postgres, free_port, moto_server, wait_until

ROOT = Path(__file__).resolve().parents[2]


def run_daemon(env: dict[str, str], timeout: float = 60) -> tuple[int, list[str]]:
    """Exit code and the output lines of ``sqs-ingest run`` that are not JSON log entries
    (what a person reads: no traceback, only the one line)."""
    proc = subprocess.run([sys.executable, "-m", "service", "run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    out = (proc.stdout + proc.stderr).splitlines()
    return proc.returncode, [line for line in out if line.strip() and not line.startswith("{")]


@pytest.fixture
def base_env(database_url: str, queue_url: str, sqs_endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    return {**env, "INGEST_DATABASE_URL": database_url, "INGEST_QUEUE_URL": queue_url,
            "INGEST_SQS_ENDPOINT_URL": sqs_endpoint, "INGEST_HTTP_PORT": str(free_port()),
            "INGEST_HTTP_HOST": "127.0.0.1", "INGEST_LOG_FORMAT": "json",
            # Never ask an instance-metadata address for credentials from a test.
            "AWS_EC2_METADATA_DISABLED": "true"}


def assert_one_line(lines: list[str], *needles: str) -> None:
    assert len(lines) == 1, lines
    assert lines[0].startswith("sqs-ingest: "), lines
    for needle in needles:
        assert needle in lines[0], lines


def test_queue_does_not_exist(base_env: dict[str, str]) -> None:
    missing = base_env["INGEST_QUEUE_URL"].rsplit("/", 1)[0] + "/no-such-queue"
    code, lines = run_daemon({**base_env, "INGEST_QUEUE_URL": missing})
    assert code == 2
    assert_one_line(lines, "INGEST_QUEUE_URL", "does not exist", missing)


@pytest.fixture(scope="module")
def authenticating_sqs() -> Iterator[str]:
    """A moto server that checks signatures against its own IAM users (none exist), as
    AWS does: any access key is unknown to it."""
    saved = os.environ.get("INITIAL_NO_AUTH_ACTION_COUNT")
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    try:
        with moto_server() as url:
            yield url
    finally:
        if saved is None:
            os.environ.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
        else:
            os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = saved


def test_bad_aws_credentials(base_env: dict[str, str], authenticating_sqs: str) -> None:
    queue = f"{authenticating_sqs}/123456789012/q"
    code, lines = run_daemon({**base_env, "INGEST_SQS_ENDPOINT_URL": authenticating_sqs,
                              "INGEST_QUEUE_URL": queue,
                              "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEUNKNOWN00",
                              "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert code == 2
    assert_one_line(lines, "AWS credentials rejected", "AWS_ACCESS_KEY_ID")


def test_no_aws_credentials(base_env: dict[str, str], tmp_path: Path) -> None:
    env = {k: v for k, v in base_env.items() if not k.startswith("AWS_") or k ==
           "AWS_EC2_METADATA_DISABLED"}
    # No profile files either: an empty home and config paths that do not exist.
    env.update(HOME=str(tmp_path), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
    code, lines = run_daemon(env)
    assert code == 2
    assert_one_line(lines, "no AWS credentials found", "AWS_ACCESS_KEY_ID")


def test_wrong_database_password(base_env: dict[str, str], pg_server: Postgres,
                                 password_role: str) -> None:
    dsn = f"postgresql://{password_role}:wrong@127.0.0.1:{pg_server.port}/postgres"
    code, lines = run_daemon({**base_env, "INGEST_DATABASE_URL": dsn})
    assert code == 2
    assert_one_line(lines, "INGEST_DATABASE_URL", "password authentication failed")
    assert ":wrong@" not in lines[0], "the password must never be printed"


def test_database_does_not_exist(base_env: dict[str, str], pg_server: Postgres) -> None:
    code, lines = run_daemon({**base_env, "INGEST_DATABASE_URL": pg_server.dsn("no_such_db")})
    assert code == 2
    assert_one_line(lines, "INGEST_DATABASE_URL", '"no_such_db" does not exist',
                    "sqs-ingest migrate")


async def test_schema_behind(base_env: dict[str, str], pg_server: Postgres) -> None:
    name = "empty_" + uuid.uuid4().hex[:8]
    conn = await asyncpg.connect(pg_server.dsn())
    await conn.execute(f"CREATE DATABASE {name}")
    try:
        proc = subprocess.run([sys.executable, "-m", "service", "run"], cwd=ROOT, text=True,
                              env={**base_env, "INGEST_DATABASE_URL": pg_server.dsn(name)},
                              capture_output=True, timeout=60)
        assert proc.returncode == 1
        assert "sqs-ingest: database schema is behind" in proc.stdout + proc.stderr
        assert "run `sqs-ingest migrate`" in proc.stdout + proc.stderr
    finally:
        await conn.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await conn.close()


def test_handler_module_fails_to_import(base_env: dict[str, str]) -> None:
    code, lines = run_daemon({**base_env, "INGEST_HANDLERS": "no_such_handlers_module"})
    assert code == 2
    assert_one_line(lines, "INGEST_HANDLERS", "no_such_handlers_module", "PYTHONPATH")


def test_http_port_in_use(base_env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = run_daemon({**base_env, "INGEST_HTTP_PORT": str(port)})
    assert code == 2
    assert_one_line(lines, "INGEST_HTTP_PORT", str(port), "already in use")


def test_unreachable_sqs_endpoint_retries_with_a_hint(base_env: dict[str, str],
                                                     tmp_path: Path) -> None:
    """Not permanent (an emulator still starting, a network blip at deploy time): not
    ready, a warning naming the fix on every retry, exit 0 on SIGTERM."""
    env = {k: v for k, v in base_env.items() if k != "INGEST_HTTP_PORT"}  # Daemon picks one
    d = Daemon({**env, "INGEST_SQS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
               tmp_path).start()
    try:
        wait_until(lambda: "sqs_unavailable" in d.full_logs() or d.exited(), 60, "a retry")
        warning = next(line for line in d.full_logs().splitlines() if "sqs_unavailable" in line)
        assert "INGEST_SQS_ENDPOINT_URL" in warning and "retrying" in warning, warning
        assert not d.exited(), "an unreachable endpoint must not stop the daemon"
        assert d.get("/readyz")[0] == 503
        d.signal(signal.SIGTERM)
        assert d.wait(30) == 0, d.logs()
    finally:
        if not d.exited():
            d.kill9()


def test_help_describes_the_program() -> None:
    out = subprocess.run([sys.executable, "-m", "service", "--help"], cwd=ROOT, text=True,
                         capture_output=True, timeout=60, check=True).stdout
    assert "exactly once" in out and "INGEST_QUEUE_URL" in out
    assert "Argument parsing only" not in out


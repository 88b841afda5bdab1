"""TLS to PostgreSQL by default: a TCP connection to a host beyond loopback needs a verified
certificate (sslmode verify-ca / verify-full) unless INGEST_DATABASE_TLS=disable-verification;
loopback and Unix sockets need none. Refused: exit 2, one line naming the variable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.reconcile.parser import Args, UsageError, build_parser
from service.settings import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[2]
QUEUE = "http://127.0.0.1:1/q"
CA = "sslrootcert=/etc/ssl/certs/rds-ca.pem"


@pytest.fixture(autouse=True)
def _policy_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INGEST_DATABASE_TLS", raising=False)  # tests/unit/conftest.py's


REFUSED = [
    "postgresql://app@db.example.invalid/x",
    "postgresql://app@db.example.invalid/x?sslmode=prefer",
    "postgresql://app@db.example.invalid:6432/x?sslmode=require",
    "postgresql://app@10.0.0.5/x?sslmode=disable",
    "postgresql://app@[2001:db8::5]:5432/x?sslmode=allow",
    "postgresql://app@127.0.0.1:5432,db2.example.invalid:5432/x?sslmode=require",
    "postgresql://app@/x?host=db.example.invalid",
    "host=db.example.invalid user=app dbname=x sslmode=require",
    "host=10.1.2.3 port=5432 user=app dbname=x",
]
ALLOWED = [
    f"postgresql://app@db.example.invalid/x?sslmode=verify-full&{CA}",
    "postgresql://app@db.example.invalid/x?sslmode=verify-ca",
    "postgresql://app@127.0.0.1:5432/x",
    "postgresql://app@127.3.2.1/x?sslmode=disable",
    "postgresql://app@[::1]:5432/x",
    "postgresql://app@localhost/x?sslmode=prefer",
    "postgresql://app@/x?host=/var/run/postgresql",
    "host=/tmp user=app dbname=x",
    f"host=db.example.invalid user=app dbname=x sslmode=verify-full {CA}",
]


@pytest.mark.parametrize("dsn", REFUSED)
def test_remote_host_without_certificate_check_is_refused(dsn: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(queue_url=QUEUE, database_url=dsn)
    line = str(info.value)
    assert "INGEST_DATABASE_URL" in line and "sslmode=verify-full" in line
    assert "INGEST_DATABASE_TLS=disable-verification" in line and "\n" not in line


@pytest.mark.parametrize("dsn", REFUSED)
def test_the_opt_out_accepts_them(dsn: str) -> None:
    s = load_settings(queue_url=QUEUE, database_url=dsn, database_tls="disable-verification")
    assert s.database_tls == "disable-verification"


@pytest.mark.parametrize("dsn", ALLOWED)
def test_verified_tls_loopback_and_unix_sockets_are_allowed(dsn: str) -> None:
    load_settings(queue_url=QUEUE, database_url=dsn)


def test_an_unknown_tls_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="INGEST_DATABASE_TLS"):
        load_settings(queue_url=QUEUE, database_url="postgresql://app@127.0.0.1/x",
                      database_tls="off")


def test_the_file_variable_is_named(tmp_path: Path) -> None:
    f = tmp_path / "url"
    f.write_text("postgresql://app@db.example.invalid/x?sslmode=require\n")
    with pytest.raises(ConfigError, match="INGEST_DATABASE_URL_FILE"):
        load_settings(queue_url=QUEUE, database_url_file=str(f))


def test_reconcile_databases_follow_the_same_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    primary = f"postgresql://app@primary.example.invalid/x?sslmode=verify-full&{CA}"
    ns = build_parser().parse_args(["--database-url", primary,
                                    "--peer-url", "postgresql://app@peer.example.invalid/x"])
    with pytest.raises(UsageError, match="peer1"):
        Args(ns).databases()
    monkeypatch.setenv("INGEST_DATABASE_TLS", "disable-verification")
    assert len(Args(ns).databases()[1]) == 1
    monkeypatch.delenv("INGEST_DATABASE_TLS")
    monkeypatch.setenv("INGEST_DATABASE_URL", "postgresql://app@primary.example.invalid/x")
    with pytest.raises(UsageError, match="INGEST_DATABASE_URL"):
        Args(build_parser().parse_args([])).databases()


def test_migrate_exits_2_with_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env["INGEST_DATABASE_URL"] = "postgresql://app@db.example.invalid/x?sslmode=require"
    proc = subprocess.run([sys.executable, "-m", "service", "migrate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "INGEST_DATABASE_URL" in proc.stderr


def test_the_reconcile_jdbc_connection_gets_the_same_tls_mode() -> None:
    from service.reconcile.io import jdbc_target

    url, props = jdbc_target(f"postgresql://app@db.example.invalid:5432/x?sslmode=verify-full&{CA}")
    assert url == "jdbc:postgresql://db.example.invalid:5432/x"
    assert props["sslmode"] == "verify-full"  # pgJDBC reads the libpq names
    assert props["sslrootcert"] == "/etc/ssl/certs/rds-ca.pem"

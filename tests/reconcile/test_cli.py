"""CLI plumbing without Spark: DSN conversion, scheduling, the one-run-per-night guard."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from datetime import UTC, date, datetime
from pathlib import Path

import asyncpg
import pytest

from service.reconcile import cli, io, parser, sidecar
from service.reconcile.metrics import RunMetrics
from service.reconcile.runner import Runner
from tests.servers import free_port, wait_until

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[2]


def test_jdbc_target_moves_credentials_to_properties() -> None:
    url, props = io.jdbc_target("postgresql://ingest:p%40ss@db.internal:6543/app?sslmode=require")
    assert url == "jdbc:postgresql://db.internal:6543/app"
    assert props == {"user": "ingest", "password": "p@ss", "sslmode": "require"}
    assert io.jdbc_target("postgres://u@h/d")[0] == "jdbc:postgresql://h:5432/d"
    db = io.Database("primary", "postgresql://ingest:hunter2@h/d")
    assert "hunter2" not in repr(db) and "hunter2" not in db.redacted
    with pytest.raises(io.DsnError):
        io.jdbc_target("mysql://u:hunter2@h/d")


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--date", "yesterday"]) == 2
    env_before = os.environ.pop("INGEST_DATABASE_URL", None)
    try:
        assert cli.main(["--date", "2024-05-01"]) == 2
    finally:
        if env_before is not None:
            os.environ["INGEST_DATABASE_URL"] = env_before
    assert "INGEST_DATABASE_URL" in capsys.readouterr().err
    assert cli.main(["--database-url", "mysql://u:hunter2@h/d"]) == 2
    assert "hunter2" not in capsys.readouterr().err


def test_schedule_and_night_date() -> None:
    fired = sidecar.next_fire("0 3 * * *", datetime(2024, 5, 2, 3, 0, tzinfo=UTC))
    assert fired == datetime(2024, 5, 3, 3, 0, tzinfo=UTC)
    assert sidecar.night_date(fired) == date(2024, 5, 2)
    assert parser.yesterday(datetime(2024, 1, 1, 0, 30, tzinfo=UTC)) == date(2023, 12, 31)


def _runs_total(metrics: RunMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "sqs_ingest_reconcile_runs_total", {"outcome": outcome}
    )
    return float(value or 0.0)


async def test_second_sidecar_skips_the_night(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lock held by another sidecar, or the date already done: skip without running Spark."""

    def no_spark(*args: object) -> None:
        raise AssertionError("the job must not run")

    monkeypatch.setattr(Runner, "_run_spark", no_spark)
    metrics = RunMetrics()
    runner = Runner(
        parser.Args(parser.build_parser().parse_args(["--database-url", database_url])), metrics
    )
    night = date(2024, 5, 1)

    other = await asyncpg.connect(database_url)
    try:
        assert await io.try_lock(other)
        assert await runner.run(night, skip_if_done=True) == 0
        assert _runs_total(metrics, "skipped") == 1
        # A one-off manual run in the meantime is refused rather than raced.
        assert await runner.run(night, skip_if_done=False) == 3
        await io.unlock(other)

        await other.execute(
            "INSERT INTO reconciliation_runs (run_date, window_start, window_end, status)"
            " VALUES ($1, now(), now(), 'clean')",
            night,
        )
        assert await runner.run(night, skip_if_done=True) == 0
        assert _runs_total(metrics, "skipped") == 3
    finally:
        await other.close()


def test_daemon_import_path_does_not_load_pyspark() -> None:
    code = (
        "import sys, service.reconcile, service.reconcile.cli, service.reconcile.io, "
        "service.reconcile.job, service.reconcile.transforms, service.reconcile.parser, "
        "service.reconcile.session, service.reconcile.runner, service.reconcile.metrics, "
        "service.reconcile.sidecar; "
        "assert 'pyspark' not in sys.modules, 'pyspark imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_sidecar_serves_metrics_and_stops_on_sigterm(database_url: str) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.reconcile.cli",
            "--schedule",
            "0 3 * * *",
            "--metrics-port",
            str(port),
            "--database-url",
            database_url,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:

        def scrape() -> bytes | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    return bytes(r.read())
            except OSError:
                return None

        body = wait_until(scrape, 30, "sidecar /metrics")
        assert b'sqs_ingest_reconcile_runs_total{outcome="clean"} 0.0' in body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _, err = proc.communicate()
    assert b'"event":"reconcile_next_run"' in err
    assert b"pyspark" not in err


def test_stuck_after_zero_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # 0 would make the cutoff "now": every claim in flight would be reported stuck.
    assert cli.main(["--stuck-after", "0", "--database-url", "postgresql://u@127.0.0.1:1/d"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--stuck-after" in err[0], err


def test_under_spark_submit_dsns_on_the_command_line_are_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """spark-submit's application arguments show in the Spark UI and the event log."""
    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")  # as under spark-submit
    for flag in ("--database-url", "--peer-url"):
        argv = ["--date", "2024-05-01", flag, "postgresql://u:hunter2@127.0.0.1:1/d"]
        if flag == "--peer-url":
            monkeypatch.setenv("INGEST_DATABASE_URL", "postgresql://u@127.0.0.1:1/d")
        assert cli.main(argv) == 2, flag
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0] and "hunter2" not in err[0], err

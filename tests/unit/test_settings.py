from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.settings import ConfigError, load_settings, redact_dsn

BASE = {"INGEST_QUEUE_URL": "http://127.0.0.1:1/q", "INGEST_DATABASE_URL": "postgresql://u@h/d",
        "INGEST_DATABASE_TLS": "disable-verification"}  # h is never reached


def run_cli(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    return subprocess.run(
        [sys.executable, "-m", "service", "run"], env={**clean, **env},
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"INGEST_DATABASE_URL": "postgresql://u@h/d"}, "INGEST_QUEUE_URL"),
        ({"INGEST_QUEUE_URL": "http://x/q"}, "INGEST_DATABASE_URL"),
        ({**BASE, "INGEST_DATABASE_URL": "mysql://x"}, "INGEST_DATABASE_URL"),
        ({**BASE, "INGEST_POLLERS": "many"}, "INGEST_POLLERS"),
        ({**BASE, "INGEST_HTTP_PORT": "70000"}, "INGEST_HTTP_PORT"),
        ({**BASE, "INGEST_LOG_FORMAT": "xml"}, "INGEST_LOG_FORMAT"),
        ({**BASE, "INGEST_VISIBILITY_TIMEOUT": "50000"}, "INGEST_VISIBILITY_TIMEOUT"),
        # Was taken, then silently replaced by 30 (logged as the queue's own value).
        ({**BASE, "INGEST_VISIBILITY_TIMEOUT": "1"}, "INGEST_VISIBILITY_TIMEOUT"),
        # Shorter than a heartbeat can be trusted to arrive: GC collects live claims.
        ({**BASE, "INGEST_WORKER_LEASE": "0.5"}, "INGEST_WORKER_LEASE"),
        # GC's cutoff now() - lease is no timestamp: every pass failed, no orphan released.
        ({**BASE, "INGEST_WORKER_LEASE": "inf"}, "INGEST_WORKER_LEASE"),
        # A sleep that does not wait: the GC loop spun at 96% of a core through an outage.
        ({**BASE, "INGEST_GC_INTERVAL": "1e-9"}, "INGEST_GC_INTERVAL"),
        # The outage hand-back's ceil(inf) raised where the batch was to be given back.
        ({**BASE, "INGEST_RETRY_BASE_SECONDS": "inf"}, "INGEST_RETRY_BASE_SECONDS"),
        # Pruned the rows of live workers: their next claims were collected by another GC.
        ({**BASE, "INGEST_WORKER_LEASE": "3600", "INGEST_WORKER_RETENTION_DAYS": "0.01"},
         "INGEST_WORKER_RETENTION_DAYS"),
        ({**BASE, "INGEST_MAX_RECEIVE_COUNT": "0"}, "INGEST_MAX_RECEIVE_COUNT"),
        ({**BASE, "INGEST_SQS_ENDPOINT_URL": "localhost:4566"}, "INGEST_SQS_ENDPOINT_URL"),
        ({**BASE, "INGEST_HANDLERS": "no_such_module_xyz"}, "INGEST_HANDLERS"),
        ({**BASE, "INGEST_MAX_JSON_VALUES": "10"}, "INGEST_MAX_JSON_VALUES"),
        ({**BASE, "INGEST_MAX_JSON_VALUES": "lots"}, "INGEST_MAX_JSON_VALUES"),
    ],
)
def test_bad_config_exits_2_with_one_line_naming_the_variable(
    env: dict[str, str], variable: str
) -> None:
    proc = run_cli(env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert variable in lines[0]


@pytest.mark.parametrize(("field", "ok", "refused"), [
    ("worker_lease", ["3", "30", "3153600000"], ["2.99", "0.15", "nan", "1e300", "-inf"]),
    ("visibility_timeout", ["0", "2", "43200"], ["1", "-1", "43201"]),
    ("gc_interval", ["0.001", "10", "1e300"], ["0.0009", "1e-9", "0"]),
    ("queue_attributes_interval", ["0.001", "15", "1e300"], ["0.0009", "1e-9", "0"]),
    ("prune_interval", ["0", "0.001", "3600", "1e300"], ["0.0009", "1e-9", "inf"]),
    ("retry_base_seconds", ["0", "2", "1e300"], ["inf", "-1"]),
    # At least the default lease, 30 s (0.000347 days).
    ("worker_retention_days", ["0.00035", "7", "36500"], ["1e-6", "0.0003", "36501"]),
])
def test_bounds_of_the_timing_settings(field: str, ok: list[str], refused: list[str]) -> None:
    """INGEST_WORKER_LEASE: at least 3 s (a heartbeat every second, dead after two late
    ones; shorter, another replica's GC collected a live worker's claims) and a cutoff
    PostgreSQL can compute. INGEST_VISIBILITY_TIMEOUT: 0 (the queue's own) or 2..43200.
    The timed loops (GC, GetQueueAttributes, prune — 0 = off): at least 1 ms, the shortest
    wait asyncio makes (at 1e-9 they spun). INGEST_RETRY_BASE_SECONDS: finite (the
    hand-back's jitter raised on inf; 1e300 is capped at 12 h). INGEST_WORKER_RETENTION_DAYS:
    at least the lease (shorter, the pruner deleted live workers)."""
    # A century of worker retention: a lease up to a century is then allowed.
    base = {"queue_url": BASE["INGEST_QUEUE_URL"], "database_url": BASE["INGEST_DATABASE_URL"],
            "worker_retention_days": "36500"}
    for value in ok:
        assert float(getattr(load_settings(**{**base, field: value}), field)) == float(value)
    for value in refused:
        with pytest.raises(ConfigError, match=f"INGEST_{field.upper()} "):
            load_settings(**{**base, field: value})


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in BASE.items():
        monkeypatch.setenv(k, v)
    s = load_settings()
    assert (s.aws_region, s.http_port, s.log_format, s.wait_time_seconds) == (
        "us-east-1", 9102, "json", 20)
    assert not s.is_fifo
    assert s.inflight_limit == s.pollers * 2


def test_console_format_case_insensitive(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in BASE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("INGEST_LOG_FORMAT", "CONSOLE")
    assert load_settings().log_format == "console"


def test_config_error_never_echoes_the_password(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INGEST_QUEUE_URL", "http://x/q")
    monkeypatch.setenv("INGEST_DATABASE_URL", "mysql://u:s3cret@h/d")
    with pytest.raises(ConfigError) as info:
        load_settings()
    assert "s3cret" not in str(info.value)


def test_redact_dsn() -> None:
    assert redact_dsn("postgresql://u:pw@h:5432/d") == "postgresql://u@h:5432/d"
    assert redact_dsn("postgresql://u@h/d") == "postgresql://u@h/d"


def test_an_unknown_variable_exits_2_naming_the_closest_setting() -> None:
    """A typo used to be ignored silently: INGEST_POLERS=8 ran with 8 pollers... of the
    default, whatever was meant."""
    proc = run_cli({**BASE, "INGEST_POLERS": "8"})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "INGEST_POLERS" in lines[0] and "INGEST_POLLERS" in lines[0]


def test_every_invalid_variable_is_reported_in_the_projects_words() -> None:
    proc = run_cli({**BASE, "INGEST_POLLERS": "0", "INGEST_HTTP_PORT": "-1",
                    "INGEST_MAX_RECIEVE_COUNT": "3"})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 3, proc.stderr
    assert {v for v in ("INGEST_POLLERS", "INGEST_HTTP_PORT", "INGEST_MAX_RECIEVE_COUNT")
            for line in lines if v in line} == {"INGEST_POLLERS", "INGEST_HTTP_PORT",
                                                 "INGEST_MAX_RECIEVE_COUNT"}
    assert "INGEST_MAX_RECEIVE_COUNT" in proc.stderr  # the closest name
    assert "Value error" not in proc.stderr and "Input should" not in proc.stderr


def test_both_required_variables_missing_are_two_lines() -> None:
    lines = [line for line in run_cli({}).stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and "INGEST_QUEUE_URL" in lines[0] + lines[1] \
        and "INGEST_DATABASE_URL" in lines[0] + lines[1], lines


def test_the_harness_and_reconcile_variables_are_known(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {**BASE, "INGEST_TEST_PG_PORT": "1", "INGEST_TESTS_STRICT": "1",
                 "INGEST_RECONCILE_PEER_URLS": "postgresql://u@h/p"}.items():
        monkeypatch.setenv(k, v)
    assert load_settings().pollers == 8


@pytest.mark.parametrize(("env", "region"), [
    ({}, "us-east-1"),
    ({"AWS_REGION": "eu-west-1"}, "eu-west-1"),
    ({"AWS_DEFAULT_REGION": "eu-central-1"}, "eu-central-1"),
    ({"AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "eu-central-1"}, "eu-west-1"),
    ({"AWS_REGION": "eu-west-1", "INGEST_AWS_REGION": "us-west-2"}, "us-west-2"),
    ({"INGEST_QUEUE_URL": "https://sqs.ap-south-1.amazonaws.com/123456789012/q"}, "ap-south-1"),
    ({"INGEST_QUEUE_URL": "https://sqs.ap-south-1.amazonaws.com/123456789012/q",
      "AWS_REGION": "eu-west-1"}, "eu-west-1"),
])
def test_the_region_comes_from_ingest_then_aws_then_the_queue_url(
    env: dict[str, str], region: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """INGEST_AWS_REGION used to default to us-east-1 and override the AWS_REGION that ECS
    and IRSA inject."""
    for k in ("AWS_REGION", "AWS_DEFAULT_REGION", "INGEST_AWS_REGION"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**BASE, **env}.items():
        monkeypatch.setenv(k, v)
    assert load_settings().aws_region == region


def test_version() -> None:
    from service import __version__

    proc = subprocess.run([sys.executable, "-m", "service", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == f"sqs-ingest {__version__}"

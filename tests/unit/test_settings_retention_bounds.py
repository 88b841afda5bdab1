"""Retention settings that pydantic parses as floats but PostgreSQL cannot use: ``inf`` (and
values so large that ``now() - make_interval(secs => …)`` leaves the timestamp range) made
every prune pass fail (``interval out of range`` / ``timestamp out of range``: exit 1 from
``sqs-ingest prune``, ``prune_failed`` every interval in the daemon, no table pruned).
Bad config: exit 2 at start, one line naming the variable, like every other setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BASE = {"INGEST_QUEUE_URL": "http://127.0.0.1:1/q", "INGEST_DATABASE_URL": "postgresql://u@h/d"}


@pytest.mark.parametrize(("command", "variable", "value"), [
    ("run", "INGEST_RETENTION_DAYS", "inf"),
    ("prune", "INGEST_RETENTION_DAYS", "3650000"),
    ("prune", "INGEST_DEAD_LETTER_RETENTION_DAYS", "inf"),
    ("run", "INGEST_RESULTS_RETENTION_DAYS", "1e9"),
    ("run", "INGEST_RECONCILE_RETENTION_DAYS", "infinity"),
    ("run", "INGEST_WORKER_RETENTION_DAYS", "1e300"),
    ("run", "INGEST_PRUNE_INTERVAL", "inf"),
    ("run", "INGEST_PRUNE_PAUSE", "inf"),
])
def test_retention_out_of_postgres_range_is_bad_config(
    command: str, variable: str, value: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "service", command], env={**clean, **BASE, variable: value},
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert variable in lines[0]

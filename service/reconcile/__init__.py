"""Nightly reconciliation of the ingest tables (PySpark).

``transforms`` holds the pure DataFrame → DataFrame checks, ``io`` the thin JDBC reads and
the asyncpg write of the results, ``job`` the wiring. Around it: ``parser`` (arguments →
job options), ``session`` (the Spark session), ``runner`` (one locked run: check, write,
report), ``metrics`` (the run's Prometheus metrics), ``sidecar`` (the nightly scheduler)
and ``cli`` (the entry point that picks one run or the sidecar). Nothing in this package
imports pyspark at import time: pyspark is an optional extra
(``pip install sqs-ingest[reconcile]``) and the daemon never loads it.
"""

from __future__ import annotations

from typing import Any

import structlog

#: Every kind of discrepancy the job can report, in reporting order.
KINDS = (
    "stuck_in_progress",
    "missing_in_peer",
    "missing_in_primary",
    "status_mismatch",
    "payload_mismatch",
    "entity_drift",
)


def log() -> Any:
    """A fresh logger: one cached at import would keep the stderr of the first configure."""
    return structlog.get_logger("service.reconcile")

"""Nightly reconciliation of the ingest tables (PySpark).

``transforms`` holds the pure DataFrame → DataFrame checks, ``io`` the thin JDBC reads and
the asyncpg write of the results, ``job`` the wiring, ``cli`` the command line and the
sidecar scheduler. Nothing in this package imports pyspark at import time: pyspark is an
optional extra (``pip install sqs-ingest[reconcile]``) and the daemon never loads it.
"""

from __future__ import annotations

#: Every kind of discrepancy the job can report, in reporting order.
KINDS = (
    "stuck_in_progress",
    "missing_in_peer",
    "missing_in_primary",
    "status_mismatch",
    "payload_mismatch",
    "entity_drift",
)

"""The example's fixtures come from sqs-ingest's pytest plugin (entry point pytest11); the
package only says which tables its handlers need and registers its handlers."""

from __future__ import annotations

from pathlib import Path

import invoices.handlers  # noqa: F401  (registers invoice.created, as INGEST_HANDLERS would)
import pytest


@pytest.fixture(scope="session")
def ingest_schema_sql() -> list[str]:
    return [(Path(__file__).parent / "invoices" / "schema.sql").read_text()]

"""The example's fixtures come from sqs-ingest's pytest plugin (entry point pytest11). Once the
package is installed (pip install -e .), the kit's template gets its migrations like
`sqs-ingest migrate` does; run from a checkout without installing it, they are read from the
package's migrations/ folder here."""

from __future__ import annotations

import importlib.metadata

import invoices.handlers  # noqa: F401  (registers invoice.created, as its entry point would)
import pytest

from service.testing.kit import handler_migrations


@pytest.fixture(scope="session")
def ingest_schema_sql() -> list[str]:
    installed = any(ep.value == "invoices" for ep in
                    importlib.metadata.entry_points(group="sqs_ingest.migrations"))
    return [] if installed else handler_migrations("invoices")

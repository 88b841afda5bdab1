"""Test support for handler authors and for this project's own tests; never imported by the
daemon (an import-linter contract: nothing outside service.testing imports it). The in-memory
twins of the two seams, typed against their protocols (fakes: ``FakeQueue``, ``FakeStore``
and their rows, re-exported here), the kit that drives a handler through the real claim ->
apply -> complete path on a throwaway PostgreSQL (kit), and the pytest plugin that offers the
kit as fixtures (pytest_plugin, the ``pytest11`` entry point ``sqs_ingest``). It may import
every other subpackage; public: ``service.testing``, ``service.testing.kit``.
"""

from __future__ import annotations

from service.testing.fakes import (
    OWN_LEAK_MARGIN,
    FakeDatabase,
    FakeOutbox,
    FakeOutboxRow,
    FakeQueue,
    FakeSink,
    FakeStore,
    FakeWorker,
    Row,
)

__all__ = [
    "OWN_LEAK_MARGIN",
    "FakeDatabase",
    "FakeOutbox",
    "FakeOutboxRow",
    "FakeQueue",
    "FakeSink",
    "FakeStore",
    "FakeWorker",
    "Row",
]

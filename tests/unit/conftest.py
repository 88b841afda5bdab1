"""Unit tests name databases they never reach (``postgresql://u@h/d``): the TLS policy
(INGEST_DATABASE_TLS, tests/unit/test_database_tls.py) would refuse each such host, so it
is opted out of here, and tested on its own there."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_tls_policy_for_unreached_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INGEST_DATABASE_TLS", "disable-verification")

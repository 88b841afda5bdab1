"""Fixtures shared by the first-contact tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tests.servers import Postgres


@pytest.fixture
async def password_role(pg_server: Postgres) -> AsyncIterator[str]:
    """A role that must log in with its password, 'the-right-one' (the test cluster trusts
    everyone else; the tests give it a wrong one): a scram pg_hba line for it alone, ahead
    of the trust lines."""
    role = "pw_" + uuid.uuid4().hex[:8]
    hba = Path(pg_server.datadir) / "pg_hba.conf"
    original = hba.read_text()
    hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n" + original)
    conn = await asyncpg.connect(pg_server.dsn())
    try:
        await conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'the-right-one'")
        await conn.execute("SELECT pg_reload_conf()")
        yield role
    finally:
        hba.write_text(original)
        await conn.execute("SELECT pg_reload_conf()")
        await conn.execute(f"DROP ROLE IF EXISTS {role}")
        await conn.close()

"""pytest fixtures for handler authors (entry point ``pytest11``: loaded wherever sqs-ingest is
installed). They test a handler through the daemon's real batch path (service.testing.kit):

- ``ingest_schema_sql`` — override it to return your tables' SQL (list of statements or
  files' text); it is applied once, after sqs-ingest's own migrations, to the template;
- ``ingest_postgres`` (session) — a throwaway PostgreSQL with that migrated template;
- ``ingest_database`` — a fresh migrated database (a DSN) per test, copied from the template;
- ``ingest_database_factory`` — ``await factory()`` for more fresh databases in one test;
- ``ingest_runner`` — ``await ingest_runner.run([body, ...])`` -> one ``Outcome`` per body;
- ``ingest_lands_once`` — ``await ingest_lands_once(body, snapshot)``: the effect of
  ``body`` is the same alone and beside a neighbour that fails in its batch.

The async fixtures need pytest-asyncio (installed with sqs-ingest's dev extra).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio

TEMPLATE = "ingest_kit_template"


@pytest.fixture(scope="session")
def ingest_schema_sql() -> list[str]:
    """Your handlers' own tables: override in your conftest.py."""
    return []


@pytest.fixture(scope="session")
def ingest_postgres(ingest_schema_sql: list[str]) -> Iterator[Any]:
    import asyncio

    from service.testing.kit import create_template, postgres_server

    with postgres_server() as pg:
        asyncio.run(create_template(pg, TEMPLATE, ingest_schema_sql))
        yield pg


@pytest_asyncio.fixture
async def ingest_database_factory(ingest_postgres: Any) -> AsyncIterator[
        Callable[[], Awaitable[str]]]:
    import asyncpg

    made: list[str] = []

    async def new_database() -> str:
        name = "kit_" + uuid.uuid4().hex[:12]
        conn = await asyncpg.connect(ingest_postgres.dsn())
        try:
            await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
        finally:
            await conn.close()
        made.append(name)
        return str(ingest_postgres.dsn(name))

    yield new_database
    conn = await asyncpg.connect(ingest_postgres.dsn())
    try:
        for name in made:
            await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()


@pytest_asyncio.fixture
async def ingest_database(ingest_database_factory: Callable[[], Awaitable[str]]) -> str:
    return await ingest_database_factory()


@pytest.fixture
def ingest_runner(ingest_database: str) -> Any:
    from service.testing.kit import Runner

    return Runner(ingest_database)


@pytest.fixture
def ingest_lands_once(ingest_database_factory: Callable[[], Awaitable[str]]) -> Callable[
        ..., Awaitable[Any]]:
    from service.testing.kit import check_lands_once

    async def check(body: str, snapshot: Callable[[Any], Awaitable[Any]],
                    registry: Any = None) -> Any:
        return await check_lands_once(ingest_database_factory, body, snapshot, registry)

    return check

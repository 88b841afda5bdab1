"""pytest fixtures for handler authors (entry point ``pytest11``: loaded wherever sqs-ingest is
installed). They test a handler through the daemon's real batch path (service.testing.kit):

- ``ingest_schema_sql`` — override it to return your tables' SQL (list of statements or
  files' text); it is applied once, after sqs-ingest's own migrations, to the template.
  An installed handler package's migrations (entry points ``sqs_ingest.migrations``) are
  applied there already; ``service.testing.kit.handler_migrations("your_package")`` reads
  them from a package that is importable but not installed;
- ``ingest_postgres`` (session) — a throwaway PostgreSQL (``initdb``) with that migrated
  template, or, when ``INGEST_TEST_DATABASE_URL`` is set, the server at that URL (a CI
  service container, Docker on macOS: the role needs CREATEDB; the kit's databases are
  dropped at the end);
- ``ingest_database`` — a fresh migrated database (a DSN) per test, copied from the template;
- ``ingest_database_factory`` — ``await factory()`` for more fresh databases in one test;
- ``ingest_runner`` — ``await ingest_runner.run([body, ...])`` -> one ``Outcome`` per body;
- ``ingest_lands_once`` — ``await ingest_lands_once(body, snapshot)``: the effect of
  ``body`` is the same alone and beside a neighbour that fails in its batch.

The async fixtures need pytest-asyncio: ``pip install 'sqs-ingest[testing]'``. Without it
the plugin still loads (pytest keeps working in a project that does not test handlers) and
the fixtures that need it fail with that line.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

pytest_asyncio: Any
try:
    import pytest_asyncio
except ImportError:  # the testing extra is not installed
    pytest_asyncio = None

TEMPLATE = "ingest_kit_template"
#: A PostgreSQL to use instead of a throwaway ``initdb`` cluster.
DATABASE_URL_VARIABLE = "INGEST_TEST_DATABASE_URL"
_NEEDS_ASYNCIO = ("the sqs-ingest test kit's async fixtures need pytest-asyncio: "
                  "pip install 'sqs-ingest[testing]'")


def _async_fixture(fn: Any) -> Any:
    if pytest_asyncio is not None:
        return pytest_asyncio.fixture(fn)

    @pytest.fixture(name=fn.__name__)
    def missing() -> None:
        raise pytest.UsageError(_NEEDS_ASYNCIO)

    return missing


@pytest.fixture(scope="session")
def ingest_schema_sql() -> list[str]:
    """Your handlers' own tables: override in your conftest.py."""
    return []


@pytest.fixture(scope="session")
def ingest_template_name() -> str:
    """The template database's name: fixed on a throwaway server, unique on a shared one."""
    if os.environ.get(DATABASE_URL_VARIABLE):
        return f"{TEMPLATE}_{uuid.uuid4().hex[:8]}"
    return TEMPLATE


@pytest.fixture(scope="session")
def ingest_postgres(ingest_schema_sql: list[str], ingest_template_name: str) -> Iterator[Any]:
    import asyncio

    from service.testing.kit import ExistingPostgres, create_template, postgres_server

    if isinstance(ingest_schema_sql, str):  # each character would run as a statement
        raise pytest.UsageError("ingest_schema_sql must return a list of SQL strings, "
                                "not one string")
    url = os.environ.get(DATABASE_URL_VARIABLE)
    if not url:
        with postgres_server() as pg:
            asyncio.run(create_template(pg, ingest_template_name, ingest_schema_sql))
            yield pg
        return
    existing = ExistingPostgres(url)
    asyncio.run(create_template(existing, ingest_template_name, ingest_schema_sql))
    try:
        yield existing
    finally:
        asyncio.run(_drop(existing, [ingest_template_name]))


async def _drop(pg: Any, names: list[str]) -> None:
    import asyncpg

    conn = await asyncpg.connect(pg.dsn())
    try:
        for name in names:
            await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()


@_async_fixture
async def ingest_database_factory(ingest_postgres: Any, ingest_template_name: str) -> AsyncIterator[
        Callable[[], Awaitable[str]]]:
    import asyncpg

    made: list[str] = []

    async def new_database() -> str:
        name = "kit_" + uuid.uuid4().hex[:12]
        conn = await asyncpg.connect(ingest_postgres.dsn())
        try:
            await conn.execute(f"CREATE DATABASE {name} TEMPLATE {ingest_template_name}")
        finally:
            await conn.close()
        made.append(name)
        return str(ingest_postgres.dsn(name))

    yield new_database
    await _drop(ingest_postgres, made)


@_async_fixture
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

"""``python -m tests.pg_for CMD ...``: run CMD with one throwaway PostgreSQL (and the
migrated template database the tests copy) that every pytest session CMD starts shares:
tests/conftest.py's ``pg_server`` takes INGEST_TEST_PG_PORT / INGEST_TEST_PG_USER instead
of starting a server of its own. ``make mutation`` and the SQL mutant harness use it so
that a mutant's test run does not pay for a PostgreSQL start (initdb + start: seconds)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from service.testing.kit import create_template
from tests.servers import Postgres, postgres_server

TEMPLATE_DB = "ingest_template"  # tests/conftest.py's


@contextlib.contextmanager
def shared_postgres() -> Iterator[Postgres]:
    """A server with the template database, and the environment that points sessions at it."""
    with postgres_server() as pg:
        asyncio.run(create_template(pg, TEMPLATE_DB))
        saved = {k: os.environ.get(k) for k in ("INGEST_TEST_PG_PORT", "INGEST_TEST_PG_USER")}
        os.environ.update(INGEST_TEST_PG_PORT=str(pg.port), INGEST_TEST_PG_USER=pg.user)
        try:
            yield pg
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python -m tests.pg_for CMD [ARG ...]", file=sys.stderr)
        return 2
    with shared_postgres():
        return subprocess.call(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())

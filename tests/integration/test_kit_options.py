"""The handler author's kit beyond its throwaway cluster: a PostgreSQL given by URL
(INGEST_TEST_DATABASE_URL, as CI service containers and Docker-on-macOS users have), the
plugin without pytest-asyncio, and the message builder."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import asyncpg

from service.testing.kit import message, postgres_server

ROOT = Path(__file__).resolve().parents[2]

HANDLER = """
    from pydantic import BaseModel
    from service.handlers import current_request_id, handler

    class Note(BaseModel):
        text: str

    @handler("kit.note")
    async def note(payload: Note, conn) -> dict | None:
        await conn.execute("INSERT INTO notes VALUES ($1, $2)", current_request_id(),
                           payload.text)
        return {"ok": True}
"""
CONFTEST = """
    import kit_notes  # noqa: F401
    import pytest

    @pytest.fixture(scope="session")
    def ingest_schema_sql():
        return ["CREATE TABLE notes (request_id text PRIMARY KEY, text text)"]
"""
TEST = """
    from service.testing.kit import message

    async def test_note(ingest_runner, ingest_postgres):
        print("SERVER", ingest_postgres.dsn())
        out = await ingest_runner.run([message("kit.note", {"text": "hi"}, request_id="n-1")])
        assert [o.outcome for o in out] == ["completed"]
"""


def user_project(tmp_path: Path, test: str = TEST) -> Path:
    (tmp_path / "kit_notes.py").write_text(textwrap.dedent(HANDLER))
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_notes.py").write_text(textwrap.dedent(test))
    return tmp_path


def pytest_in(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o",
         "asyncio_mode=auto", *args, str(folder)],
        cwd=folder, capture_output=True, text=True, timeout=300,
        env={**clean, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]), **env})


async def _databases(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return [r[0] for r in await conn.fetch("SELECT datname FROM pg_database")]
    finally:
        await conn.close()


def test_the_kit_uses_an_existing_postgresql_by_url(tmp_path: Path) -> None:
    with postgres_server() as pg:
        url = pg.dsn("postgres")
        before = asyncio.run(_databases(url))
        done = pytest_in(user_project(tmp_path), INGEST_TEST_DATABASE_URL=url)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
        assert f"SERVER {url}" in done.stdout  # that server, not a cluster of its own
        assert asyncio.run(_databases(url)) == before  # its template and test databases dropped


def test_the_plugin_loads_without_pytest_asyncio_and_says_what_to_install(
        tmp_path: Path) -> None:
    project = user_project(tmp_path, test="""
        def test_plain():
            assert True

        def test_with_the_kit(ingest_runner):
            pass
    """)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "pytest_asyncio.py").write_text("raise ImportError('not installed')\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio",
         str(project)], cwd=project, capture_output=True, text=True, timeout=300,
        env={**clean, "PYTHONPATH": os.pathsep.join([str(shadow), str(project), str(ROOT)])})
    assert "1 passed" in done.stdout, done.stdout[-3000:]
    assert "pip install 'sqs-ingest[testing]'" in done.stdout, done.stdout[-3000:]


def test_the_message_builder_makes_bodies_the_daemon_parses() -> None:
    from pydantic import BaseModel

    from service.core.messages import Received, parse
    from service.core.registry import default_registry
    from service.handlers import load_reference_handlers

    class Upsert(BaseModel):
        entity_id: str
        version: int
        data: dict

    load_reference_handlers()
    body = message("entity.upsert", Upsert(entity_id="e", version=1, data={}), request_id="r-9")
    assert json.loads(body) == {"request_id": "r-9", "type": "entity.upsert",
                                "payload": {"entity_id": "e", "version": 1, "data": {}}}
    for raw in (body, message("entity.upsert", {"entity_id": "e", "version": 1, "data": {}},
                              request_id="r-9", sns=True)):
        parsed = parse(Received(message_id="m", receipt_handle="h", body=raw,
                                receive_count=1), default_registry)
        assert getattr(parsed, "request_id", None) == "r-9", parsed
    assert json.loads(message("entity.upsert", {}))["request_id"].startswith("kit-")

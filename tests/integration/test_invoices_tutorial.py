"""examples/invoices/README.md, followed as a user would: every ```sh block, in order, in one
bash (``set -euo pipefail``) in a copy of the example folder, against the tests' PostgreSQL
and moto_server. Then the request the tutorial sent is COMPLETED once and its row is in the
package's table.

The ```shell block (step 6, the image recipe: Docker) is run by
tests/container/test_handler_image.py.

One command is stood in for: ``pip install -e .`` would build the package in an isolated
environment, fetching its build backend, and the tests are offline; in its place the
package is laid out as pip installs it (tests/handler_package.install: the package and a
dist-info with the pyproject's entry points) in a folder on PYTHONPATH. Any other command is run as written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.integration.test_migrate import empty_db
from tests.servers import Postgres, _pg_bin, free_port

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "invoices"
INSTALL = "pip install -e ."
_SH = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)


def tutorial_script() -> list[str]:
    blocks = _SH.findall((EXAMPLE / "README.md").read_text())
    assert len(blocks) >= 4, "the tutorial's sh blocks were not found"
    return blocks


async def test_every_command_of_the_invoices_tutorial_runs(
    pg_server: Postgres, tmp_path: Path, queue_url: str, sqs_endpoint: str
) -> None:
    work = tmp_path / "invoices"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    site = tmp_path / "site"
    blocks = tutorial_script()
    script = "\n".join(blocks)
    assert script.count(INSTALL) == 1
    stand_in = (f'{sys.executable} -c "from tests.handler_package import install; '
                f'from pathlib import Path; install(Path.cwd(), Path({str(site)!r}))"')
    script = "set -euo pipefail\n" + script.replace(INSTALL, stand_in)

    owner = await empty_db(pg_server)
    db = owner.rsplit("/", 1)[1]
    app = f"postgresql://invoices_app:change-me@127.0.0.1:{pg_server.port}/{db}"
    bins = [str(Path(sys.executable).parent), str(Path(_pg_bin("psql")).parent)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env.update(
        PATH=os.pathsep.join([*bins, env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join([str(site), str(REPO)]),
        OWNER_DATABASE_URL=owner, APP_DATABASE_URL=app,
        INGEST_QUEUE_URL=queue_url, INGEST_SQS_ENDPOINT_URL=sqs_endpoint,
        INGEST_HTTP_PORT=str(free_port()), INGEST_WAIT_TIME_SECONDS="1",
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_REGION="us-east-1",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
        assert "invoice.created" in done.stdout  # sqs-ingest handlers
        assert "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE public.invoices TO invoices_app;" \
            in done.stdout
        conn = await asyncpg.connect(owner)
        try:
            rows = await conn.fetch("SELECT i.invoice_id, i.customer, i.amount_cents, m.status"
                                    " FROM invoices i JOIN modifications m USING (request_id)")
            assert [tuple(r) for r in rows] == [("inv-1", "acme", 1200, "COMPLETED")]
            assert await conn.fetchval("SELECT count(*) FROM modifications") == 1
        finally:
            await conn.close()
    finally:
        admin = await asyncpg.connect(pg_server.dsn())
        try:  # roles are the cluster's: the next run creates it again
            await admin.execute(f"DROP DATABASE IF EXISTS {db}")
            await admin.execute("DROP ROLE IF EXISTS invoices_app")
        finally:
            await admin.close()

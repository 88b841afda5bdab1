"""A handler package in its own image, built by the recipe of examples/invoices/README.md:
its ```shell block (step 6) run as written in a copy of the example folder — the runtime
image rebuilt keeping DynamoDB's model (the daemon's other layers come from the cache), the
wheel built and hashed, examples/invoices/Dockerfile on top of it. Then that image migrates,
grants and runs the package's handler against the session's PostgreSQL and moto_server on
loopback (host network, hardened as deploy/ runs it), and botocore inside it reaches the
DynamoDB the recipe kept while a service nobody asked for stays cut.

(The ```sh blocks of the same README are run by tests/integration/test_invoices_tutorial.py.)
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest

from service.testing.kit import message
from tests.container.conftest import BUILD_TIMEOUT, ROOT, Container, docker
from tests.container.test_images import GRACE, fetch, http_status
from tests.servers import Postgres, free_port, wait_until

pytestmark = [pytest.mark.container, pytest.mark.timeout(900)]

EXAMPLE = ROOT / "examples" / "invoices"
IMAGE = "invoices:0.1.0"
_SHELL = re.compile(r"^```shell\n(.*?)^```", re.S | re.M)
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
       "AWS_REGION": "us-east-1"}


def recipe() -> str:
    blocks = _SHELL.findall((EXAMPLE / "README.md").read_text())
    assert len(blocks) == 1, "examples/invoices/README.md: one ```shell block, the image recipe"
    return str(blocks[0])


@pytest.fixture(scope="module")
def invoices_image(images: dict[str, float], tmp_path_factory: pytest.TempPathFactory
                   ) -> str:
    work = tmp_path_factory.mktemp("recipe") / "invoices"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("__pycache__", "dist"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               SQS_INGEST=str(ROOT),
               # This engine's client has no buildx: the legacy builder, as scripts/image.sh.
               DOCKER_BUILDKIT="0")
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + recipe()], cwd=work, env=env,
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    # The recipe's last command: `handlers` run in the image lists the package's type.
    assert any(line.startswith("invoice.created ") for line in done.stdout.splitlines()), \
        done.stdout[-4000:]
    return IMAGE


@pytest.fixture
async def owner_database(pg_server: Postgres) -> str:
    name = "h_" + uuid.uuid4().hex[:12]
    await fetch(pg_server.dsn(), f"CREATE DATABASE {name}")
    return pg_server.dsn(name)


def one_shot(image: str, env: dict[str, str], args: list[str],
             containers: list[Container]) -> str:
    c = Container(image, env, args)
    containers.append(c)
    assert c.run().wait(120) == 0, c.logs()
    return c.logs()


async def test_the_handler_image_migrates_grants_and_lands_each_invoice_once(
    invoices_image: str, owner_database: str, pg_server: Postgres, sqs_client: Any,
    sqs_endpoint: str, containers: list[Container],
) -> None:
    owner = owner_database
    assert docker("run", "--rm", "--network", "none", "--entrypoint", "id", invoices_image,
                  "-u").strip() == "10001"
    one_shot(invoices_image, {"INGEST_DATABASE_URL": owner}, ["migrate"], containers)
    role = "inv_" + uuid.uuid4().hex[:8]
    await fetch(owner, f"CREATE ROLE {role} LOGIN PASSWORD 'change-me'")
    try:
        one_shot(invoices_image, {"INGEST_DATABASE_URL": owner},
                 ["grants", "--role", role, "--apply"], containers)
        app = f"postgresql://{role}:change-me@127.0.0.1:{pg_server.port}/{owner.rsplit('/', 1)[1]}"

        queue_url = sqs_client.create_queue(QueueName="inv-" + uuid.uuid4().hex[:10])["QueueUrl"]
        invoices = [{"invoice_id": f"inv-{i}", "customer": "acme", "amount_cents": 100 * i}
                    for i in range(1, 6)]
        bodies = [message("invoice.created", p, request_id=f"r-{p['invoice_id']}")
                  for p in invoices]
        for body in [*bodies, bodies[0], bodies[3]]:  # two delivered twice
            sqs_client.send_message(QueueUrl=queue_url, MessageBody=body)

        port = free_port()
        d = Container(invoices_image, {
            "INGEST_DATABASE_URL": app, "INGEST_QUEUE_URL": queue_url,
            "INGEST_SQS_ENDPOINT_URL": sqs_endpoint, "INGEST_WAIT_TIME_SECONDS": "1",
            "INGEST_HTTP_PORT": str(port), "INGEST_HTTP_HOST": "127.0.0.1", **AWS})
        containers.append(d)
        d.run()

        async def landed() -> int:
            return int((await fetch(owner, "SELECT count(*) AS n FROM invoices"))[0]["n"])

        deadline = time.monotonic() + 90
        while await landed() < len(invoices):
            assert d.running(), d.logs()
            assert time.monotonic() < deadline, f"{await landed()} of {len(invoices)} landed"
            await asyncio.sleep(0.1)
        wait_until(lambda: http_status(port, "/readyz") == 200, 30, "/readyz 200")
        wait_until(lambda: int(sqs_client.get_queue_attributes(
            QueueUrl=queue_url, AttributeNames=["All"])["Attributes"][
                "ApproximateNumberOfMessages"]) == 0, 60, "queue drained")
        assert d.stop(GRACE) == 0, d.logs()
        rows = await fetch(owner, "SELECT i.invoice_id, i.amount_cents, m.status"
                                  " FROM invoices i JOIN modifications m USING (request_id)"
                                  " ORDER BY i.invoice_id")
        assert [tuple(r) for r in rows] == [
            (p["invoice_id"], p["amount_cents"], "COMPLETED") for p in invoices]
        assert (await fetch(owner, "SELECT count(*) AS n FROM modifications"))[0]["n"] == 5
    finally:
        await fetch(owner, f"DROP OWNED BY {role}")
        await fetch(owner, f"DROP ROLE {role}")


PROBE = """
import sys, botocore.session
from botocore.exceptions import UnknownServiceError
session = botocore.session.get_session()
ddb = session.create_client("dynamodb", endpoint_url=sys.argv[1], region_name="us-east-1")
print("tables", ddb.list_tables()["TableNames"])
try:
    session.create_client("ec2", endpoint_url=sys.argv[1], region_name="us-east-1")
except UnknownServiceError:
    print("ec2 cut")
"""


def test_the_handler_image_keeps_the_aws_services_the_recipe_names(
    invoices_image: str, sqs_endpoint: str,
) -> None:
    table = "t" + uuid.uuid4().hex[:10]
    ddb = boto3.client("dynamodb", endpoint_url=sqs_endpoint, region_name="us-east-1",
                       aws_access_key_id="testing", aws_secret_access_key="testing")
    ddb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                     AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}],
                     KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}])
    env = [arg for k, v in AWS.items() for arg in ("-e", f"{k}={v}")]
    out = docker("run", "--rm", "--network", "host", "--read-only", "--cap-drop", "ALL", *env,
                 "--entrypoint", "python", invoices_image, "-c", PROBE, sqs_endpoint)
    lines = out.splitlines()
    assert lines[-1] == "ec2 cut", out
    assert table in lines[0], out

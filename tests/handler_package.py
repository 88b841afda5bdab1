"""A handler package as a user writes one (pyproject.toml with both entry-point groups, a
module with a @handler, ``migrations/001_*.sql``) and installed as pip leaves it: the
package and a ``*.dist-info`` folder whose entry_points.txt is read from the pyproject.toml.
(This venv has no wheel builder offline, so the dist-info is written here, not by pip.)"""

from __future__ import annotations

import shutil
import textwrap
import tomllib
from pathlib import Path

PYPROJECT = """
[project]
name = "acme-orders"
version = "1.0"
dependencies = ["sqs-ingest"]

[project.entry-points."sqs_ingest.handlers"]
acme_orders = "acme_orders.handlers"

[project.entry-points."sqs_ingest.migrations"]
acme_orders = "acme_orders"
"""

HANDLERS = '''
import asyncpg
from pydantic import BaseModel

from service.handlers import current_request_id, handler


class Order(BaseModel):
    order_id: str
    amount_cents: int


@handler("acme.order")
async def order(payload: Order, conn: asyncpg.Connection) -> dict[str, bool]:
    done = await conn.execute(
        "INSERT INTO acme_orders (order_id, amount_cents, request_id) VALUES ($1, $2, $3)"
        " ON CONFLICT (order_id) DO NOTHING",
        payload.order_id, payload.amount_cents, current_request_id())
    return {"stored": done.endswith(" 1")}
'''

MIGRATION = """
CREATE TABLE acme_orders (
    id            bigserial PRIMARY KEY,
    order_id      text NOT NULL UNIQUE,
    amount_cents  bigint NOT NULL,
    request_id    text NOT NULL
);
"""


def write_package(folder: Path) -> Path:
    """The package's source tree in ``folder`` (created empty by the caller)."""
    (folder / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT).lstrip())
    pkg = folder / "acme_orders"
    (pkg / "migrations").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "handlers.py").write_text(textwrap.dedent(HANDLERS).lstrip())
    (pkg / "migrations" / "001_orders.sql").write_text(textwrap.dedent(MIGRATION).lstrip())
    return folder


def install(source: Path, site: Path) -> None:
    """Install ``source`` (a project folder with a pyproject.toml and top-level packages)
    into ``site`` the way pip lays it out."""
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    site.mkdir(parents=True, exist_ok=True)
    packages = [p for p in source.iterdir() if (p / "__init__.py").is_file()]
    for pkg in packages:
        shutil.copytree(pkg, site / pkg.name, dirs_exist_ok=True)
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
        for group, eps in groups.items()))
    (info / "top_level.txt").write_text("".join(f"{p.name}\n" for p in packages))
    (info / "RECORD").write_text("")

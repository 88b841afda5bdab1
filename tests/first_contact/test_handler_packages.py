"""Handler packages (SPEC §7): a distribution declaring entry points in the group
``sqs_ingest.handlers`` is loaded by ``run``, ``handlers`` and ``schema`` with INGEST_HANDLERS;
two packages registering one type exit 2 naming both. The packages here are installed the
way pip leaves them: a module and a ``*.dist-info`` folder on the path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def install(site: Path, dist: str, module: str, source: str) -> None:
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[sqs_ingest.handlers]\n{module} = {module}\n")
    (info / "top_level.txt").write_text(f"{module}\n")
    (info / "RECORD").write_text(f"{module}.py,,\n")


HANDLER = """
    from pydantic import BaseModel
    from service.handlers import handler

    class Payload(BaseModel):
        n: int

    @handler("{type}")
    async def handle(payload: Payload, conn) -> dict | None:
        return None
"""


def sqs_ingest(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
    return subprocess.run(
        [sys.executable, "-m", "service", *args], capture_output=True, text=True, timeout=120,
        env={**clean, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), **env})


def test_an_installed_handler_package_is_loaded(tmp_path: Path) -> None:
    install(tmp_path, "acme-invoices", "acme_invoices", HANDLER.format(type="acme.invoice"))
    done = sqs_ingest(tmp_path, "handlers")
    assert done.returncode == 0, done.stderr
    assert "acme.invoice" in done.stdout and "entity.upsert" in done.stdout
    schema = sqs_ingest(tmp_path, "schema")
    assert schema.returncode == 0 and "acme.invoice" in schema.stdout


def test_two_packages_registering_one_type_exit_2_naming_both(tmp_path: Path) -> None:
    install(tmp_path, "acme-invoices", "acme_invoices", HANDLER.format(type="shared.type"))
    install(tmp_path, "billing-handlers", "billing_handlers", HANDLER.format(type="shared.type"))
    for command in ("handlers", "run"):
        done = sqs_ingest(tmp_path, command, INGEST_QUEUE_URL="http://127.0.0.1:9/q",
                          INGEST_DATABASE_URL="postgresql://u@127.0.0.1:9/d")
        assert done.returncode == 2, (command, done.stderr)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, done.stderr
        assert "shared.type" in lines[0]
        assert "acme-invoices" in lines[0] and "billing-handlers" in lines[0], lines[0]


def test_a_package_that_cannot_import_names_itself(tmp_path: Path) -> None:
    install(tmp_path, "broken-handlers", "broken_handlers", "import no_such_dependency_xyz\n")
    done = sqs_ingest(tmp_path, "handlers")
    assert done.returncode == 2
    assert "broken-handlers" in done.stderr and "no_such_dependency_xyz" in done.stderr

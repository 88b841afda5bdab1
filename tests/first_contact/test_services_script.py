"""`make run`'s set-up (scripts/services.sh) from a checkout user postgres cannot enter.

A root user's clone under /root, or in a `mktemp -d` directory (mode 0700), is where a new
user first types `make run`; PostgreSQL runs as user postgres and must still start. The
moto server it leaves running must survive the Ctrl-C that stops `make run`'s daemon.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import asyncpg
import pytest

from tests.servers import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the postgres-user case needs root")


def _env_file(checkout: Path) -> dict[str, str]:
    out = {}
    for line in (checkout / ".run" / "env").read_text().splitlines():
        for assignment in line.removeprefix("export ").split():
            k, _, v = assignment.partition("=")
            out[k] = v
    return out


def _moto_up(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
        return True
    except OSError:
        return False


async def test_services_start_from_a_checkout_postgres_cannot_enter(tmp_path: Path) -> None:
    checkout = tmp_path / "clone"  # tmp_path's parents are 0700 root: postgres cannot enter
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "services.sh", checkout / "scripts")
    (checkout / ".venv").symlink_to(Path(sys.prefix))
    assert subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", str(checkout)]
                          ).returncode != 0, "the premise: postgres cannot enter the checkout"
    env = {**os.environ, "PG_PORT": str(free_port()), "SQS_PORT": str(free_port())}
    script = [str(checkout / "scripts" / "services.sh")]
    # Its own process group, like the terminal `make run` is typed in.
    proc = subprocess.Popen([*script, "start"], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        settings = _env_file(checkout)
        conn = await asyncpg.connect(settings["INGEST_DATABASE_URL"])
        assert await conn.fetchval("SELECT current_database()") == "ingest"
        await conn.close()
        endpoint = settings["INGEST_SQS_ENDPOINT_URL"]
        assert _moto_up(endpoint)
        moto_pid = int((checkout / ".run" / "moto.pid").read_text())
        assert os.getpgid(moto_pid) != proc.pid, "moto is in the terminal's process group"
        # Ctrl-C: SIGINT to the whole process group the script ran in (gone already when
        # nothing it started stayed in it).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        assert wait_until(lambda: _moto_up(endpoint), 5, "moto still up after Ctrl-C")
        assert subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", env["PG_PORT"]]
                              ).returncode == 0, "PostgreSQL must survive the Ctrl-C too"
    finally:
        stopped = subprocess.run([*script, "stop"], env=env, capture_output=True, text=True,
                                 timeout=60)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    wait_until(lambda: not _moto_up(endpoint), 30, "moto stopped by services.sh stop")
    pg_isready = subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", env["PG_PORT"]])
    assert pg_isready.returncode != 0, "services.sh stop left PostgreSQL running"
    digest = subprocess.run(["sha256sum"], input=str(checkout), capture_output=True,
                            text=True).stdout[:12]
    shutil.rmtree(f"/var/tmp/sqs-ingest-{digest}", ignore_errors=True)

"""Real PostgreSQL and a real SQS emulator on loopback, started for the test session.

Shared by the integration, acceptance and reconcile suites (and the benchmarks):
a throwaway cluster from ``initdb`` and a ``moto_server``, each on a free port.
Per-test databases are copied from a migrated template (``CREATE DATABASE … TEMPLATE``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _pg_bin(name: str) -> str:
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"PostgreSQL binary {name} not found (apt-get install postgresql)")
    return found


@dataclass
class Postgres:
    port: int
    datadir: str
    sockdir: str
    user: str = "postgres"

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}"

    def stop(self, mode: str = "fast") -> None:
        self._ctl("stop", "-m", mode)

    def start(self) -> None:
        self._ctl(
            "start",
            "-l",
            os.path.join(self.datadir, "server.log"),
            "-o",
            # fsync=off survives a killed server (the OS keeps the WAL); synchronous_commit=off
            # would not: the chaos tests stop PostgreSQL with -m immediate.
            f"-p {self.port} -k {self.sockdir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c max_connections=300",
        )

    def _ctl(self, *args: str) -> None:
        cmd = [_pg_bin("pg_ctl"), "-w", "-D", self.datadir, *args]
        _run_as_postgres(cmd)


def _run_as_postgres(cmd: list[str]) -> None:
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    base = tempfile.mkdtemp(prefix="ingest-pg-")
    datadir, sockdir = os.path.join(base, "data"), os.path.join(base, "sock")
    os.makedirs(sockdir)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for p in (base, sockdir):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    _run_as_postgres([_pg_bin("initdb"), "-A", "trust", "-U", user, "-D", datadir])
    pg = Postgres(port=free_port(), datadir=datadir, sockdir=sockdir, user=user)
    pg.start()
    try:
        yield pg
    finally:
        with contextlib.suppress(Exception):
            pg.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    port = free_port()
    # moto_server plus a fix of its FIFO redelivery order (see tests/moto_fifo.py).
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("moto_fifo.py")), "-H", "127.0.0.1",
         "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            return True
        except OSError:
            return False

    try:
        wait_until(up, 30, "moto_server")
        yield url
    finally:
        stop_process(proc)


# -- LocalStack in host mode (no Docker) ------------------------------------------------
# Where realistic SQS behaviour, SNS or S3 matter (redrive to a DLQ, message-move tasks,
# extended-client payloads in S3). scripts/install.sh builds its venv at .venv-localstack
# (scripts/localstack-venv.sh: localstack-core 4.13.1 on the system Python, as on a fresh
# Debian 12); LOCALSTACK_VENV points the tests at another one. The benchmarks pass their own.

ROOT = Path(__file__).resolve().parent.parent
LOCALSTACK_VENV = Path(os.environ.get("LOCALSTACK_VENV") or ROOT / ".venv-localstack")
LOCALSTACK_PACKAGES = [
    "localstack-core[runtime]==2026.3.0", "cbor2<6", "pyopenssl<25", "cryptography<45",
    "service-identity",
]


def localstack_python(venv: Path | None = None) -> Path:
    """The venv's interpreter; raises with the command that creates it if it is missing."""
    venv = venv or LOCALSTACK_VENV
    py = venv / "bin" / "python"
    if not py.exists():
        raise RuntimeError(f"LocalStack venv missing at {venv}: run scripts/install.sh "
                           "(or scripts/localstack-venv.sh)")
    return py


@dataclass
class LocalStack:
    url: str
    pid: int
    version: str
    log_path: str


@contextlib.contextmanager
def localstack_server(services: str = "sqs,sns,s3",
                      venv: Path | None = None) -> Iterator[LocalStack]:
    """LocalStack's gateway on a free loopback port, serving ``services``; ready in ~2 s."""
    py = localstack_python(venv)
    tmp = tempfile.mkdtemp(prefix="localstack-")
    port = free_port()
    env = {
        **os.environ,
        "GATEWAY_LISTEN": f"127.0.0.1:{port}", "SERVICES": services,
        "EAGER_SERVICE_LOADING": "1", "DNS_ADDRESS": "0", "SKIP_SSL_CERT_DOWNLOAD": "1",
        "DISABLE_EVENTS": "1", "SQS_ENDPOINT_STRATEGY": "path",
        "LOCALSTACK_HOST": f"127.0.0.1:{port}",
        "LOCALSTACK_VOLUME_DIR": f"{tmp}/volume", "CONFIG_DIR": f"{tmp}/config", "TMPDIR": tmp,
    }
    log_path = f"{tmp}/localstack.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([str(py), "-m", "localstack.runtime.main"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wanted = [s.strip() for s in services.split(",") if s.strip()]

    def health() -> dict[str, Any] | None:
        if proc.poll() is not None:
            raise RuntimeError(f"LocalStack exited {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/_localstack/health", timeout=1) as r:
                doc: dict[str, Any] = json.loads(r.read())
        except OSError:
            return None
        states = doc.get("services", {})
        return doc if all(states.get(s) in ("running", "available") for s in wanted) else None

    try:
        doc = wait_until(health, 90, f"LocalStack ({services})", interval=0.1)
        yield LocalStack(url, proc.pid, str(doc.get("version")), log_path)
    finally:
        stop_process(proc, 15)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)

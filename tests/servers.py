"""Real PostgreSQL and a real SQS emulator on loopback, started for the test session.

Shared by the integration, acceptance and reconcile suites (and the benchmarks):
a throwaway cluster from ``initdb`` and a ``moto_server``, each on a free port.
Per-test databases are copied from a migrated template (``CREATE DATABASE … TEMPLATE``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
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

# The PostgreSQL launcher is the handler author's kit's (service.testing.kit): one implementation.
from service.testing.kit import (  # noqa: F401  (re-exported to the suites)
    Postgres,
    _pg_bin,
    _run_as_postgres,
    postgres_server,
)
from service.testing.kit import free_port as kernel_port

#: Ports this process handed out: never handed out again (a server may still be starting).
_handed_out: set[int] = set()
_rng = random.Random()  # its own: a test seeding ``random`` must not make ports repeat


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nothing listens on, for a server the test starts next.

    Not the kernel's pick (``bind`` to port 0): that is a random port of the ephemeral range,
    and a port handed out but not bound yet (a daemon still importing, or restarting after
    kill -9) can be the kernel's pick again — for this process or the other xdist worker —
    and the second server to bind it fails to start. Here: a port below the ephemeral range
    (neither ``bind`` to 0 nor ``connect`` takes those), from this xdist worker's own slice,
    never the same one twice in a process."""
    first, top = 10000, _ephemeral_range()[0]
    if top - first < 2000:  # no room below the ephemeral range: the kernel's pick
        return int(kernel_port())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    size = (top - first) // workers
    start = first + (int(worker) % workers if worker.isdigit() else 0) * size
    for _ in range(1000):
        port = _rng.randrange(start, start + size)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # someone else's
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {start}..{start + size - 1}")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


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

"""The images built by ``make image``, run by a real container engine.

The engine is used when ``docker info`` answers; otherwise, as root, ``scripts/engine.sh``
installs Debian's (docker.io, debootstrap) when missing and starts one. It is left running,
like ``make run``'s PostgreSQL: its image cache makes the next build fast, and another build
or test may be using it (``scripts/engine.sh stop`` stops it). Only a non-root run without
an engine skips them, naming the fix — and ``make test``'s strict mode fails that skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import wait_until

ROOT = Path(__file__).resolve().parents[2]
DAEMON_IMAGE = "sqs-ingest:latest"
RECONCILE_IMAGE = "sqs-ingest-reconcile:latest"
# Generous: a cold build downloads the base packages, the dependencies and pyspark.
BUILD_TIMEOUT = 1500


def _missing(why: str) -> None:
    pytest.skip(f"{why}: as root, scripts/engine.sh start installs and starts one")


def _engine_up() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="session")
def engine() -> None:
    if _engine_up():
        return
    if os.geteuid() != 0:
        _missing("no container engine answers (docker info)")
    script = ROOT / "scripts" / "engine.sh"
    # Bounded: apt-get install on a fresh machine, then dockerd's start (60 s of its own).
    proc = subprocess.run([str(script), "start"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        _missing(f"scripts/engine.sh start failed: {proc.stderr.strip()[-500:]}")


@pytest.fixture(scope="session")
def images(engine: None) -> dict[str, float]:
    """``make image``'s script, timed (seconds); a no-op rebuild when nothing changed. One
    build at a time: the test files of tests/container run on several workers (make test's
    --dist loadfile), and a second cold build beside the first would redo its downloads."""
    started = time.monotonic()
    with open(Path(tempfile.gettempdir()) / "sqs-ingest-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        proc = subprocess.run([str(ROOT / "scripts" / "image.sh")], cwd=ROOT,
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"build_seconds": time.monotonic() - started}


class Container:
    """One ``docker run -d`` of an image on the host network, hardened as deploy/ runs it."""

    def __init__(self, image: str, env: dict[str, str], args: list[str] | None = None,
                 mounts: list[tuple[Path, str, str]] | None = None,
                 extra: list[str] | None = None) -> None:
        self.name = f"sqs-ingest-test-{os.getpid()}-{time.monotonic_ns()}"
        self.image = image
        self.env = env
        self.args = args or []
        self.mounts = mounts or []
        self.extra = extra or []

    def run(self) -> Container:
        cmd = ["docker", "run", "-d", "--name", self.name, "--network", "host",
               "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
               "--security-opt", "no-new-privileges", *self.extra]
        for k, v in self.env.items():
            cmd += ["-e", f"{k}={v}"]
        for src, dst, mode in self.mounts:
            cmd += ["-v", f"{src}:{dst}:{mode}"]
        docker(*cmd[1:], self.image, *self.args)
        return self

    def start(self) -> None:
        docker("start", self.name)

    def state(self) -> dict[str, Any]:
        return dict(json.loads(docker("inspect", "--format", "{{json .State}}", self.name)))

    def running(self) -> bool:
        return bool(self.state()["Running"])

    def wait(self, timeout: float) -> int:
        wait_until(lambda: not self.running(), timeout, f"{self.image} to exit", interval=0.2)
        return int(self.state()["ExitCode"])

    def stop(self, grace: int) -> int:
        docker("stop", "-t", str(grace), self.name, timeout=grace + 30)
        return int(self.state()["ExitCode"])

    def kill9(self) -> None:
        docker("kill", "--signal", "KILL", self.name)
        self.wait(30)

    def logs(self) -> str:
        proc = subprocess.run(["docker", "logs", self.name], capture_output=True, text=True,
                              timeout=30)
        return (proc.stdout + proc.stderr)[-6000:]

    def remove(self) -> None:
        subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, timeout=60)


def docker(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"docker {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    """Containers a test started, removed (with their logs printed on failure) after it."""
    started: list[Container] = []
    yield started
    for c in started:
        print(f"--- logs of {c.image} ({c.name}) ---\n{c.logs()}")
        c.remove()

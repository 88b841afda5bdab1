"""Installs are the lock (issue 21): the venv the tests run in holds exactly the versions
of requirements/dev.txt (what make install / CI install with pip --require-hashes), every
lock pins with hashes, the narrower locks agree with dev.txt, and every dependency that
pyproject.toml declares is locked."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
LOCKS = ("dev.txt", "runtime.txt", "run.txt", "otel.txt", "reconcile.txt")
# The installers themselves, not part of the locked closure (pip comes with the venv; uv
# installs make run's set when present).
INSTALLERS = {"pip", "setuptools", "wheel", "uv"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    """name -> version of a lock; asserts every requirement is pinned with a hash."""
    text = path.read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    out = {}
    for block in blocks:
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", block)
        if not m:
            assert not block.strip() or block.lstrip().startswith("#"), block[:80]
            continue
        assert "--hash=sha256:" in block, f"{path.name}: {m.group(1)} has no hash"
        out[norm(m.group(1))] = m.group(2)
    return out


def test_venv_is_exactly_the_lock() -> None:
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all",
                             "--exclude-editable"], capture_output=True, text=True, check=True)
    installed = {}
    for line in freeze.stdout.splitlines():
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        assert m, f"not a pinned install (a direct URL or path?): {line}"
        installed[norm(m.group(1))] = m.group(2)
    # dev.txt, and the build backend the project is installed with (--no-build-isolation).
    locked = pins(REQ / "dev.txt") | pins(REQ / "build.txt")
    for name in INSTALLERS:
        installed.pop(name, None)
        locked.pop(name, None)
    assert installed == locked


def test_locks_agree_and_cover_pyproject() -> None:
    dev = pins(REQ / "dev.txt")
    for name in LOCKS[1:]:
        narrow = pins(REQ / name)
        assert narrow, name
        assert {k: dev.get(k) for k in narrow} == narrow, f"{name} disagrees with dev.txt"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + [
        r for extra in project["optional-dependencies"].values() for r in extra]
    for req in declared:
        # why the ignore below: every requirement line starts with a name
        name = norm(re.match(r"[A-Za-z0-9._-]+", req).group(0))  # type: ignore[union-attr]
        assert name in dev, f"{req} is declared in pyproject.toml but not locked: make lock"
    runtime = pins(REQ / "runtime.txt")
    for req in project["dependencies"]:
        # why the ignore below: every requirement line starts with a name
        assert norm(re.match(r"[A-Za-z0-9._-]+", req).group(0)) in runtime, req  # type: ignore[union-attr]
    # One resolution: the locked botocore is the one aiobotocore, boto3 and moto accept.
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    for dist in ("aiobotocore", "boto3", "moto"):
        for r in map(Requirement, requires(dist) or []):
            if r.name == "botocore" and r.marker is None:
                assert r.specifier.contains(dev["botocore"]), (dist, str(r), dev["botocore"])


def test_installs_use_the_lock_with_hashes() -> None:
    install = (ROOT / "scripts/install.sh").read_text()
    assert "--require-hashes -r requirements/dev.txt" in install
    assert "--require-hashes -r requirements/run.txt" in install
    docker = (ROOT / "Dockerfile").read_text()
    pip_lines = [ln for ln in docker.splitlines() if re.search(r"\bpip install\b", ln)]
    for ln in pip_lines:
        # Locked sets with hashes, or our own wheel without dependencies.
        assert "--require-hashes -r /src/requirements/" in ln or "--no-deps" in ln, ln
    assert "LABEL io.sqs-ingest.lock-sha256=${LOCK_SHA256}" in docker
    assert "LOCK_SHA256=$lock" in (ROOT / "scripts/image.sh").read_text()


def test_image_apt_packages_are_pinned() -> None:
    docker = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for cmd in re.findall(r"apt-get install ([^&\n]*)", docker):
        packages = [w for w in cmd.split() if not w.startswith("-")]
        assert packages and all("=" in p for p in packages), cmd


def test_localstack_venv_is_exactly_its_lock() -> None:
    """The tests' LocalStack (scripts/localstack-venv.sh) is installed from its own hashed
    lock, requirements/localstack.txt, so every CI run meets the same emulator."""
    locked = pins(REQ / "localstack.txt")
    # why the ignore below: the lock pins localstack-core
    assert locked["localstack-core"] == re.search(  # type: ignore[union-attr]
        r"localstack-core\[runtime\]==(\S+)", (REQ / "localstack.in").read_text()).group(1)
    python = ROOT / ".venv-localstack" / "bin" / "python"
    if not python.exists():
        pytest.skip(".venv-localstack not built (make install builds it)")
    freeze = subprocess.run([str(python), "-m", "pip", "freeze", "--all"],
                            capture_output=True, text=True, check=True)
    installed = {norm(m.group(1)): m.group(2) for m in
                 re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", freeze.stdout, re.M)}
    for name in INSTALLERS:
        installed.pop(name, None)
        locked.pop(name, None)
    assert installed == locked

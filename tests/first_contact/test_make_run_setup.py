"""`make run` from a fresh clone installs what the daemon needs and nothing of `make test`'s
(issue 24): the runtime dependencies, PostgreSQL and the SQS emulator — no Spark extra, no dev
tools, no LocalStack venv, no Java, promtool or kubectl — and gets to a completed message."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: What `make test` adds and `make run` must not wait for.
TEST_ONLY_DEBIAN = {"openjdk-17-jre-headless", "libpostgresql-jdbc-java", "prometheus", "kubectl"}
TEST_ONLY_MODULES = ["pyspark", "pytest", "ruff", "mypy", "hypothesis", "localstack_client",
                     "cfnlint"]


def _plan(*args: str) -> dict[str, str]:
    out = subprocess.run(["scripts/install.sh", *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "INSTALL_PLAN": "1", "INSTALL_PRETEND_BARE": "1"},
                         timeout=60, check=True).stdout
    # split(": ", 1) of a line holding ": " is a pair: mypy sees a list
    return dict(line.split(": ", 1) if ": " in line else (line.rstrip(":"), "")  # type: ignore[misc]
                for line in out.splitlines())


def test_make_runs_plan_on_a_bare_machine_is_the_daemons_needs() -> None:
    run = _plan("run")
    assert set(run["debian"].split()) == {"python3", "python3-venv", "postgresql",
                                          "postgresql-contrib"}
    assert run["pip"] == ".[emulator]" and run["localstack"] == "no"
    everything = _plan()  # the plan sees a bare machine: make test's set is all there
    assert TEST_ONLY_DEBIAN <= set(everything["debian"].split())
    assert everything["pip"] == ".[dev,reconcile,emulator]" and everything["localstack"] == "yes"


def test_make_run_goes_through_the_run_profile_only() -> None:
    """`make run`'s prerequisites reach `scripts/install.sh run`, never `make install`."""
    dry = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    installs = re.findall(r"scripts/install\.sh[^;&\n]*", dry)
    assert installs and all(i.split()[1:2] == ["run"] for i in installs), installs
    assert "localstack-venv" not in dry


@pytest.mark.timeout(1200)
def test_make_run_from_a_fresh_clone_completes_a_message(tmp_path: Path) -> None:
    """The real thing: git clone, `make run` (scripts/first-run.sh), a completed message on
    /metrics; then the clone's venv holds the daemon and the emulator, none of make test's."""
    # Uncommitted changes to tracked files are tested too: a stash commit of the work tree.
    ref = subprocess.run(["git", "stash", "create"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    env = {**os.environ, "FIRST_RUN_KEEP": str(tmp_path), "FIRST_RUN_REF": ref}
    try:
        out = subprocess.run(["scripts/first-run.sh", str(ROOT)], cwd=ROOT, capture_output=True,
                             text=True, env=env, timeout=1100, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        assert re.search(r"first completed message after \d+\.\d s", out.stdout), out.stdout
        clone = tmp_path / "sqs-ingest"
        py = clone / ".venv" / "bin" / "python"
        assert (clone / ".venv" / "bin" / "sqs-ingest").exists()
        assert (clone / ".venv" / "bin" / "moto_server").exists()
        assert not (clone / ".venv-localstack").exists()
        probe = ("import importlib.util as u, sys; "
                 "print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))")
        present = subprocess.run([str(py), "-c", probe, *TEST_ONLY_MODULES],
                                 capture_output=True, text=True, timeout=60, check=True)
        assert present.stdout.split() == [], f"make test's packages in make run's venv: {present.stdout}"
    finally:
        shutil.rmtree(tmp_path / "sqs-ingest", ignore_errors=True)

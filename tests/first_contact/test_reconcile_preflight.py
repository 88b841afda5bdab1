"""``sqs-ingest reconcile`` on a machine without Java or the PostgreSQL JDBC driver: one line
with the fix and exit 2, before Spark starts (which would fail with ``o46.load``)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from service.reconcile import preflight

ROOT = Path(__file__).resolve().parents[2]


def reconcile(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service", "reconcile", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_no_java_on_the_machine(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # nothing there: no java
    proc = reconcile(["--date", "2024-05-01", "--database-url", "postgresql://u@h/d"], env)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Java 17" in lines[0] and "apt-get install openjdk-17-jre-headless" in lines[0]


def test_jars_that_do_not_exist() -> None:
    proc = reconcile(["--date", "2024-05-01", "--jars", "/nonexistent/postgresql.jar",
                      "--database-url", "postgresql://u@h/d"], dict(os.environ))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "sqs-ingest reconcile: --jars: /nonexistent/postgresql.jar does not exist")


def test_missing_jdbc_driver_names_the_package_and_jars(tmp_path: Path) -> None:
    java = tmp_path / "java"
    java.write_text('#!/bin/sh\necho \'openjdk version "17.0.13" 2024-10-15\' >&2\n')
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    [line] = preflight.problems(None, find_java=lambda: str(java),
                                default_jar=str(tmp_path / "postgresql.jar"))
    assert "libpostgresql-jdbc-java" in line and "--jars" in line


def test_java_too_old(tmp_path: Path) -> None:
    java = tmp_path / "java"
    java.write_text('#!/bin/sh\necho \'openjdk version "11.0.22" 2024-01-16\' >&2\n')
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    jar = tmp_path / "postgresql.jar"
    jar.touch()
    [line] = preflight.problems(None, find_java=lambda: str(java), default_jar=str(jar))
    assert "is Java 11" in line and "openjdk-17-jre-headless" in line
    assert preflight.java_major(str(java)) == 11

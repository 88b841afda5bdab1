"""What ``sqs-ingest reconcile`` needs on the machine before Spark starts, checked up front.

Without them Spark fails far from the cause: no Java ends in ``Java gateway process exited
before sending its port number``, no PostgreSQL JDBC driver in ``An error occurred while
calling o46.load``. Each check here answers with one line naming the fix instead.
Skipped under ``spark-submit`` (the JVM is already up and brings its own ``--jars``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

from service.reconcile.session import DEFAULT_JDBC_JAR

MIN_JAVA = 17


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        return candidate if os.access(candidate, os.X_OK) else None
    return shutil.which("java")


def java_major(java: str) -> int | None:
    """The major version ``java -version`` reports (8 for "1.8.0_392"), None if unreadable."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if m is None:
        return None
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def problems(
    jars: str | None,
    *,
    find_java: Callable[[], str | None] = _java,
    default_jar: str = DEFAULT_JDBC_JAR,
) -> list[str]:
    """One line per missing prerequisite (empty when Spark can start and read PostgreSQL)."""
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # under spark-submit: its JVM, its jars
        return []
    out = []
    if importlib.util.find_spec("pyspark") is None:
        out.append("reconcile needs PySpark: pip install 'sqs-ingest[reconcile]'")
    java = find_java()
    if java is None:
        out.append(
            f"reconcile runs Spark, which needs Java {MIN_JAVA}+ and none was found "
            "(JAVA_HOME, PATH): apt-get install openjdk-17-jre-headless, or set JAVA_HOME"
        )
    else:
        major = java_major(java)
        if major is not None and major < MIN_JAVA:
            out.append(
                f"reconcile runs Spark, which needs Java {MIN_JAVA}+; {java} is Java {major}: "
                "apt-get install openjdk-17-jre-headless, or point JAVA_HOME at a newer one"
            )
    if jars is None:
        if not os.path.exists(default_jar):
            out.append(
                f"reconcile reads PostgreSQL over JDBC and the driver is missing ({default_jar}):"
                " apt-get install libpostgresql-jdbc-java, or pass --jars /path/postgresql.jar"
            )
    else:
        for jar in (j.strip() for j in jars.split(",")):
            if jar and "://" not in jar and not os.path.exists(jar.removeprefix("file:")):
                out.append(f"--jars: {jar} does not exist")
    return out


def ok(jars: str | None) -> bool:
    """Print each problem as one line on stderr; True when there is none."""
    found = problems(jars)
    for line in found:
        print(f"sqs-ingest reconcile: {line}", file=sys.stderr, flush=True)
    return not found

"""The two wheels of one tree (hatch_build.py): the default one — `pip install
'sqs-ingest[testing]'` for handler authors — carries the test kit (service/testing) and its
pytest plugin's entry point; the runtime image's (SQS_INGEST_WHEEL=runtime, the Dockerfile)
carries neither, and is otherwise the same. Built as the Dockerfile builds it: the locked
backend, no build isolation."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = sorted(f"service/testing/{p.name}" for p in (ROOT / "service/testing").glob("*.py"))


def build(tmp_path: Path, flavour: str) -> tuple[list[str], str]:
    env = {**os.environ, "SQS_INGEST_WHEEL": flavour}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(tmp_path), str(ROOT)],
                   env=env, check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("sqs_ingest-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("/entry_points.txt")))
    return names, entry_points.decode()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[str], str]]:
    return {f: build(tmp_path_factory.mktemp(f or "default"), f) for f in ("", "runtime")}


def test_the_default_wheel_carries_the_kit_and_its_plugin(wheels) -> None:
    names, entry_points = wheels[""]
    assert sorted(n for n in names if n.startswith("service/testing/")) == KIT
    assert "service/testing/kit.py" in KIT
    assert "[pytest11]\nsqs_ingest = service.testing.pytest_plugin" in entry_points


def test_the_runtime_wheel_carries_neither(wheels) -> None:
    names, entry_points = wheels["runtime"]
    assert [n for n in names if "testing" in n] == []
    assert "pytest11" not in entry_points
    assert "sqs-ingest = service.cli:main" in entry_points
    default = {n for n in wheels[""][0] if ".dist-info/" not in n}
    assert {n for n in names if ".dist-info/" not in n} == default - set(KIT)

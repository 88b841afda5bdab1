"""ruff, mypy (strict on service/) and the import layers (import-linter) are part of the
suite, so they stay clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent


def test_ruff() -> None:
    proc = subprocess.run([str(BIN / "ruff"), "check", "service", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_service() -> None:
    proc = subprocess.run([str(BIN / "mypy")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_layers() -> None:
    """The import-linter contracts of pyproject.toml: service/'s layers import only
    downwards (function-level and TYPE_CHECKING imports counted), no cycle anywhere."""
    proc = subprocess.run([str(BIN / "lint-imports"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""ruff, mypy (strict on service/; tests/ and examples/ checked too, not strictly) and the
import layers (import-linter) are part of the suite, so they stay clean; so does the size
of service/'s functions and classes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent


def test_ruff() -> None:
    proc = subprocess.run([str(BIN / "ruff"), "check", "service", "tests", "examples"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_service_and_checked_on_tests() -> None:
    """pyproject.toml [tool.mypy]: service/ strict; tests/ and examples/ not strict, with
    every `type: ignore` there needed (warn_unused_ignores)."""
    proc = subprocess.run([str(BIN / "mypy")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_layers() -> None:
    """The import-linter contracts of pyproject.toml: service/'s layers import only
    downwards (function-level and TYPE_CHECKING imports counted), no cycle anywhere."""
    proc = subprocess.run([str(BIN / "lint-imports"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


MAX_FUNCTION_LINES = 50
MAX_CLASS_METHODS = 15


def size_offenders(root: Path) -> dict[str, str]:
    """{"path kind name": "path:line kind name: size"} for every function longer than
    MAX_FUNCTION_LINES lines (def to last line; nested functions are counted on their own
    too) and every class with more than MAX_CLASS_METHODS methods defined in its body, in
    the .py files under root."""
    offenders = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            rel = path.relative_to(root.parent)
            where = f"{rel}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    key = f"{rel} function {node.name}"
                    offenders[key] = f"{where} function {node.name}: {lines} lines"
            elif isinstance(node, ast.ClassDef):
                methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                              for b in node.body)
                if methods > MAX_CLASS_METHODS:
                    key = f"{rel} class {node.name}"
                    offenders[key] = f"{where} class {node.name}: {methods} methods"
    return offenders


def test_functions_and_classes_stay_small() -> None:
    """Issue 23: every function in service/ at most 50 lines, every class at most 15
    methods; the message names each offender."""
    offenders = size_offenders(ROOT / "service")
    assert not offenders, "\n".join(offenders.values())


def test_array_parameters_are_text_arrays() -> None:
    """Every array parameter of service/'s statements is declared text[] (and cast to the
    type meant, as ``$6::text[]::timestamptz[]``): asyncpg encodes text[] by itself, but
    looks any other array type up in the catalog the first time each connection uses it —
    3 or 4 round trips per type on every new connection (tests/integration/
    test_round_trips.py counts them)."""
    import re

    typed = re.compile(r"\$\d+::(\w+)\s*\[\]")
    bare = re.compile(r"ANY\s*\(\s*\$\d+\s*\)", re.IGNORECASE)
    found = []
    for path in sorted((ROOT / "service").rglob("*")):
        if path.suffix not in (".py", ".sql"):
            continue
        text = path.read_text()
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in typed.finditer(text)
                  if m.group(1) != "text"]
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in bare.finditer(text)]
    assert not found, found

"""Rewrites the old flat import paths of service/ to the layout by role (service.core,
service.runtime, service.adapters, service.observe, service.ops, service.testing).

    python scripts/relayout_imports.py [ROOT]      # then: ruff check --fix --select I .

After merging a branch written against the flat layout: resolve each conflicting import
block with that branch's (flat) lines, run this, then ``ruff check --fix --select I``.

What it rewrites, in the .py, .toml, .md, .sh, .yaml/.yml, .cfg, .ini, .sql (not
migrations/: applied ones are checksummed), Makefile and Dockerfile files git knows of
(tracked or untracked, not ignored):

- dotted names, in code and in strings (monkeypatch and mock targets, ``python -m``,
  entry points, import-linter contracts): ``service.store`` -> ``service.adapters.store``,
  ``service.sql.queries`` -> ``service.adapters.sql.queries``, ``import service.x as y``;
- ``from service import metrics, store`` (one line or parenthesised over several) -> one
  ``from service.<subpackage> import ...`` per new home, names left at the top kept;
- file paths: ``service/store.py`` -> ``service/adapters/store.py``,
  ``service/sql/queries.sql`` -> ``service/adapters/sql/queries.sql``.

A move applies only once it has happened in ROOT (the old module is gone, the new one is
there), so it can run after each ``git mv`` of a series. It is idempotent: on a tree already
rewritten it changes nothing (no new name starts with an old one). The import order it
leaves may need ``ruff --fix --select I``; a comment inside a parenthesised name list that it
splits is dropped, and a rewritten line may need wrapping at 100 columns (ruff E501).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# old dotted name (under service.) -> new dotted name (under service.)
MOVES: dict[str, str] = {
    # core: pure values and policy
    "attributes": "core.attributes",
    "budget": "core.budget",
    "claims": "core.claims",
    "labels": "core.labels",
    "limits": "core.limits",
    "messages": "core.messages",
    "plan": "core.plan",
    "pointers": "core.pointers",
    "retention": "core.retention",
    "retry": "core.retry",
    "seams": "core.seams",
    "handlers.registry": "core.registry",
    # observe
    "metrics": "observe.metrics",
    "logs": "observe.logs",
    "tracing": "observe.tracing",
    # adapters
    "sqs": "adapters.sqs",
    "store": "adapters.store",
    "completion": "adapters.completion",
    "pgerrors": "adapters.pgerrors",
    "sql": "adapters.sql",
    "migrate": "adapters.migrate",
    "payloads": "adapters.payloads",
    "sinks": "adapters.sinks",
    "prune": "adapters.prune",
    "useragent": "adapters.useragent",
    "identity": "adapters.identity",
    # runtime
    "worker": "runtime.worker",
    "batch": "runtime.batch",
    "bisection": "runtime.bisection",
    "visibility": "runtime.visibility",
    "executor": "runtime.executor",
    "maintenance": "runtime.maintenance",
    "dbhealth": "runtime.dbhealth",
    "resolve": "runtime.resolve",
    "results": "runtime.results",
    "coalesce": "adapters.coalesce",
    # ops: the operator commands
    "diagnose": "ops.diagnose",
    "produce": "ops.produce",
    "prune_command": "ops.prune_command",
    "redrive": "ops.redrive",
    "schema": "ops.schema",
    "dlq": "ops.dlq",
    "grants": "ops.grants",
    # testing: service.testing stays the name of the fakes' public surface (the package
    # re-exports them), so only its file moves
    "kit": "testing.kit",
    "pytest_plugin": "testing.pytest_plugin",
}
# old file -> new file, where the dotted name does not change
PATH_ONLY: dict[str, str] = {"testing.py": "testing/fakes.py"}

SUFFIXES = {".py", ".toml", ".md", ".sh", ".yaml", ".yml", ".cfg", ".ini", ".sql"}
NAMES = {"Makefile", "Dockerfile"}
# This file and its test name every old path on purpose; the mutation gate's tests use
# made-up names.
EXCLUDE = {"scripts/relayout_imports.py", "tests/unit/test_relayout_imports.py",
           "tests/unit/test_mutation_gate.py"}


def _old_path(root: Path, dotted: str) -> tuple[Path, Path]:
    rel = dotted.replace(".", "/")
    return root / "service" / f"{rel}.py", root / "service" / rel / "__init__.py"


def moved(root: Path) -> dict[str, str]:
    """The MOVES that have happened in root: old module absent, new one present."""
    done = {}
    for old, new in MOVES.items():
        if not any(p.exists() for p in _old_path(root, old)) and \
                any(p.exists() for p in _old_path(root, new)):
            done[old] = new
    return done


def _alternation(names: list[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


def rewrite_from_imports(text: str, moves: dict[str, str]) -> str:
    """``from service[.pkg] import a, b as c`` -> one import per new home of its names."""
    pattern = re.compile(
        r"^(?P<indent>[ \t]*)from (?P<pkg>service(?:\.\w+)*) import "
        r"(?:\((?P<paren>[^)]*)\)|(?P<line>[^\n(]*?))(?P<comment>[ \t]*#[^\n]*)?$",
        re.MULTILINE)

    def one(m: re.Match[str]) -> str:
        pkg = m["pkg"][len("service"):].lstrip(".")
        body = m["paren"] if m["paren"] is not None else m["line"]
        body = re.sub(r"#[^\n]*", "", body)
        names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
        groups: dict[str, list[str]] = {}
        changed = False
        for name in names:
            base = name.split()[0]
            key = f"{pkg}.{base}" if pkg else base
            if key in moves:
                new = moves[key]
                home = "service." + new.rsplit(".", 1)[0]
                if new.rsplit(".", 1)[1] != base:  # renamed module: keep the old local name
                    name = f"{new.rsplit('.', 1)[1]} as {name.split()[-1]}"
                groups.setdefault(home, []).append(name)
                changed = True
            else:
                groups.setdefault(m["pkg"], []).append(name)
        if not changed:
            return m[0]
        indent, comment = m["indent"], m["comment"] or ""
        lines = []
        for home in sorted(groups):
            head = f"{indent}from {home} import "
            flat = head + ", ".join(groups[home])
            if len(flat) <= 100:
                lines.append(flat)
            else:
                inner = "".join(f"{indent}    {n},\n" for n in groups[home])
                lines.append(f"{head}(\n{inner}{indent})")
        lines[0] += comment
        return "\n".join(lines)

    return pattern.sub(one, text)


def rewrite_dotted(text: str, moves: dict[str, str]) -> str:
    if not moves:
        return text
    pattern = re.compile(r"(?<![\w.])service\.(" + _alternation(list(moves)) + r")(?!\w)")
    return pattern.sub(lambda m: "service." + moves[m[1]], text)


def rewrite_paths(text: str, moves: dict[str, str], root: Path) -> str:
    files: dict[str, str] = {}
    for old, new in moves.items():
        o, n = old.replace(".", "/"), new.replace(".", "/")
        if (root / "service" / n).is_dir():
            files[o] = n  # a package: service/dlq/... -> service/ops/dlq/...
        else:
            files[o + ".py"] = n + ".py"
    for old, new in PATH_ONLY.items():
        if not (root / "service" / old).exists() and (root / "service" / new).exists():
            files[old] = new
    if not files:
        return text
    pattern = re.compile(r"(?<![\w.-])service/(" + _alternation(list(files)) + r")(?![\w])")
    return pattern.sub(lambda m: "service/" + files[m[1]], text)


def rewrite(text: str, moves: dict[str, str], root: Path) -> str:
    text = rewrite_from_imports(text, moves)
    text = rewrite_dotted(text, moves)
    return rewrite_paths(text, moves, root)


def candidates(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    paths = []
    for rel in out.splitlines():
        p = root / rel
        # migrations/ are checksummed once applied: not a byte of them changes
        if rel in EXCLUDE or rel.startswith("migrations/") or not p.is_file():
            continue
        if p.suffix in SUFFIXES or p.name in NAMES:
            paths.append(p)
    return paths


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else ".").resolve()
    moves = moved(root)
    changed = 0
    for path in candidates(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite(text, moves, root)
        if new != text:
            path.write_text(new)
            changed += 1
            print(path.relative_to(root))
    print(f"{changed} files rewritten ({len(moves)} moves applied)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

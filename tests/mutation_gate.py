"""The mutation gate: reads mutmut's results (``mutants/**/*.meta``), prints them per
module and function, and fails under the threshold.

    python -m tests.mutation_gate [--threshold 90] [--only GLOB ...] [--markdown]
    python -m tests.mutation_gate changed BASE   # mutant globs of the functions changed
                                                 # since git ref BASE (make mutation-diff)
    python -m tests.mutation_gate survivors      # names of the survived / untested mutants

Score = (killed + timeout) / (killed + timeout + survived + no tests): a mutant no test
reaches counts against the score. A mutant not checked yet, or one whose run broke
(suspicious, segfault, skipped), fails the gate: the result would be partial.
Exit 0: at or above the threshold; 1: under it or incomplete; 2: no results."""

from __future__ import annotations

import argparse
import ast
import collections
import fnmatch
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

KILLED = {1, 3}
TIMEOUT = {36, 24, -24, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}
SEP = "ǁ"  # mutmut's class separator in mangled names


def status(code: int | None) -> str:
    if code in KILLED:
        return "killed"
    if code in TIMEOUT:
        return "timeout"
    if code in SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    if code is None:
        return "not checked"
    return "broken"  # suspicious, segfault, skipped, interrupted: the run is not a result


def load(root: Path) -> dict[str, int | None]:
    """mutant name → mutmut's exit code, from every .meta under ``root``."""
    out: dict[str, int | None] = {}
    for meta in sorted(root.rglob("*.meta")):
        out.update(json.loads(meta.read_text())["exit_code_by_key"])
    return out


def function_of(mutant: str) -> tuple[str, str]:
    """('service.adapters.store', 'Store.apply') of 'service.adapters.store.xǁStoreǁapply__mutmut_3'."""
    mangled = mutant.partition("__mutmut_")[0]
    module, _, name = mangled.rpartition(".")
    if name.startswith("x" + SEP):
        _, cls, fn = name.split(SEP)
        return module, f"{cls}.{fn}"
    return module, name.removeprefix("x_")


Row = collections.Counter[str]


def tally(results: dict[str, int | None]) -> dict[tuple[str, str], Row]:
    rows: dict[tuple[str, str], Row] = collections.defaultdict(collections.Counter)
    for name, code in results.items():
        rows[function_of(name)][status(code)] += 1
    return dict(rows)


def score(c: Row) -> float | None:
    checked = c["killed"] + c["timeout"] + c["survived"] + c["no tests"]
    return None if checked == 0 else 100.0 * (c["killed"] + c["timeout"]) / checked


COLUMNS = ("killed", "timeout", "survived", "no tests", "not checked", "broken")


def render(rows: dict[tuple[str, str], Row], markdown: bool) -> str:
    def line(label: str, c: Row) -> str:
        s = score(c)
        cells = [label, str(sum(c.values())), *(str(c[k]) for k in COLUMNS),
                 "—" if s is None else f"{s:.1f} %"]
        return ("| " + " | ".join(cells) + " |") if markdown else "  ".join(cells)

    out = []
    if markdown:
        out += ["| function | mutants | " + " | ".join(COLUMNS) + " | score |",
                "| --- " * (len(COLUMNS) + 3) + "|"]
    by_module: dict[str, Row] = collections.defaultdict(collections.Counter)
    for (module, fn), c in sorted(rows.items()):
        by_module[module].update(c)
        out.append(line(f"`{module}.{fn}`" if markdown else f"{module}.{fn}", c))
    for module, c in sorted(by_module.items()):
        out.append(line(f"**{module} (module)**" if markdown else f"{module} (module)", c))
    total: Row = collections.Counter()
    for c in by_module.values():
        total.update(c)
    out.append(line("**all**" if markdown else "all", total))
    return "\n".join(out)


def gate(results: dict[str, int | None], threshold: float) -> tuple[int, str]:
    if not results:
        return 2, "no mutmut results (run mutmut first)"
    total: Row = collections.Counter(status(c) for c in results.values())
    s = score(total)
    if total["not checked"] or total["broken"]:
        return 1, (f"incomplete: {total['not checked']} not checked, {total['broken']} "
                   f"broken of {len(results)} mutants (a partial run is not a score)")
    if s is None or s < threshold:
        return 1, f"mutation score {s if s is None else round(s, 1)} % < {threshold} %"
    return 0, f"mutation score {s:.1f} % >= {threshold} % ({len(results)} mutants)"


# -- make mutation-diff: the functions changed since a ref ------------------------------


def mutated_modules(pyproject: Path = Path("pyproject.toml")) -> list[str]:
    return list(tomllib.loads(pyproject.read_text())["tool"]["mutmut"]["only_mutate"])


def changed_lines(base: str, path: str) -> set[int]:
    """The lines of ``path`` changed since ``base``. A file moved since then (``git mv``) is
    compared with its old path, so a move alone changes no line."""
    whole = subprocess.run(["git", "diff", "-U0", "-M", base], capture_output=True,
                           text=True, check=True).stdout
    mine = re.compile(rf"^(\+\+\+ b/|rename to ){re.escape(path)}$", re.MULTILINE)
    diff = "".join(part for part in re.split(r"^(?=diff --git )", whole, flags=re.MULTILINE)
                   if mine.search(part))
    lines: set[int] = set()
    for m in re.finditer(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", diff, re.MULTILINE):
        start, count = int(m.group(1)), int(m.group(2) or 1)
        # A pure deletion (count 0) touches the function around the line it left.
        lines.update(range(start, start + max(count, 1)))
    return lines


def functions_touching(source: str, lines: set[int]) -> list[str]:
    """Mangled names (mutmut's) of the top-level functions and methods of top-level classes
    that any of ``lines`` falls in (decorators included)."""
    names = []
    for node in ast.parse(source).body:
        targets = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            targets.append((node, f"x_{node.name}"))
        elif isinstance(node, ast.ClassDef):
            targets += [(f, f"x{SEP}{node.name}{SEP}{f.name}") for f in node.body
                        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
        for f, mangled in targets:
            first = min([f.lineno, *(d.lineno for d in f.decorator_list)])
            if lines & set(range(first, (f.end_lineno or f.lineno) + 1)):
                names.append(mangled)
    return names


def changed_globs(base: str) -> list[str]:
    globs = []
    for path in mutated_modules():
        if not Path(path).exists():
            continue
        lines = changed_lines(base, path)
        if lines:
            module = path.removesuffix(".py").replace("/", ".")
            globs += [f"{module}.{n}__mutmut_*" for n in
                      functions_touching(Path(path).read_text(), lines)]
    return globs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["changed"]:
        print("\n".join(changed_globs(argv[1])))
        return 0
    if argv[:1] == ["survivors"]:  # make mutation RESUME=1 RECHECK=1: re-run these by name
        root = Path(argv[1]) if len(argv) > 1 else Path("mutants")
        print("\n".join(k for k, v in sorted(load(root).items())
                        if status(v) in ("survived", "no tests")))
        return 0
    ap = argparse.ArgumentParser(prog="python -m tests.mutation_gate")
    ap.add_argument("--threshold", type=float, default=90.0)
    ap.add_argument("--only", nargs="*", default=None, help="mutant name globs")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--root", type=Path, default=Path("mutants"))
    a = ap.parse_args(argv)
    results = load(a.root)
    if a.only is not None and results:
        results = {k: v for k, v in results.items()
                   if any(fnmatch.fnmatchcase(k, g) for g in a.only)}
        if not results:
            print("no mutants in the selected functions")
            return 0
    if results:
        print(render(tally(results), a.markdown))
    code, verdict = gate(results, a.threshold)
    print(verdict)
    return code


if __name__ == "__main__":
    raise SystemExit(main())

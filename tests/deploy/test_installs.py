"""Every install step fetches only what the lock names, by hash (issue 42): in the
Dockerfile, the handler image recipe (examples/invoices/Dockerfile), .ci/run and scripts/,
each `pip install` / `uv pip install` installs a locked set with --require-hashes, or the
project itself with --no-deps and (when it builds it) --no-build-isolation, so the build
backend comes from the locked environment (requirements/build.txt) instead of a fresh,
unhashed download; `pip wheel` likewise."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"


def _files() -> list[Path]:
    scripts = [p for p in (ROOT / "scripts").rglob("*") if p.is_file()
               and p.suffix in ("", ".sh")]
    return [ROOT / "Dockerfile", ROOT / ".ci/run", *sorted(scripts),
            ROOT / "examples/invoices/Dockerfile"]


def _commands(path: Path) -> list[list[str]]:
    """Each simple command of the file that runs pip/uv install or pip wheel, as words."""
    text = re.sub(r"\\\n", " ", path.read_text())  # fold line continuations
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0]
        if line.lstrip().startswith("#"):
            continue
        for cmd in re.split(r"&&|\|\||;|\|(?!\|)|\bthen\b|\belse\b|\bif\b", line):
            if re.search(r"\bpip\b.*\b(install|wheel)\b", cmd) and "uninstall" not in cmd:
                try:
                    words = shlex.split(cmd)
                except ValueError:
                    words = cmd.split()
                out.append(words)
    return out


VALUE_OPTIONS = {"--python", "-w", "--wheel-dir", "-d", "--dest", "-c", "--constraint", "-t",
                 "--target", "--prefix", "--root"}


def _problem(words: list[str]) -> str | None:
    at = next(i for i, w in enumerate(words) if w == "pip" or w.endswith("/pip"))
    args = words[at + 1:]
    verb = args[0] if args else ""
    if verb not in ("install", "wheel"):
        return None
    options = {w.split("=", 1)[0] for w in args if w.startswith("-")}
    if "-r" in options or "--requirement" in options:
        return None if "--require-hashes" in options else "a lock without --require-hashes"
    targets, skip = [], False
    for w in args[1:]:
        if skip:
            skip = False
        elif w in VALUE_OPTIONS:
            skip = True  # its value is no install target
        elif not w.startswith("-"):
            targets.append(w)
    ours = all(t in (".", "-e") or t.endswith(".whl") for t in targets) and targets
    if not ours and "-e" not in args:
        return f"named packages, no lock, no hashes: {targets}"
    if "--no-deps" not in options:
        return "the project without --no-deps"
    builds = verb == "wheel" or "." in targets or "-e" in args
    if builds and "--no-build-isolation" not in options:
        return "builds the project in an isolated environment (an unhashed backend)"
    return None


CASES = [_p for _p in _files() if _commands(_p)]


@pytest.mark.parametrize("path", CASES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_install_step_is_locked_and_hashed(path: Path) -> None:
    problems = [(" ".join(w), why) for w in _commands(path) if (why := _problem(w))]
    assert not problems, problems


def test_the_checker_catches_what_it_must() -> None:
    bad = ["pip install uv==0.13.9", "pip install -r requirements/x.txt",
           "pip wheel --no-deps --wheel-dir /dist .", "pip install --no-deps -e .",
           "uv pip install -q --python .venv/bin/python -e .", "pip install hatchling"]
    good = ["pip install -q --require-hashes -r requirements/dev.txt",
            "pip wheel --no-deps --no-build-isolation --wheel-dir /dist .",
            "pip install --no-deps /dist/*.whl",
            "uv pip install -q --python .venv/bin/python --no-deps --no-build-isolation -e ."]
    assert all(_problem(shlex.split(c)) for c in bad)
    assert not any(_problem(shlex.split(c)) for c in good)


def _pins(path: Path) -> dict[str, str]:
    text = path.read_text()
    out = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", text):
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", block)
        if m:
            assert "--hash=sha256:" in block, (path.name, m.group(1))
            out[m.group(1).lower()] = m.group(2)
    return out


def test_build_backend_and_uv_are_pinned_with_hashes() -> None:
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    (req,) = build["requires"]
    name, _, version = req.partition("==")
    assert name == "hatchling" and version, "pin the build backend in pyproject.toml"
    assert _pins(REQ / "build.txt").get("hatchling") == version
    uv = _pins(REQ / "uv.txt")
    assert set(uv) == {"uv"}
    lock = (ROOT / "scripts/lock.sh").read_text()
    assert re.search(r"^compile_in build\b", lock, re.M) and re.search(r"^compile_in uv\b", lock, re.M)
    assert "--require-hashes -r requirements/uv.txt" in lock  # its own uv, by hash

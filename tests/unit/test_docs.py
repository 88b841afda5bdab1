"""The documentation: reference pages generated from the code stay in step with it, the site
builds in strict mode, and README and site pages say what the software is, not how it was
made (no commit ids, stop numbers or run dates outside the benchmark and mutation tables)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts/docs_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", sorted(_generator().PAGES))
def test_reference_page_matches_the_code(page: str) -> None:
    gen = _generator()
    text = gen.PAGES[page]()
    committed = (gen.OUT / page).read_text(encoding="utf-8")
    assert committed == text, f"docs/reference/{page} is stale: run `make docs` and commit it"


def test_every_setting_metric_flag_code_and_reason_is_in_the_reference() -> None:
    from service.core import labels
    from service.settings import Settings

    gen = _generator()
    settings = (gen.OUT / "settings.md").read_text()
    for name in Settings.model_fields:
        assert f"`INGEST_{name.upper()}`" in settings, name
    reasons = (gen.OUT / "dead-letter-reasons.md").read_text()
    for reason in labels.DEAD_LETTER_REASONS:
        assert f"| `{reason}` |" in reasons, reason
    codes = (gen.OUT / "exit-codes.md").read_text()
    for (name, value) in gen.exit_codes():
        assert f"| `{value}` | `{name}`" in codes, name
    cli = (gen.OUT / "cli.md").read_text()
    for _, parser in gen._parsers():
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in cli, option


def test_a_setting_without_a_description_fails_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes the reference fail when a setting is added without its entry."""
    from service.settings import Settings

    gen = _generator()
    doc = (Settings.__doc__ or "").replace("        pollers: concurrent long-poll loops.\n", "")
    monkeypatch.setattr(Settings, "__doc__", doc)
    with pytest.raises(SystemExit, match="pollers"):
        gen.settings_page()


def test_an_exit_code_without_a_meaning_fails_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _generator()
    monkeypatch.setattr(gen, "exit_codes", lambda: {("EXIT_NEW", 9): ["service.x"]})
    with pytest.raises(SystemExit, match="EXIT_NEW"):
        gen.exit_codes_page()


HISTORY = re.compile(
    r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"  # a commit id
    r"|\b[Ss]top \d+\b"                                          # a session's number
    r"|\b20\d\d-\d\d-\d\d\b"                                     # a run date
)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _without_measured_at(path: Path) -> list[tuple[int, str]]:
    """The page's lines, with the "measured at" column of its tables cut out: only the
    benchmark and mutation tables may name the commit and date a figure was measured at."""
    out, column = [], None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        cells = line.split("|")
        if not line.startswith("|"):
            column = None
        elif column is None:
            found = [i for i, c in enumerate(cells) if c.strip() == "measured at"]
            column = found[0] if found and path.name in ("benchmarks.md", "mutation.md") else -1
        elif column > 0:
            line = "|".join(c for i, c in enumerate(cells) if i != column)
        out.append((n, line))
    return out


@pytest.mark.parametrize("path", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_carry_no_history(path: Path) -> None:
    bad = []
    for n, line in _without_measured_at(path):
        m = HISTORY.search(line)
        if m:
            bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not bad, "history belongs in commits and notes, not in the docs:\n" + "\n".join(bad)


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_site_builds_strict(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is in the dev extra (requirements/dev.txt)"
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    for section in ("getting-started", "concepts", "handlers", "operations", "reference"):
        assert (tmp_path / "site" / section).is_dir(), section

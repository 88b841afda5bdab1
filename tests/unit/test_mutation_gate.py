"""The mutation gate (tests/mutation_gate.py): the score it computes from mutmut's results,
the exit codes make mutation relies on, and the functions make mutation-diff picks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests import mutation_gate as g

S = "service.store.xǁStoreǁapply__mutmut_"
P = "service.plan.x_classify__mutmut_"


def write(root: Path, codes: dict[str, int | None]) -> Path:
    (root / "service").mkdir(parents=True)
    (root / "service" / "store.py.meta").write_text(json.dumps({
        "exit_code_by_key": codes, "durations_by_key": {}, "estimated_durations_by_key": {}}))
    return root


def test_names_are_read_back_to_module_and_function() -> None:
    assert g.function_of(S + "12") == ("service.store", "Store.apply")
    assert g.function_of(P + "3") == ("service.plan", "classify")


def test_score_counts_timeouts_as_killed_and_untested_against() -> None:
    c = g.tally({S + "1": 1, S + "2": 36, S + "3": 0, S + "4": 33})[("service.store", "Store.apply")]
    assert (c["killed"], c["timeout"], c["survived"], c["no tests"]) == (1, 1, 1, 1)
    assert g.score(c) == 50.0


@pytest.mark.parametrize(("codes", "threshold", "exit"), [
    ({S + "1": 1, S + "2": 1, S + "3": 1, S + "4": 1, S + "5": 1,
      S + "6": 1, S + "7": 1, S + "8": 1, S + "9": 1, S + "10": 0}, 90, 0),   # 90.0 %: at
    ({S + "1": 1, S + "2": 1, S + "3": 1, S + "4": 1, S + "5": 1,
      S + "6": 1, S + "7": 1, S + "8": 1, S + "9": 0, S + "10": 0}, 90, 1),   # 80 %: under
    ({S + "1": 1, S + "2": None}, 50, 1),     # one not checked: partial, never a pass
    ({S + "1": 1, S + "2": -11}, 50, 1),      # a segfaulted run is no result
    ({S + "1": 1, S + "2": 5}, 60, 1),        # "no tests" counts against the score
])
def test_the_gate_exit_code(tmp_path: Path, codes: dict[str, int | None], threshold: float,
                            exit: int) -> None:
    root = write(tmp_path / "mutants", codes)
    assert g.main(["--threshold", str(threshold), "--root", str(root)]) == exit


def test_no_results_is_an_error_and_only_filters(tmp_path: Path) -> None:
    assert g.main(["--root", str(tmp_path / "none")]) == 2
    root = write(tmp_path / "mutants", {S + "1": 0, P + "1": 1})
    assert g.main(["--root", str(root), "--only", "service.plan.x_classify__mutmut_*"]) == 0
    assert g.main(["--root", str(root), "--only", "service.store.*"]) == 1


def test_survivors_are_the_survived_and_untested_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What ``make mutation RESUME=1 RECHECK=1`` hands mutmut to check again."""
    root = write(tmp_path / "mutants", {S + "1": 1, S + "2": 0, S + "3": 36, S + "4": 33,
                                        S + "5": None, S + "6": 5})
    assert g.main(["survivors", str(root)]) == 0
    assert capsys.readouterr().out.split() == [S + "2", S + "4", S + "6"]


def test_changed_functions_are_the_ones_whose_lines_changed() -> None:
    source = '''
import x

@decorated
def top(a):
    return a

class Store:
    def apply(self):
        return 1

    async def claim(self):
        return 2
'''
    assert g.functions_touching(source, {4}) == ["x_top"]          # its decorator
    assert g.functions_touching(source, {10}) == ["xǁStoreǁapply"]
    assert g.functions_touching(source, {13, 2}) == ["xǁStoreǁclaim"]
    assert g.functions_touching(source, {2}) == []


def test_changed_lines_of_a_real_diff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    f = tmp_path / "m.py"
    f.write_text("a = 1\nb = 2\nc = 3\n")
    git("add", "m.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    f.write_text("a = 1\nb = 20\nc = 3\nd = 4\n")
    monkeypatch.chdir(tmp_path)
    assert g.changed_lines("HEAD", "m.py") == {2, 4}


def test_changed_lines_of_a_moved_file_are_its_edits_not_the_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`git mv` then an edit: only the edited line counts (the file is compared with its old
    path), so mutation-diff across the layout's moves mutates what changed, not every function."""
    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    f = tmp_path / "m.py"
    f.write_text("".join(f"v{i} = {i}\n" for i in range(10)))
    git("add", "m.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    (tmp_path / "pkg").mkdir()
    git("mv", "m.py", "pkg/m.py")
    moved = tmp_path / "pkg" / "m.py"
    moved.write_text(moved.read_text().replace("v3 = 3", "v3 = 30"))
    monkeypatch.chdir(tmp_path)
    assert g.changed_lines("HEAD", "pkg/m.py") == {4}


HANGS_AFTER_FAILING = """
import time
import pytest

@pytest.fixture
def stuck():
    yield
    time.sleep(4)  # a teardown that waits, like a pool closing on a session left in a transaction

def test_fails_then_hangs(stuck):
    assert False
"""


@pytest.mark.parametrize(("mutant", "exit"), [("service.x_f__mutmut_1", 36), (None, 1)])
def test_a_test_that_hangs_under_a_mutant_ends_its_run_as_a_timeout(
        tmp_path: Path, mutant: str | None, exit: int) -> None:
    """tests/conftest.py's watchdog: pytest-timeout stops timing a test once it failed, so a
    mutant whose failing test then hangs in teardown would run until mutmut's CPU limit.
    Under a mutant the run ends with mutmut's timeout code; otherwise nothing changes."""
    import os
    import sys

    (tmp_path / "test_hang.py").write_text(HANGS_AFTER_FAILING)
    env = {k: v for k, v in os.environ.items() if k != "MUTANT_UNDER_TEST"}
    env["INGEST_MUTANT_TEST_WALL_LIMIT"] = "1"
    if mutant:
        env["MUTANT_UNDER_TEST"] = mutant
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")],
        cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == exit, run.stdout + run.stderr
    assert ("this mutant's run ends as a timeout" in run.stderr) == bool(mutant)

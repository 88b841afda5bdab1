"""The README's handler and its test, taken from the README as written, run as a user would
run them: a folder with the handler module, the test file and a conftest that creates the
handler's table, under pytest with sqs-ingest's plugin (a throwaway PostgreSQL)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_handler_passes_the_readme_test(tmp_path: Path) -> None:
    handler, conftest, test = _python_blocks()[:3]
    assert "@handler(" in handler and "ingest_schema_sql" in conftest
    assert "async def test_" in test
    (tmp_path / "my_handlers.py").write_text(handler)
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_readme.py").write_text(test)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
         "asyncio_mode=auto", "-W", "ignore::DeprecationWarning", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout

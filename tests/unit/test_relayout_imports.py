"""scripts/relayout_imports.py: old flat import paths -> the layout by role, idempotently
(run again after merging branches written against the flat layout)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[2]
_spec = importlib.util.spec_from_file_location("relayout_imports",
                                               ROOT / "scripts" / "relayout_imports.py")
assert _spec is not None and _spec.loader is not None
relayout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(relayout)

OLD = '''import service.store as store_module
from service import __version__, metrics, store as s
from service import (
    labels,  # why
    tracing,
)
from service.handlers import handler, registry
from service.sql import queries

    from service import maintenance

monkeypatch.setattr("service.batch.fence", f)
cmd = [sys.executable, "-m", "service.cli"]
only_mutate = ["service/store.py", "service/sql/queries.sql", "service/testing.py"]
sqs_ingest = "service.pytest_plugin"
'''

NEW = '''import service.adapters.store as store_module
from service import __version__
from service.adapters import store as s
from service.observe import metrics
from service.core import labels
from service.observe import tracing
from service.core import registry
from service.handlers import handler
from service.adapters.sql import queries

    from service.runtime import maintenance

monkeypatch.setattr("service.runtime.batch.fence", f)
cmd = [sys.executable, "-m", "service.cli"]
only_mutate = ["service/adapters/store.py", "service/adapters/sql/queries.sql", "service/testing/fakes.py"]
sqs_ingest = "service.testing.pytest_plugin"
'''


def test_rewrites_every_form_of_an_old_path_and_then_nothing() -> None:
    """Against this checkout, where every move has happened: dotted names in code and in
    strings, `from service import` split per new home (one line or parenthesised), paths."""
    moves = relayout.moved(ROOT)
    assert moves == relayout.MOVES
    once = relayout.rewrite(OLD, moves, ROOT)
    assert once == NEW
    assert relayout.rewrite(once, moves, ROOT) == once


def test_a_move_not_made_yet_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "service" / "adapters").mkdir(parents=True)
    (tmp_path / "service" / "adapters" / "store.py").write_text("")
    (tmp_path / "service" / "metrics.py").write_text("")  # not moved
    moves = relayout.moved(tmp_path)
    assert moves == {"store": "adapters.store"}
    text = "from service import metrics, store\nx = 'service/metrics.py service/store.py'\n"
    assert relayout.rewrite(text, moves, tmp_path) == (
        "from service import metrics\nfrom service.adapters import store\n"
        "x = 'service/metrics.py service/adapters/store.py'\n")

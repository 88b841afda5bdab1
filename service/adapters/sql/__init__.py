"""Named SQL kept outside Python: ``queries()["claim"]``."""

from __future__ import annotations

import functools
import re
from pathlib import Path

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@functools.cache
def queries() -> dict[str, str]:
    text = (Path(__file__).parent / "queries.sql").read_text()
    parts = _HEADER.split(text)
    return {name: _statement(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def _statement(body: str) -> str:
    """The statement without its whole-line comments: they stay in the file for readers,
    and PostgreSQL shows the statement itself in ``pg_stat_activity.query`` (which keeps
    only the first ``track_activity_query_size`` bytes, 1 kB by default)."""
    lines = (line for line in body.splitlines() if not line.lstrip().startswith("--"))
    return "\n".join(lines).strip()

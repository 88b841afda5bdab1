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
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}

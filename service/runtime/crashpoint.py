"""Crash points for the chaos tests; inert unless armed.

``INGEST_TEST_CRASH_AT=after_commit_before_delete`` (read by
``service.settings.crash_point_from_env``, armed by ``service.app.run`` at start-up): the
process kills itself (SIGKILL, as ``kill -9`` would) the first time a batch's transaction has
committed and none of its messages has been deleted yet — the moment exactly-once exists
for. Before dying it writes one line, ``crash_point <name>``, to stderr, so a test can tell
that the crash happened there. For tests only (tests/acceptance/test_crash_point.py): never
set it in a deployment. Unarmed, ``crash_point`` tests one constant.
"""

from __future__ import annotations

import os
import signal

AFTER_COMMIT_BEFORE_DELETE = "after_commit_before_delete"

_AT: str | None = None


def arm(name: str | None) -> None:
    """Crash at ``name`` from now on; ``None`` or empty: never (the default)."""
    global _AT
    _AT = name or None


def crash_point(name: str) -> None:
    if _AT is None or name != _AT:  # unset: never, whatever the name (even a wrong one)
        return
    os.write(2, f"crash_point {name}: SIGKILL (INGEST_TEST_CRASH_AT)\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)

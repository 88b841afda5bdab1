"""A wall-clock bound over a test that no pytest hook cancels.

pytest-timeout 2.4.0 (pytest-dev/pytest-timeout#196) and pytest's faulthandler plugin cancel
their timers as soon as a test fails, so a teardown that blocks after a failure — a pool
waiting for a connection a stuck task holds — runs for ever. A daemon thread's timer is not
cancelled by anything but the ``with`` block's end. Used while mutmut checks a mutant
(tests/conftest.py) and by the SQL mutant harness (tests/sql_mutants.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def bounded(seconds: float, expire: Callable[[], None]) -> Iterator[None]:
    """Call ``expire`` (which ends the process) if the block runs longer than ``seconds``."""
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()

"""The daemon raises the cyclic collector's first threshold (service.app.GC_THRESHOLD) as it
starts: its messages' short-lived objects are freed by reference counting, and a collection
every 700 allocations cost it measurable CPU (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import gc
import signal

from service import app
from service.settings import load_settings


def test_run_raises_the_first_gc_threshold_and_keeps_the_older_ratios() -> None:
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        settings = load_settings(queue_url="http://127.0.0.1:1/q",
                                 database_url="postgresql://u@127.0.0.1:1/d", http_port=0)
        # A stop requested before start-up: run() returns without reaching a server.
        assert asyncio.run(app.run(settings, early_signals=[signal.SIGTERM])) == 0
        assert gc.get_threshold() == (app.GC_THRESHOLD, 10, 10)
    finally:
        gc.set_threshold(*saved)

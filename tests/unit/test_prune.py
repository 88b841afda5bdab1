"""The pruner's pure parts: the safety rule, its statements' shape, the metric, the loop."""

from __future__ import annotations

import asyncio
import collections
import re
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from service.adapters import prune
from service.adapters.prune import STEPS, TABLES
from service.adapters.sql import queries
from service.core.retention import (
    SQS_MAX_RETENTION,
    RetentionRefused,
    check_retention,
    queue_retention,
    safe_without_queue,
)
from service.core.retry import ReceiveLimit
from service.observe import metrics
from service.runtime.maintenance import Maintenance
from service.settings import ConfigError, Settings, load_settings


def settings(**over: Any) -> Settings:
    return Settings(queue_url="http://127.0.0.1:1/q", database_url="postgresql://u@h/d", **over)


def test_a_retention_equal_to_the_queue_s_is_refused_naming_both() -> None:
    with pytest.raises(RetentionRefused) as exc:
        check_retention(settings(retention_days=14), 14 * 86400)
    line = str(exc.value)
    assert "\n" not in line
    assert "INGEST_RETENTION_DAYS=14" in line and "MessageRetentionPeriod=1209600" in line
    check_retention(settings(retention_days=14.01), 14 * 86400)  # above: accepted


def test_the_refusal_gives_the_figures_in_their_units_and_the_bound_to_set() -> None:
    """The line an operator acts on: the retention in days and seconds, the queue's period
    in seconds and days, and the value to set it above (days, the setting's unit)."""
    with pytest.raises(RetentionRefused) as exc:
        check_retention(settings(retention_days=3.5), 4 * 86400)
    line = str(exc.value)
    assert "INGEST_RETENTION_DAYS=3.5 (302400 s) does not exceed" in line
    assert "MessageRetentionPeriod=345600 s (4 days)" in line
    assert line.endswith("; set INGEST_RETENTION_DAYS above 4")


def test_the_dead_letter_retention_is_held_to_the_same_rule() -> None:
    with pytest.raises(RetentionRefused, match="INGEST_DEAD_LETTER_RETENTION_DAYS=3"):
        check_retention(settings(dead_letter_retention_days=3), 4 * 86400)
    # The results, reconcile and worker retentions keep no redelivery out: not checked.
    check_retention(settings(results_retention_days=0.1, worker_retention_days=0.1,
                             reconcile_retention_days=0.1), 4 * 86400)


def test_without_the_queue_only_a_retention_above_sqs_maximum_is_safe() -> None:
    assert SQS_MAX_RETENTION == 14 * 86400
    assert not safe_without_queue(settings(retention_days=14))
    assert not safe_without_queue(settings(retention_days=30, dead_letter_retention_days=14))
    assert safe_without_queue(settings(retention_days=14.5, dead_letter_retention_days=15))
    assert queue_retention({}) == SQS_MAX_RETENTION  # an attribute missing: assume the worst
    assert queue_retention({"MessageRetentionPeriod": "60"}) == 60


def test_defaults() -> None:
    s = settings()
    assert (s.retention_days, s.prune_interval, s.dead_letter_retention_days,
            s.reconcile_retention_days, s.worker_retention_days, s.prune_batch_size) == (
        30, 3600, 30, 90, 7, 5000)
    check_retention(s, SQS_MAX_RETENTION)  # the defaults pass the longest queue


@pytest.mark.parametrize("var", ["PRUNE_INTERVAL", "RETENTION_DAYS", "PRUNE_BATCH_SIZE",
                                 "DEAD_LETTER_RETENTION_DAYS"])
def test_bad_values_name_the_variable(var: str) -> None:
    with pytest.raises(ConfigError, match=f"INGEST_{var}"):
        load_settings(queue_url="http://x/q", database_url="postgresql://u@h/d",
                      **{var.lower(): -1})


def test_every_step_is_a_short_batch_that_skips_locked_rows() -> None:
    q = queries()
    assert {s.table for s in STEPS} == set(TABLES)
    for step in STEPS:
        sql = q[step.statement]
        assert "FOR UPDATE SKIP LOCKED" in sql, step.table
        assert re.search(r"LIMIT \$2", sql), step.table
        assert step.count in q
    # Discrepancies before their runs (the cascade would take a run's in one transaction).
    tables = [s.table for s in STEPS]
    assert tables.index("reconciliation_discrepancies") < tables.index("reconciliation_runs")


def test_refusals_are_the_last_step_on_the_request_retention() -> None:
    """payload_refusals: INGEST_RETENTION_DAYS (the one held above the queue's retention),
    and last, so a database whose grants predate its DELETE has every other table pruned
    before the pass fails there."""
    last = STEPS[-1]
    assert last.table == "payload_refusals"
    assert last.retention(settings(retention_days=31, dead_letter_retention_days=45,
                                   worker_retention_days=7, results_retention_days=8,
                                   reconcile_retention_days=90)) == 31


def test_every_table_series_exists_at_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    # A counter of its own: on the shared registry another test may have made the series.
    own = CollectorRegistry()
    monkeypatch.setattr(metrics, "pruned_rows", Counter(
        "sqs_ingest_pruned_rows", "test copy", ["table"], registry=own))
    metrics.prime([])
    assert {table: own.get_sample_value("sqs_ingest_pruned_rows_total", {"table": table})
            for table in TABLES} == dict.fromkeys(TABLES, 0.0)


class Queue:
    """The queue side of the pass: its MessageRetentionPeriod, or a failure to say it."""

    def __init__(self, retention: int | None = 345_600) -> None:
        self.retention = retention

    async def attributes(self) -> dict[str, str]:
        from service.errors import TransientError

        if self.retention is None:
            raise TransientError("GetQueueAttributes failed: unreachable")
        return {"MessageRetentionPeriod": str(self.retention)}


def maintenance(s: Settings, queue: Queue | None = None) -> Maintenance:
    health: Any = SimpleNamespace(is_up=True)
    store: Any = SimpleNamespace()
    # why the ignore below: stand-ins for the store and health
    return Maintenance(s, queue or Queue(), store, health,  # type: ignore[arg-type]
                       collections.Counter(), ReceiveLimit(s.max_receive_count))


async def test_each_pass_checks_the_queue_s_retention_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon started under a queue that keeps messages 4 days; an operator raises it to
    14 while it runs: a 10-day retention could now prune what SQS still redelivers, so the
    pass is refused (nothing called) until the queue's retention is lowered again."""
    calls: list[Any] = []

    async def fake(db: Any, s: Settings, **kw: Any) -> dict[str, int]:
        calls.append(db)
        return {}

    monkeypatch.setattr(prune, "prune_once", fake)
    queue = Queue(345_600)
    m = maintenance(settings(retention_days=10, dead_letter_retention_days=10), queue)
    assert await m.prune_pass() == {} and len(calls) == 1
    queue.retention = SQS_MAX_RETENTION
    assert await m.prune_pass() is None and len(calls) == 1
    queue.retention = None  # cannot be asked: 10 days is not above SQS's maximum
    assert await m.prune_pass() is None and len(calls) == 1
    m15 = maintenance(settings(retention_days=15, dead_letter_retention_days=15), queue)
    assert await m15.prune_pass() == {} and len(calls) == 2  # above it: safe anyway


async def test_the_daemon_prunes_on_and_survives_a_failed_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    done = asyncio.Event()

    async def fake(db: Any, s: Settings, **kw: Any) -> dict[str, int]:
        calls.append(db)
        if len(calls) == 1:
            raise OSError("database went away")
        done.set()
        return {}

    monkeypatch.setattr(prune, "prune_once", fake)
    m = maintenance(settings(prune_interval=0.01))
    task = asyncio.create_task(m._prune_loop())
    try:
        await asyncio.wait_for(done.wait(), 5)
    finally:
        task.cancel()
    assert calls[:2] == ["postgresql://u@h/d"] * 2


async def test_the_prune_task_runs_only_when_the_interval_is_set() -> None:
    for interval, expected in ((0, False), (3600, True)):
        tasks = maintenance(settings(prune_interval=interval)).start()
        for t in tasks:  # cancelled before they ever run
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert ("prune" in {t.get_name() for t in tasks}) is expected

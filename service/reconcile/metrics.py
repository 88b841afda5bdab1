"""The reconciliation's own Prometheus metrics: served by the sidecar, pushed by one-off runs."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from service.reconcile import KINDS, log
from service.reconcile.job import JobResult

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

PUSH_JOB = "sqs_ingest_reconcile"


class RunMetrics:
    """The sidecar's own metrics (and what is pushed to a Pushgateway)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry: CollectorRegistry = CollectorRegistry()
        ns = "sqs_ingest_reconcile"
        self.last_run = Gauge(
            f"{ns}_last_run_timestamp_seconds", "End of the last run", registry=self.registry
        )
        self.last_success = Gauge(
            f"{ns}_last_success_timestamp_seconds",
            "End of the last run that completed (clean or not)",
            registry=self.registry,
        )
        self.duration = Gauge(
            f"{ns}_last_duration_seconds", "Duration of the last run", registry=self.registry
        )
        self.discrepancies = Gauge(
            f"{ns}_discrepancies",
            "Discrepancies found by the last completed run",
            ["kind"],
            registry=self.registry,
        )
        self.modifications = Gauge(
            f"{ns}_modifications",
            "Modifications in the last run's window",
            ["database"],
            registry=self.registry,
        )
        self.runs = Counter(
            f"{ns}_runs_total", "Runs by outcome", ["outcome"], registry=self.registry
        )
        for kind in KINDS:
            self.discrepancies.labels(kind=kind)
        for outcome in ("clean", "discrepancies", "failed", "skipped"):
            self.runs.labels(outcome=outcome)

    def observe(self, outcome: str, duration: float, result: JobResult | None) -> None:
        self.runs.labels(outcome=outcome).inc()
        if outcome == "skipped":
            return
        now = time.time()
        self.last_run.set(now)
        self.duration.set(duration)
        if result is not None:
            self.last_success.set(now)
            for kind, n in result.counts.items():
                self.discrepancies.labels(kind=kind).set(n)
            for label, n in result.modifications.items():
                self.modifications.labels(database=label).set(n)

    def push(self, url: str) -> None:
        from prometheus_client import push_to_gateway

        try:
            push_to_gateway(url, job=PUSH_JOB, registry=self.registry, timeout=10)
        except OSError as exc:
            # The run's result is already stored; a monitoring hiccup must not mask it.
            log().error("pushgateway_failed", error=str(exc))

#!/usr/bin/env python3
"""Builds the sqs-ingest Grafana dashboard.

    python deploy/grafana/generate.py          # rewrite the committed files
    python deploy/grafana/generate.py --check  # exit 1 if they differ from this script

Writes ``deploy/grafana/sqs-ingest.json`` (what users import or what compose provisions)
and ``deploy/k8s/optional/grafana-dashboard.yaml`` (the same JSON in a ConfigMap labelled
for the Grafana sidecar). Plain dicts, no library: the panel list below is the whole
dashboard, and tests/deploy/test_grafana.py fails when the committed JSON drifts from it.
tests/integration/test_dashboard.py evaluates every query against a real Prometheus
scraping a real daemon.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_JSON = ROOT / "deploy/grafana/sqs-ingest.json"
CONFIGMAP_YAML = ROOT / "deploy/k8s/optional/grafana-dashboard.yaml"

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Every daemon series is filtered by the two template variables.
SEL = 'job=~"$job", instance=~"$instance"'


def m(name: str, extra: str = "") -> str:
    """A daemon metric selector with the dashboard's job/instance filter."""
    return f"{name}{{{SEL}{', ' + extra if extra else ''}}}"


def rate(name: str, extra: str = "") -> str:
    return f"rate({m(name, extra)}[$__rate_interval])"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({rate(histogram + '_bucket')}))"


# The reconcile sidecar (or the Pushgateway) is its own scrape job: no daemon filter.
RECONCILE_LATEST = (
    "sqs_ingest_reconcile_last_success_timestamp_seconds"
    " == on (job) group_left () max by (job)"
    " (sqs_ingest_reconcile_last_success_timestamp_seconds)"
)


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | bargauge
    width: int = 8
    height: int = 8
    description: str = ""
    thresholds: list[tuple[float | None, str]] = field(
        default_factory=lambda: [(None, "green")]
    )
    stack: bool = False


@dataclass
class Row:
    title: str
    panels: list[Panel]


ROWS: list[Row] = [
    Row("Overview", [
        Panel("Ready replicas", [(f"sum({m('sqs_ingest_ready')})", "ready")],
              kind="stat", width=4, height=4,
              description="Replicas whose /readyz answers 200 (DB reachable, schema current, "
                          "SQS reachable, not draining).",
              thresholds=[(None, "red"), (1, "green")]),
        Panel("Throughput", [(f"sum({rate('sqs_ingest_messages_processed_total')})", "msg/s")],
              unit="ops", kind="stat", width=4, height=4,
              description="Messages resolved per second, every outcome."),
        Panel("Lag p99", [(quantile(0.99, "sqs_ingest_message_lag_seconds"), "p99")],
              unit="s", kind="stat", width=4, height=4,
              description="Commit time minus SQS SentTimestamp, 99th percentile.",
              thresholds=[(None, "green"), (10, "orange"), (60, "red")]),
        Panel("Oldest message age",
              [(f"max({m('sqs_ingest_queue_oldest_message_age_seconds')})", "age")],
              unit="s", kind="stat", width=4, height=4,
              description="now - oldest SentTimestamp among recently received messages.",
              thresholds=[(None, "green"), (300, "orange"), (900, "red")]),
        Panel("Dead letters (range)",
              [(f"sum(increase({m('sqs_ingest_dead_letters_total')}[$__range]))", "dead letters")],
              kind="stat", width=4, height=4,
              description="Rows written to dead_letters in the selected time range: "
                          "`sqs-ingest dlq list`.",
              thresholds=[(None, "green"), (1, "orange")]),
        Panel("Ack failures (range)",
              [(f"sum(increase({m('sqs_ingest_ack_failures_total')}[$__range]))", "ack failures")],
              kind="stat", width=4, height=4,
              description="DeleteMessageBatch failed after commit; each makes the daemon exit 3.",
              thresholds=[(None, "green"), (1, "red")]),
    ]),
    Row("Flow", [
        Panel("Throughput by outcome",
              [(f"sum by (outcome) ({rate('sqs_ingest_messages_processed_total')})", "{{outcome}}"),
               (f"sum({rate('sqs_ingest_messages_received_total')})", "received")],
              unit="ops", width=12,
              description="completed, duplicate, dead_lettered, retried per second; "
                          "received for comparison."),
        Panel("Lag (send → commit) p50 / p99",
              [(quantile(0.5, "sqs_ingest_message_lag_seconds"), "p50"),
               (quantile(0.99, "sqs_ingest_message_lag_seconds"), "p99")],
              unit="s", width=12,
              description="sqs_ingest_message_lag_seconds: commit time minus SQS SentTimestamp."),
        Panel("Queue depth",
              [(f"max({m('sqs_ingest_queue_visible_messages')})", "visible"),
               (f"max({m('sqs_ingest_queue_in_flight_messages')})", "not visible (in flight)")],
              description="GetQueueAttributes ApproximateNumberOfMessages(NotVisible); "
                          "queue-wide, so max over replicas."),
        Panel("In flight in the daemon",
              [(f"sum by (instance) ({m('sqs_ingest_in_flight_messages')})", "{{instance}}")],
              description="Received and not yet acked or released, per replica."),
        Panel("Oldest message age",
              [(f"max by (instance) ({m('sqs_ingest_queue_oldest_message_age_seconds')})",
                "{{instance}}")],
              unit="s",
              description="CloudWatch ApproximateAgeOfOldestMessage is the authoritative figure."),
        Panel("Batch duration p50 / p99",
              [(quantile(0.5, "sqs_ingest_batch_duration_seconds"), "p50"),
               (quantile(0.99, "sqs_ingest_batch_duration_seconds"), "p99")],
              unit="s", width=12, description="Receive to ack of one batch (≤ 10 messages)."),
        Panel("Throughput by type",
              [(f"sum by (type) ({rate('sqs_ingest_messages_processed_total')})", "{{type}}")],
              unit="ops", width=12,
              description="_invalid: poison without a known type."),
    ]),
    Row("Failures", [
        Panel("Dead letters by reason",
              [(f"sum by (reason) ({rate('sqs_ingest_dead_letters_total')})", "{{reason}}")],
              unit="ops", stack=True,
              description="Rows written to dead_letters per second; replay with "
                          "`sqs-ingest dlq replay`."),
        Panel("Ack failures and restarts",
              [(f"sum({rate('sqs_ingest_ack_failures_total')})", "ack failures/s"),
               (f"sum by (instance) (changes({m('process_start_time_seconds')}"
                "[$__rate_interval]))", "restarts {{instance}}")],
              description="An ack failure exits 3 on purpose; the orchestrator restarts it.",
              thresholds=[(None, "green"), (1, "red")]),
        Panel("Database and SQS errors",
              [(f"sum({rate('sqs_ingest_db_errors_total')})", "database"),
               (f"sum by (operation) ({rate('sqs_ingest_sqs_errors_total')})",
                "sqs {{operation}}")],
              unit="ops",
              description="Database connection failures and failed SQS calls by operation."),
        Panel("Retries and contention",
              [("sum by (type) ("
                + rate("sqs_ingest_messages_processed_total", 'outcome="retried"') + ")",
                "retried {{type}}"),
               (f"sum({rate('sqs_ingest_contention_deferrals_total')})", "contention deferrals"),
               (f"sum({rate('sqs_ingest_visibility_extensions_total')})", "visibility extensions")],
              unit="ops", width=12,
              description="Handler failures put back with backoff; messages deferred because "
                          "another live owner holds the claim; heartbeat extensions."),
        Panel("Orphaned claims released",
              [(f"sum(increase({m('sqs_ingest_orphans_collected_total')}[$__rate_interval]))",
                "released")],
              width=12,
              description="IN_PROGRESS claims of dead workers released by GC (after a crash "
                          "or kill -9)."),
    ]),
    Row("Cost", [
        Panel("AWS requests by action",
              [(f"sum by (service, operation) ({rate('sqs_ingest_aws_requests_total')})",
                "{{service}} {{operation}}")],
              unit="reqps", width=12, stack=True,
              description="Requests sent to AWS per second, each attempt of a retried call "
                          "too: what SQS, SNS and S3 bill for."),
        Panel("SQS requests per message",
              [("sum(" + rate("sqs_ingest_aws_requests_total", 'service="sqs"') + ") / sum("
                + rate("sqs_ingest_messages_processed_total") + ")", "requests/message")],
              width=12,
              description="SQS requests per message resolved: about 0.2 on a backlog "
                          "(receives and deletes of 10), more on a trickle; an idle daemon's "
                          "long polls are requests without messages (infinite here)."),
    ]),
    Row("Results outbox", [
        Panel("Outbox backlog",
              [(f"sum({m('sqs_ingest_outbox_pending')})", "pending")],
              description="Result messages committed and not yet published. Empty while "
                          "INGEST_RESULTS_TOPIC_ARN / INGEST_RESULTS_QUEUE_URL are unset."),
        Panel("Oldest unpublished result",
              [(f"max({m('sqs_ingest_outbox_oldest_age_seconds')})", "oldest")],
              unit="s", description="A destination that is down shows here, not in ingestion."),
        Panel("Results published",
              [(f"sum({rate('sqs_ingest_results_published_total')})", "published/s")],
              unit="ops", description="Result messages published to SNS/SQS per second."),
    ]),
    Row("Large payloads (S3)", [
        Panel("S3 fetches",
              [(f"sum by (outcome) ({rate('sqs_ingest_s3_fetches_total')})", "{{outcome}}")],
              unit="ops",
              description="GetObject of payloads the AWS extended clients offloaded to S3 "
                          "(README 'Large payloads'): fetched, missing (dead letter "
                          "payload_object_missing), too_large (payload_too_large), error "
                          "(retried)."),
        Panel("S3 errors",
              [(f"sum by (kind) ({rate('sqs_ingest_s3_errors_total')})", "{{kind}}")],
              unit="ops",
              description="Transient S3 failures by kind; those messages wait in the queue "
                          "(alert SqsIngestS3PayloadErrors). access_denied: s3:GetObject on "
                          "the payload bucket."),
        Panel("S3 bytes read",
              [(f"sum({rate('sqs_ingest_s3_fetched_bytes_total')})", "read")],
              unit="Bps", description="Offloaded payload bytes read from S3 per second."),
    ]),
    Row("Retention", [
        Panel("Rows pruned",
              [(f"sum by (table) (increase({m('sqs_ingest_pruned_rows_total')}"
                "[$__rate_interval]))", "{{table}}")],
              width=24,
              description="Rows deleted past their retention (README 'Retention'), per table: "
                          "a pass every INGEST_PRUNE_INTERVAL by one replica at a time. "
                          "Nothing for days on a busy system: pruning is off or failing "
                          "(prune_failed in the logs)."),
    ]),
    Row("Reconciliation (nightly)", [
        Panel("Since last completed run",
              [("time() - max(sqs_ingest_reconcile_last_success_timestamp_seconds)", "age")],
              unit="s", kind="stat", width=6,
              description="The alert SqsIngestReconcileStale fires past 26 h.",
              thresholds=[(None, "green"), (93600, "red")]),
        Panel("Latest run failed",
              [("max(sqs_ingest_reconcile_last_run_timestamp_seconds)"
                " > bool max(sqs_ingest_reconcile_last_success_timestamp_seconds)", "failed")],
              kind="stat", width=6,
              description="1 when the latest run did not complete (see the reconcile logs).",
              thresholds=[(None, "green"), (1, "red")]),
        Panel("Discrepancies of the latest run",
              [(f"max by (kind) (sqs_ingest_reconcile_discrepancies and on (job, instance)"
                f" ({RECONCILE_LATEST}))", "{{kind}}")],
              kind="bargauge", width=6,
              description="Details in reconciliation_discrepancies for the latest run_id.",
              thresholds=[(None, "green"), (1, "red")]),
        Panel("Latest run",
              [("max(sqs_ingest_reconcile_last_duration_seconds)", "duration (s)"),
               ("max by (database) (sqs_ingest_reconcile_modifications)", "rows {{database}}")],
              kind="stat", width=6,
              description="Duration and modifications read per database in the window."),
    ]),
]


def _thresholds(steps: list[tuple[float | None, str]]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for v, c in steps]}


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    targets = [
        {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": chr(65 + i),
         "range": p.kind == "timeseries", "instant": p.kind != "timeseries"}
        for i, (expr, legend) in enumerate(p.targets)
    ]
    defaults: dict[str, Any] = {"unit": p.unit, "thresholds": _thresholds(p.thresholds),
                                "color": {"mode": "palette-classic" if p.kind == "timeseries"
                                          else "thresholds"}}
    options: dict[str, Any]
    if p.kind == "timeseries":
        defaults["min"] = 0
        defaults["custom"] = {
            "drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
            "spanNulls": False, "stacking": {"group": "A", "mode": "normal" if p.stack else "none"},
        }
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "multi", "sort": "desc"}}
    else:
        reduce = {"calcs": ["lastNotNull"], "fields": "", "values": False}
        options = {"reduceOptions": reduce, "orientation": "auto"}
        if p.kind == "stat":
            options.update(colorMode="value", graphMode="none", justifyMode="auto",
                           textMode="auto")
        else:
            options.update(displayMode="gradient", showUnfilled=True)
    return {
        "datasource": DATASOURCE, "description": p.description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y}, "id": pid,
        "options": options, "targets": targets, "title": p.title, "type": p.kind,
    }


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"{name}-values"}, "definition": query,
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1, "hide": 0, "options": [],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in ROWS:
        panels.append({"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                       "id": pid, "panels": [], "title": row.title, "type": "row"})
        pid, y = pid + 1, y + 1
        x, line_height = 0, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y = 0, y + line_height
                line_height = 0
            panels.append(_panel(p, pid, x, y))
            pid, x, line_height = pid + 1, x + p.width, max(line_height, p.height)
        y += line_height
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": "sqs-ingest: SQS → PostgreSQL exactly once. Metrics from /metrics "
                       "of the daemon and the reconcile sidecar.",
        "editable": True,
        "graphTooltip": 1,
        "links": [],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["sqs-ingest", "sqs", "postgresql"],
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "options": [], "refresh": 1,
             "regex": ""},
            _variable("job", "job", "label_values(sqs_ingest_build_info, job)"),
            _variable("instance", "instance",
                      'label_values(sqs_ingest_build_info{job=~"$job"}, instance)'),
        ]},
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "sqs-ingest",
        "uid": "sqs-ingest",
        "version": 1,
    }


def dashboard_json() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def configmap_yaml() -> str:
    body = "\n".join(("    " + line).rstrip() for line in dashboard_json().splitlines())
    return (
        "# Generated by deploy/grafana/generate.py from the same panels as\n"
        "# deploy/grafana/sqs-ingest.json: do not edit by hand.\n"
        "# The Grafana sidecar (kube-prometheus-stack, grafana helm chart) loads ConfigMaps\n"
        "# labelled grafana_dashboard=\"1\":\n"
        "#   kubectl apply -n monitoring -f deploy/k8s/optional/grafana-dashboard.yaml\n"
        "# (JSON lines inside the block scalar may be long.)\n"
        "# yamllint disable rule:line-length\n"
        "apiVersion: v1\n"
        "kind: ConfigMap\n"
        "metadata:\n"
        "  name: sqs-ingest-grafana-dashboard\n"
        "  labels:\n"
        "    grafana_dashboard: \"1\"\n"
        "    app.kubernetes.io/part-of: sqs-ingest\n"
        "data:\n"
        "  sqs-ingest.json: |\n"
        f"{body}\n"
    )


OUTPUTS = {DASHBOARD_JSON: dashboard_json, CONFIGMAP_YAML: configmap_yaml}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed files differ")
    args = ap.parse_args(argv)
    stale = []
    for path, build in OUTPUTS.items():
        text = build()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run {Path(__file__).relative_to(ROOT)}): {', '.join(stale)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

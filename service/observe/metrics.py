"""Every Prometheus metric of the daemon, and the HTTP server (/metrics /healthz /readyz)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from service import __version__
from service.core import labels

REGISTRY = CollectorRegistry(auto_describe=True)
# process_start_time_seconds etc.: restarts (exit 3 after an ack failure) are alertable.
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)
# python_gc_collections_total{generation}: the collector's work (service.app.GC_THRESHOLD).
GCCollector(registry=REGISTRY)
P = "sqs_ingest_"

messages_received = Counter(
    P + "messages_received", "Messages received from SQS", registry=REGISTRY
)
messages_processed = Counter(
    P + "messages_processed",
    "Messages by final outcome of this delivery",
    ["type", "outcome"],
    registry=REGISTRY,
)
ack_failures = Counter(
    P + "ack_failures", "DeleteMessageBatch calls or entries that failed after commit",
    registry=REGISTRY,
)
orphans_collected = Counter(
    P + "orphans_collected",
    "IN_PROGRESS claims of dead workers released by GC or taken over by a claim",
    registry=REGISTRY,
)
dead_letters = Counter(
    P + "dead_letters", "Messages stored in dead_letters", ["reason"], registry=REGISTRY
)
db_errors = Counter(P + "db_errors", "Database connection failures", registry=REGISTRY)
sqs_errors = Counter(P + "sqs_errors", "SQS calls that failed", ["operation"], registry=REGISTRY)
aws_requests = Counter(
    P + "aws_requests",
    "AWS API requests sent, by service and action: every attempt, retries included (each is "
    "billed)",
    ["service", "operation"], registry=REGISTRY,
)
visibility_extensions = Counter(
    P + "visibility_extensions", "Messages whose visibility was extended while in flight",
    registry=REGISTRY,
)
contention_deferrals = Counter(
    P + "contention_deferrals", "Messages deferred because another live owner holds the claim",
    registry=REGISTRY,
)
requeued = Counter(
    P + "requeued", "Messages deferred through no fault of their own and sent again as a fresh "
    "copy, so the queue's RedrivePolicy does not count the deferral (service.ops.redrive)",
    registry=REGISTRY,
)
receive_limit = Gauge(
    P + "receive_limit", "Handler failures before a message is dead-lettered: "
    "INGEST_MAX_RECEIVE_COUNT, lowered by the queue's RedrivePolicy", registry=REGISTRY,
)
batch_duration = Histogram(
    P + "batch_duration_seconds",
    "Receive-to-ack time of one batch",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    registry=REGISTRY,
)
message_lag = Histogram(
    P + "message_lag_seconds",
    "Commit time minus SQS SentTimestamp",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
    registry=REGISTRY,
)
inflight_bytes = Gauge(
    P + "inflight_bytes", "Bytes of message bodies and S3 payloads held for messages in flight "
    "(INGEST_MAX_INFLIGHT_BYTES is the budget)", registry=REGISTRY)
budget_waits = Counter(
    P + "budget_waits", "Receives that waited for room in INGEST_MAX_INFLIGHT_BYTES "
    "(back-pressure)", registry=REGISTRY)
in_flight = Gauge(P + "in_flight_messages", "Messages received and not yet acked or released",
                  registry=REGISTRY)
queue_visible = Gauge(P + "queue_visible_messages",
                      "ApproximateNumberOfMessages from GetQueueAttributes", registry=REGISTRY)
queue_not_visible = Gauge(P + "queue_in_flight_messages",
                          "ApproximateNumberOfMessagesNotVisible from GetQueueAttributes",
                          registry=REGISTRY)
queue_oldest_age = Gauge(
    P + "queue_oldest_message_age_seconds",
    "now - oldest SentTimestamp among recently received messages "
    "(CloudWatch ApproximateAgeOfOldestMessage is authoritative)",
    registry=REGISTRY,
)
results_published = Counter(
    P + "results_published", "Result messages accepted by the results destination",
    ["status"], registry=REGISTRY,
)
results_refused = Counter(
    P + "results_refused",
    "Result messages the destination refused for good (SenderFault: marked refused in "
    "outbox, never sent again)", registry=REGISTRY,
)
results_publish_failures = Counter(
    P + "results_publish_failures",
    "Results calls or entries the destination refused (the rows stay pending)",
    registry=REGISTRY,
)
outbox_pending = Gauge(P + "outbox_pending", "Outbox rows not yet published",
                       registry=REGISTRY)
outbox_oldest_age = Gauge(
    P + "outbox_oldest_age_seconds", "now - completed_at of the oldest unpublished outbox row",
    registry=REGISTRY,
)
pruned_rows = Counter(
    P + "pruned_rows", "Rows deleted by retention (service.adapters.prune)", ["table"],
    registry=REGISTRY,
)
s3_fetches = Counter(
    P + "s3_fetches", "S3 GetObject calls for offloaded payloads, by outcome "
    "(fetched, missing, too_large, error)", ["outcome"], registry=REGISTRY,
)
s3_fetched_bytes = Counter(
    P + "s3_fetched_bytes", "Bytes of offloaded payloads read from S3", registry=REGISTRY
)
s3_errors = Counter(
    P + "s3_errors", "S3 calls that failed transiently (the message is retried), by kind",
    ["kind"], registry=REGISTRY,
)
s3_deletes = Counter(
    P + "s3_deletes", "Offloaded payloads deleted after commit and ack "
    "(INGEST_S3_DELETE_AFTER_ACK), by outcome", ["outcome"], registry=REGISTRY,
)
ready = Gauge(P + "ready", "1 when /readyz answers 200", registry=REGISTRY)
build_info = Info(P + "build", "Build information", registry=REGISTRY)
build_info.info({"version": __version__})


def prime(types: Iterable[str]) -> None:
    """Create every labelled series at 0 at startup. ``increase()``/``rate()`` cannot see
    the first increment of a series that did not exist before it, so without this the first
    dead letter after a restart would never fire the dead-letter alert."""
    for reason in labels.DEAD_LETTER_REASONS:
        dead_letters.labels(reason)
    for type_ in (*types, labels.INVALID_TYPE_LABEL):
        for outcome in labels.OUTCOMES:
            messages_processed.labels(type_, outcome)
    for fetch in labels.FETCH_OUTCOMES:
        s3_fetches.labels(fetch)
    for kind in labels.ERROR_KINDS:
        s3_errors.labels(kind)
    for deleted in labels.DELETE_OUTCOMES:
        s3_deletes.labels(deleted)
    for table in labels.PRUNED_TABLES:  # the pruner's tables, one series each
        pruned_rows.labels(table)
    # Without these the dashboard's SQS-errors and results panels were empty after a restart
    # and increase() missed the first SQS error (issue 24).
    for operation in labels.SQS_OPERATIONS:
        sqs_errors.labels(operation)
    for status in labels.RESULT_STATUSES:
        results_published.labels(status)
    for action in labels.SQS_LOOP_ACTIONS:
        aws_requests.labels("sqs", action)


def count_aws_requests(session: Any) -> None:
    """Count every request the clients of ``session`` (aiobotocore) make from now on, in
    ``aws_requests_total``: a client copies its session's event handlers when it is made, and
    botocore emits ``before-send.<service>.<Action>`` once per HTTP attempt."""
    session.register("before-send", _count_aws_request, unique_id="sqs-ingest-aws-requests")


def _count_aws_request(event_name: str, **_kwargs: Any) -> None:
    # partition, never raising: a handler's error would fail the request it counts.
    service, _, action = event_name.partition(".")[2].partition(".")
    aws_requests.labels(service, action).inc()


Check = Callable[[], Awaitable[tuple[bool, dict[str, object]]]]


def make_app(healthy: Check, readiness: Check) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        ok, detail = await healthy()
        return web.json_response({"ok": ok, **detail}, status=200 if ok else 503)

    async def readyz(_: web.Request) -> web.Response:
        ok, detail = await readiness()
        ready.set(1 if ok else 0)
        return web.json_response({"ready": ok, **detail}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def start_http(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    return runner

"""Tracing through the real queue and database: a producer's span context, sent the three
ways AWS producers send it, reaches the handler span of the message it sent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.observe import tracing
from tests.integration.conftest import eventually, make_settings, running_worker

XRAY_TRACE = 0x5759E988BD862E3FE1BE46A994272793
XRAY = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"


@pytest.fixture
def traced(queue_url: str) -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """The daemon's tracing, and a producer's, both into one in-memory exporter."""
    provider, exporter = TracerProvider(), InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, queue_url)
    try:
        yield provider, exporter
    finally:
        tracing.shutdown()


def upsert(rid: str, version: int = 1) -> str:
    return json.dumps({"request_id": rid, "type": "entity.upsert",
                       "payload": {"entity_id": rid, "version": version, "data": {}}})


def produce(provider: TracerProvider) -> tuple[int, dict[str, str]]:
    """What an instrumented producer does: send inside its span, inject the W3C headers."""
    tracer = provider.get_tracer("producer")
    with tracer.start_as_current_span("send orders", kind=SpanKind.PRODUCER) as span:
        headers: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(headers)
    return span.get_span_context().trace_id, headers


def tree(spans: list[ReadableSpan], trace_id: int) -> str:
    """The spans of one trace as an indented tree (docs: README, Tracing)."""
    mine = [s for s in spans if s.context.trace_id == trace_id]
    ids = {s.context.span_id for s in mine}
    kids: dict[int | None, list[ReadableSpan]] = {}
    for s in mine:
        parent = s.parent.span_id if s.parent and s.parent.span_id in ids else None
        kids.setdefault(parent, []).append(s)

    def lines(parent: int | None, depth: int) -> list[str]:
        out = []
        for s in sorted(kids.get(parent, []), key=lambda s: s.start_time or 0):
            ms = ((s.end_time or 0) - (s.start_time or 0)) / 1e6
            out.append(f"{'  ' * depth}{s.name}  [{s.kind.name}, {ms:.1f} ms]")
            out += lines(s.context.span_id, depth + 1)
        return out

    return "\n".join(lines(None, 0))


async def test_producer_trace_reaches_the_handler_span(
    traced: tuple[TracerProvider, InMemorySpanExporter], sqs_client: Any, sqs_endpoint: str, queue_url: str,
    database_url: str,
) -> None:
    provider, exporter = traced
    t_attr, h_attr = produce(provider)
    sqs_client.send_message(QueueUrl=queue_url, MessageBody=upsert("t-attr"), MessageAttributes={
        k: {"DataType": "String", "StringValue": v} for k, v in h_attr.items()})
    t_sns, h_sns = produce(provider)
    envelope = json.dumps({
        "Type": "Notification", "MessageId": "n-1", "TopicArn": "arn:aws:sns:us-east-1:1:t",
        "Message": upsert("t-sns"),
        "MessageAttributes": {k: {"Type": "String", "Value": v} for k, v in h_sns.items()}})
    sqs_client.send_message(QueueUrl=queue_url, MessageBody=envelope)
    sqs_client.send_message(QueueUrl=queue_url, MessageBody=upsert("t-xray"),
                            MessageSystemAttributes={"AWSTraceHeader": {
                                "DataType": "String", "StringValue": XRAY}})
    plain = [upsert(f"t-{i}") for i in range(25)]
    for start in range(0, len(plain), 10):
        sqs_client.send_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": str(i), "MessageBody": b} for i, b in enumerate(plain[start:start + 10])])

    settings = make_settings(queue_url, database_url, sqs_endpoint)
    async with running_worker(settings):
        async def done() -> bool:
            conn = await asyncpg.connect(database_url)
            try:
                n = await conn.fetchval(
                    "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'")
            finally:
                await conn.close()
            return bool(n == 28)

        await eventually(done, "28 completed")

    # Every span the daemon ends carries attributes (Optional only in the SDK's type).
    spans = list(exporter.get_finished_spans())
    handlers = {s.attributes["sqs_ingest.request_id"]: s for s in spans  # type: ignore[index]
                if s.name == "handler entity.upsert"}
    assert set(handlers) == {"t-attr", "t-sns", "t-xray", *(f"t-{i}" for i in range(25))}
    assert handlers["t-attr"].context.trace_id == t_attr
    assert handlers["t-sns"].context.trace_id == t_sns
    assert handlers["t-xray"].context.trace_id == XRAY_TRACE

    batches = [s for s in spans if s.name == "sqs-ingest batch"]
    batch_ids = {b.context.span_id for b in batches}
    batch_level = [s for s in spans if s.parent is not None and s.parent.span_id in batch_ids
                   and s.kind.name != "CONSUMER"]
    # Per batch: the batch span and its claim/commit/settle, however many messages it held.
    assert 1 <= len(batches) <= 28 and len(batch_level) <= 3 * len(batches)
    assert sum(s.attributes["messaging.batch.message_count"] for s in batches) >= 28  # type: ignore[index,misc]
    print(f"{len(batches)} batches, {len(spans)} spans\n" + tree(spans, t_attr))

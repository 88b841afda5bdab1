"""service.observe.tracing alone: context extraction, the span tree of one batch, log trace ids, and
that nothing imports opentelemetry while tracing is off."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel

from service.core.messages import Message, Received
from service.observe import tracing

REPO = Path(__file__).resolve().parents[2]
QUEUE = "http://127.0.0.1:4566/000000000000/orders"
XRAY = "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider, QUEUE)
    try:
        yield exporter
    finally:
        tracing.shutdown()


def producer_headers(provider_spans: InMemorySpanExporter) -> tuple[int, dict[str, str]]:
    """A producer span (as an instrumented sender would have) and its W3C headers."""
    tracer = TracerProvider().get_tracer("producer")
    with tracer.start_as_current_span("send orders") as span:
        headers: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(headers)
    return span.get_span_context().trace_id, headers


def body(rid: str) -> str:
    return json.dumps({"request_id": rid, "type": "t", "payload": {}})


def received(i: int, body_: str, **kw: Any) -> Received:
    return Received(message_id=f"m{i}", receipt_handle=f"h{i}", body=body_, **kw)


class P(BaseModel):
    pass


def message(r: Received, rid: str) -> Message:
    return Message(r, rid, "t", P(), {}, "sha")


def sns(inner: str, headers: dict[str, str]) -> str:
    return json.dumps({"Type": "Notification", "MessageId": "n1", "Message": inner,
                       "MessageAttributes": {k: {"Type": "String", "Value": v}
                                             for k, v in headers.items()}})


# --- extraction ---------------------------------------------------------------------------


def test_carrier_reads_sqs_attributes_then_the_sns_envelope() -> None:
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.carrier(received(1, body("a"), attributes={"traceparent": tp, "x": "y"})) \
        == {"traceparent": tp}
    assert tracing.carrier(received(2, sns(body("a"), {"traceparent": tp, "tracestate": "k=v"}))) \
        == {"traceparent": tp, "tracestate": "k=v"}
    assert tracing.carrier(received(3, body("a"))) == {}
    assert tracing.carrier(received(4, '{"Type": "Notification", "traceparent": ')) == {}
    assert tracing.carrier(received(5, json.dumps(
        {"Type": "Notification", "Message": "{}", "MessageAttributes": {"traceparent": 5}}))) == {}


def test_xray_header() -> None:
    assert tracing.xray_ids(XRAY) == (0x5759E988BD862E3FE1BE46A994272793, 0x53995C3F42CD8AD8, True)
    # why the ignore below: a valid header: not None
    assert tracing.xray_ids(XRAY.replace("Sampled=1", "Sampled=0"))[2] is False  # type: ignore[index]
    for bad in (None, "", "Root=1-abc;Parent=53995c3f42cd8ad8", "Root=2-5759e988-bd862e3fe1be46a994272793;Parent=1",
                "Root=1-5759e988-bd862e3fe1be46a994272793", "Root=1-5759e988-bd862e3fe1be46a99427279z;Parent=53995c3f42cd8ad8"):
        assert tracing.xray_ids(bad) is None, bad


# --- span tree ----------------------------------------------------------------------------


def run_batch(batch: list[Received], fail: str | None = None) -> None:
    msgs = [message(r, f"r{i}") for i, r in enumerate(batch)]
    with tracing.batch(batch):
        with tracing.step("claim", msgs):
            pass
        with tracing.step("commit", msgs):
            for m in msgs:
                try:
                    with tracing.handler(m):
                        if m.raw.message_id == fail:
                            raise RuntimeError("handler failed")
                except RuntimeError:
                    pass
        with tracing.step("settle", batch):
            pass


def by_name(exporter: InMemorySpanExporter) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for s in exporter.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


def test_producer_trace_reaches_handler_through_attributes_envelope_and_xray(
    spans: InMemorySpanExporter,
) -> None:
    t1, h1 = producer_headers(spans)
    t2, h2 = producer_headers(spans)
    batch = [received(0, body("r0"), attributes=h1),
             received(1, sns(body("r1"), h2)),
             received(2, body("r2"), trace_header=XRAY),
             received(3, body("r3"))]
    run_batch(batch, fail="m1")
    got = by_name(spans)
    handlers = {s.attributes["sqs_ingest.request_id"]: s for s in got["handler t"]}
    assert handlers["r0"].context.trace_id == t1
    assert handlers["r1"].context.trace_id == t2  # across the SNS envelope
    assert handlers["r2"].context.trace_id == 0x5759E988BD862E3FE1BE46A994272793
    (batch_span,) = got["sqs-ingest batch"]
    assert handlers["r3"].context.trace_id == batch_span.context.trace_id  # no producer
    assert handlers["r1"].status.status_code == trace.StatusCode.ERROR

    process = {s.attributes["messaging.message.id"]: s for s in got["process orders"]}
    assert process["m0"].parent.trace_id == t1 and process["m0"].parent.is_remote
    assert process["m0"].kind == trace.SpanKind.CONSUMER
    assert process["m0"].attributes["messaging.system"] == "aws_sqs"
    assert process["m0"].attributes["messaging.destination.name"] == "orders"
    assert process["m0"].attributes["sqs_ingest.request_id"] == "r0"
    # claim, commit, settle are children of the message span; the handler of the commit.
    ids = {s.context.span_id: s for s in spans.get_finished_spans()}
    for m in ("m0", "m1", "m2", "m3"):
        children = [s for s in spans.get_finished_spans()
                    if s.parent is not None and s.parent.span_id == process[m].context.span_id]
        assert sorted(c.name for c in children) == ["claim", "commit", "settle"], m
    for h in handlers.values():
        assert ids[h.parent.span_id].name == "commit"
    assert {link.context.trace_id for link in batch_span.links} == {
        t1, t2, 0x5759E988BD862E3FE1BE46A994272793}


def test_batch_level_spans_do_not_grow_with_the_batch(spans: InMemorySpanExporter) -> None:
    for size in (1, 10):
        spans.clear()
        run_batch([received(i, body(f"r{i}")) for i in range(size)])
        finished = spans.get_finished_spans()
        batch_level = [s for s in finished if s.name == "sqs-ingest batch" or (
            s.parent is not None and s.parent.span_id in
            {b.context.span_id for b in finished if b.name == "sqs-ingest batch"}
            and s.name != "process orders")]
        assert len(batch_level) == 4, [s.name for s in batch_level]  # batch + 3 steps
        assert len(finished) == 4 + 5 * size  # per message: process, claim, commit, handler, settle


def test_log_lines_carry_the_trace_id_of_the_current_span(spans: InMemorySpanExporter) -> None:
    _, headers = producer_headers(spans)
    r = received(0, body("r0"), attributes=headers)
    seen: list[dict[str, Any]] = []
    with tracing.batch([r]), tracing.step("commit", [message(r, "r0")]), \
            tracing.handler(message(r, "r0")):
        seen.append(tracing.log_trace_ids(None, "info", {"event": "x"}))
    assert seen[0]["trace_id"] == headers["traceparent"].split("-")[1]
    assert "trace_id" not in tracing.log_trace_ids(None, "info", {"event": "outside"})


def test_off_costs_no_import_and_returns_the_shared_noop() -> None:
    code = """
import sys
from service.observe import tracing
import service.cli, service.runtime.batch, service.adapters.sqs, service.observe.logs
from service.handlers import invoke
from service.core.messages import Received
r = Received("m", "h", "{}")
assert tracing.batch([r]) is tracing.NOOP and tracing.step("claim", [r]) is tracing.NOOP
with tracing.batch([r]), tracing.step("claim", [r]):
    pass
service.observe.logs.configure_logging("json", "info", trace_ids=False)
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_traceparent_wins_and_a_different_xray_trace_becomes_a_link(
    spans: InMemorySpanExporter,
) -> None:
    t1, h1 = producer_headers(spans)
    run_batch([received(0, body("r0"), attributes=h1, trace_header=XRAY)])
    (process,) = by_name(spans)["process orders"]
    assert process.parent.trace_id == t1
    assert [link.context.trace_id for link in process.links] == [0x5759E988BD862E3FE1BE46A994272793]

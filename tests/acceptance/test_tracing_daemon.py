"""``sqs-ingest run`` with INGEST_TRACING=true, configured only by OTEL_* variables: its spans
reach an OTLP/HTTP receiver on loopback, the producer's trace id reaches the handler span, and
the handler's log line carries that trace id. Without the otel extra: exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tests.acceptance.harness import Daemon, daemon_env, wait_drained
from tests.servers import wait_until

REPO = Path(__file__).resolve().parents[2]

LOGGING_HANDLER = '''
import structlog
from opentelemetry import trace
from pydantic import BaseModel

from service.handlers import handler

log = structlog.get_logger("test")


class Note(BaseModel):
    text: str


@handler("test.note", Note)
async def note(payload, conn):
    with trace.get_tracer("test-handler").start_as_current_span("own_work"):
        log.info("test_handled", text=payload.text)
    return None
'''


class Collector:
    """An OTLP/HTTP trace receiver: POST /v1/traces with ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict[str, Any], Any]] = []  # (resource attributes, span)
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                for rs in req.resource_spans:
                    resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        collector.spans.extend((resource, s) for s in ss.spans)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    c.thread.start()
    try:
        yield c
    finally:
        c.server.shutdown()
        c.server.server_close()
        c.thread.join(10)


def test_daemon_exports_spans_over_otlp_and_logs_trace_ids(
    tmp_path: Path, collector: Collector, database_url: str, queue_url: str,
    sqs_endpoint: str, sqs_client: Any,
) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "tracing_note_handler.py").write_text(LOGGING_HANDLER)
    env = daemon_env(database_url, queue_url, sqs_endpoint, INGEST_TRACING="true",
                     INGEST_HANDLERS="tracing_note_handler",
                     PYTHONPATH=os.pathsep.join([str(mods), str(REPO)]),
                     OTEL_EXPORTER_OTLP_ENDPOINT=collector.url, OTEL_BSP_SCHEDULE_DELAY="200")
    env.pop("OTEL_SERVICE_NAME", None)
    daemon = Daemon(env, tmp_path)
    try:
        daemon.start().wait_ready()
        with TracerProvider().get_tracer("producer").start_as_current_span("send") as span:
            headers: dict[str, str] = {}
            TraceContextTextMapPropagator().inject(headers)
        producer_trace = span.get_span_context().trace_id
        sqs_client.send_message(
            QueueUrl=queue_url,
            MessageBody=json.dumps({"request_id": "n-1", "type": "test.note",
                                    "payload": {"text": "hello"}}),
            MessageAttributes={k: {"DataType": "String", "StringValue": v}
                               for k, v in headers.items()})
        wait_drained(sqs_client, queue_url, [daemon])

        def handler_span() -> Any:
            return next((s for _, s in collector.spans if s.name == "handler test.note"), None)

        span_pb = wait_until(handler_span, 30, "handler span exported over OTLP", interval=0.2)
        assert daemon.stop() == 0, daemon.logs()
    finally:
        if daemon.proc is not None and not daemon.exited():
            daemon.proc.kill()
            daemon.wait(10)
    assert int.from_bytes(span_pb.trace_id, "big") == producer_trace
    # A span the handler starts itself (global tracer provider) nests under the handler span.
    (own,) = [s for _, s in collector.spans if s.name == "own_work"]
    assert own.trace_id == span_pb.trace_id and own.parent_span_id == span_pb.span_id
    resources = {r.get("service.name") for r, _ in collector.spans}
    assert resources == {"sqs-ingest"}
    names = {s.name for _, s in collector.spans}
    assert {"sqs-ingest batch", "claim", "commit", "settle", "handler test.note"} <= names
    handled = [json.loads(line) for line in daemon.full_logs().splitlines()
               if '"test_handled"' in line]
    assert [h["trace_id"] for h in handled] == [f"{producer_trace:032x}"], handled


def test_tracing_without_the_otel_extra_exits_2(tmp_path: Path) -> None:
    # A stand-in package that fails to import, as when the extra is not installed.
    fake = tmp_path / "fake" / "opentelemetry"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named opentelemetry')\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           "INGEST_TRACING": "true", "INGEST_QUEUE_URL": "http://127.0.0.1:9/000000000000/q",
           "INGEST_DATABASE_URL": "postgresql://u:p@127.0.0.1:9/db", "INGEST_HTTP_PORT": "0",
           "PYTHONPATH": os.pathsep.join([str(fake.parent), str(REPO)])}
    out = subprocess.run([sys.executable, "-m", "service", "run"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "INGEST_TRACING" in out.stderr and "otel" in out.stderr, out.stderr

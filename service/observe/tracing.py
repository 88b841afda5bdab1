"""OpenTelemetry tracing of each message, from the producer's span to the row (optional).

Off unless ``INGEST_TRACING=true`` and the ``otel`` extra is installed
(``pip install 'sqs-ingest[otel]'``). Off, nothing here imports opentelemetry and every
hook returns one shared no-op context manager: the hot path pays a function call per batch
step. On, the exporter is configured by the standard ``OTEL_*`` variables (OTLP over
HTTP/protobuf: ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME`` — default
``sqs-ingest`` —, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, …).

The parent of a message's ``process`` span is the producer's context, taken from (first
found wins; a different second context becomes a link):

* the W3C ``traceparent``/``tracestate`` SQS message attributes,
* the same attributes inside an SNS Notification envelope (``MessageAttributes`` of the
  body: SNS → SQS without raw message delivery),
* the ``AWSTraceHeader`` system attribute (X-Ray format, set by AWS services and the
  X-Ray SDK).

One trace per message::

    process <queue>                  CONSUMER   parent: the producer's span
    ├── claim                        INSERT … ON CONFLICT (one statement for the batch)
    ├── commit                       the completing transaction
    │   └── handler <type>           the handler call (current span: its logs carry trace_id)
    └── settle                       dead letters → DeleteMessageBatch → visibility

plus one ``sqs-ingest batch`` span per received batch (links to every producer context,
``messaging.batch.message_count``) with the same three steps: the number of batch-level
spans is fixed per batch, whatever its size.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import orjson

from service import __version__, secrets
from service.core.messages import Message, Received

NOOP: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
AWS_TRACE_HEADER = "AWSTraceHeader"
DEFAULT_SERVICE_NAME = "sqs-ingest"


_state: _Tracing | None = None
_batch: contextvars.ContextVar[_BatchTrace | None] = contextvars.ContextVar(
    "sqs_ingest_batch_trace", default=None
)


def enabled() -> bool:
    return _state is not None


def setup(queue_url: str, version: str = "") -> None:
    """Turn tracing on with an OTLP exporter configured by the ``OTEL_*`` variables.

    Raises ImportError (naming the extra) when opentelemetry is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise ImportError(
            f"INGEST_TRACING=true needs the otel extra (pip install 'sqs-ingest[otel]'): {exc}"
        ) from exc
    resource = Resource.create({SERVICE_VERSION: version} if version else {})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    # Global too: spans that handlers (or instrumented libraries) start with
    # opentelemetry.trace.get_tracer() nest under the handler span and leave with ours.
    from opentelemetry import trace

    trace.set_tracer_provider(provider)
    install(provider, queue_url)


def install(provider: Any, queue_url: str) -> None:
    """Trace through ``provider`` (a ``TracerProvider``; tests pass one with an in-memory
    exporter). Unlike ``setup``, the global provider is left alone."""
    global _state
    _state = _Tracing(provider, queue_url)


def shutdown() -> None:
    """Flush and stop (at exit). Tracing is off afterwards."""
    global _state
    state, _state = _state, None
    if state is not None:
        state.provider.shutdown()


def batch(received: Sequence[Received]) -> contextlib.AbstractContextManager[None]:
    """Around the processing of one received batch."""
    return NOOP if _state is None else _state.batch(received)


def step(name: str, messages: Sequence[Message] | Sequence[Received]) -> (
        contextlib.AbstractContextManager[None]):
    """Around one batch operation (claim, commit, settle): one child span per message."""
    trace = _batch.get() if _state is not None else None
    return NOOP if trace is None else trace.step(name, messages)


def handler(message: Message) -> contextlib.AbstractContextManager[None]:
    """Around one handler call; the span is current while the handler runs."""
    trace = _batch.get() if _state is not None else None
    return NOOP if trace is None else trace.handler([message], message.type)


def handlers(messages: Sequence[Message]) -> contextlib.AbstractContextManager[None]:
    """Around one call of a batch handler: a handler span in each message's trace."""
    trace = _batch.get() if _state is not None else None
    return NOOP if trace is None else trace.handler(messages, messages[0].type)


def log_trace_ids(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: ``trace_id``/``span_id`` of the current span, if any."""
    if _state is not None:
        ctx = _state.trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event.setdefault("trace_id", format(ctx.trace_id, "032x"))
            event.setdefault("span_id", format(ctx.span_id, "016x"))
    return event


# --- context extraction (pure: no SDK needed, only the API) ----------------------------


def carrier(received: Received) -> dict[str, str]:
    """The W3C headers of a message: its SQS message attributes, else those of an SNS
    Notification envelope in its body."""
    attrs = received.attributes or {}
    if TRACEPARENT in attrs:
        return {k: v for k, v in attrs.items() if k in (TRACEPARENT, TRACESTATE)}
    body = received.body
    if not (body.startswith("{") and '"Notification"' in body and TRACEPARENT in body):
        return {}
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    sns_attrs = doc.get("MessageAttributes") if isinstance(doc, dict) else None
    if doc.get("Type") != "Notification" or not isinstance(sns_attrs, dict):
        return {}
    out = {}
    for key in (TRACEPARENT, TRACESTATE):
        a = sns_attrs.get(key)
        if isinstance(a, dict) and isinstance(a.get("Value"), str):
            out[key] = a["Value"]
    return out


def xray_ids(header: str | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of an ``AWSTraceHeader``
    (``Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1``)."""
    if not header:
        return None
    fields = dict(p.strip().split("=", 1) for p in header.split(";") if "=" in p)
    root, parent = fields.get("Root", ""), fields.get("Parent", "")
    parts = root.split("-")
    if len(parts) != 3 or parts[0] != "1" or len(parts[1]) != 8 or len(parts[2]) != 24:
        return None
    try:
        trace_id, span_id = int(parts[1] + parts[2], 16), int(parent, 16)
    except ValueError:
        return None
    if not trace_id or not span_id or len(parent) != 16:
        return None
    return trace_id, span_id, fields.get("Sampled") == "1"


def queue_name(queue_url: str) -> str:
    return queue_url.rstrip("/").rsplit("/", 1)[-1]


# --- the SDK side, only built when tracing is on ----------------------------------------


def _message_id(m: Message | Received) -> str:
    return str(m.raw.message_id if hasattr(m, "raw") else getattr(m, "message_id"))  # noqa: B009


class _Tracing:
    def __init__(self, provider: Any, queue_url: str) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.trace = trace
        self.context = context
        self.tracer = provider.get_tracer("sqs_ingest", __version__)
        self.propagator = TraceContextTextMapPropagator()
        self.queue = queue_name(queue_url)
        self.common = {"messaging.system": "aws_sqs",
                       "messaging.destination.name": self.queue}

    def producer(self, r: Received) -> tuple[Any, list[Any]]:
        """(parent context or None, links) of one received message."""
        trace = self.trace
        parent = None
        links = []
        headers = carrier(r)
        if headers:
            ctx = self.propagator.extract(headers)
            if trace.get_current_span(ctx).get_span_context().is_valid:
                parent = ctx
        xray = xray_ids(r.trace_header)
        if xray is not None:
            trace_id, span_id, sampled = xray
            sc = trace.SpanContext(trace_id, span_id, is_remote=True,
                                   trace_flags=trace.TraceFlags(1 if sampled else 0))
            if parent is None:
                parent = trace.set_span_in_context(trace.NonRecordingSpan(sc))
            elif trace.get_current_span(parent).get_span_context().trace_id != trace_id:
                links.append(trace.Link(sc, {"sqs_ingest.link": "AWSTraceHeader"}))
        return parent, links

    @contextlib.contextmanager
    def batch(self, received: Sequence[Received]) -> Iterator[None]:
        trace = self.trace
        kind = trace.SpanKind
        producers = [self.producer(r) for r in received]
        links = [trace.Link(trace.get_current_span(p).get_span_context())
                 for p, _ in producers if p is not None]
        batch_span = self.tracer.start_span(
            "sqs-ingest batch", kind=kind.INTERNAL, links=links,
            attributes={**self.common, "messaging.operation.type": "process",
                        "messaging.batch.message_count": len(received)})
        batch_ctx = trace.set_span_in_context(batch_span)
        spans = {}
        for r, (parent, extra_links) in zip(received, producers, strict=True):
            attributes = {**self.common, "messaging.operation.type": "process",
                          "messaging.operation.name": "process",
                          "messaging.message.id": r.message_id,
                          "messaging.message.body.size": len(r.body),
                          "sqs_ingest.receive_count": r.receive_count}
            if r.group_id is not None:
                attributes["messaging.aws_sqs.message_group_id"] = r.group_id
            # Without a producer context the message's span joins the batch's trace.
            spans[r.message_id] = self.tracer.start_span(
                f"process {self.queue}", context=parent or batch_ctx, kind=kind.CONSUMER,
                links=extra_links, attributes=attributes)
        bt = _BatchTrace(self, batch_span, spans)
        token = _batch.set(bt)
        try:
            with trace.use_span(batch_span, end_on_exit=False, record_exception=False):
                yield
        except BaseException as exc:
            _fail([batch_span], exc)
            raise
        finally:
            _batch.reset(token)
            for span in spans.values():
                span.end()
            batch_span.end()


class _BatchTrace:
    def __init__(self, tracing: _Tracing, batch_span: Any, spans: dict[str, Any]) -> None:
        self.t = tracing
        self.batch_span = batch_span
        self.spans = spans  # message id → its process span
        self.current: dict[str, Any] = {}  # message id → its open step span

    @contextlib.contextmanager
    def step(self, name: str, messages: Sequence[Any]) -> Iterator[None]:
        trace, tracer = self.t.trace, self.t.tracer
        opened = [tracer.start_span(name, context=trace.set_span_in_context(self.batch_span),
                                    attributes={"messaging.batch.message_count":
                                                len(messages)})]
        ids = []
        for m in messages:
            mid = _message_id(m)
            span = self.spans.get(mid)
            if span is None:
                continue
            attrs = {"sqs_ingest.request_id": m.request_id} if hasattr(m, "request_id") else {}
            child = tracer.start_span(name, context=trace.set_span_in_context(span),
                                      attributes=attrs)
            if attrs:
                span.set_attribute("sqs_ingest.request_id", m.request_id)
                span.set_attribute("sqs_ingest.type", m.type)
            self.current[mid] = child
            ids.append(mid)
            opened.append(child)
        try:
            yield
        except BaseException as exc:
            _fail(opened, exc)
            raise
        finally:
            for mid in ids:
                self.current.pop(mid, None)
            for span in opened:
                span.end()

    @contextlib.contextmanager
    def handler(self, messages: Sequence[Message], mtype: str) -> Iterator[None]:
        trace, tracer = self.t.trace, self.t.tracer
        opened = []
        for m in messages:
            mid = m.raw.message_id
            parent = self.current.get(mid) or self.spans.get(mid)
            if parent is None:
                continue
            opened.append(tracer.start_span(
                f"handler {mtype}", context=trace.set_span_in_context(parent),
                attributes={"sqs_ingest.request_id": m.request_id, "sqs_ingest.type": mtype,
                            "sqs_ingest.batch_call": len(messages) > 1}))
        if not opened:
            yield
            return
        try:
            # Current while the handler runs: its log lines (and its own spans) join the
            # trace of the message (the first one's, for a batch call).
            with trace.use_span(opened[0], end_on_exit=False, record_exception=False):
                yield
        except BaseException as exc:
            _fail(opened, exc)
            raise
        finally:
            for span in opened:
                span.end()


def _fail(spans: list[Any], exc: BaseException) -> None:
    import traceback

    from opentelemetry.trace import Status, StatusCode

    # The exporter ships these off the host: a driver's error may quote the DSN, so the
    # message and the stack trace are scrubbed as a log line would be.
    message = secrets.safe(str(exc))
    stacktrace = secrets.inert(secrets.scrub("".join(traceback.format_exception(exc))),
                               keep_lines=True)
    for span in spans:
        span.record_exception(exc, attributes={"exception.message": message,
                                               "exception.stacktrace": stacktrace})
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {message}"[:200]))

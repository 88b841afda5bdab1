"""Wiring of ``sqs-ingest run``: settings → pool → queue → worker, HTTP, signals."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

import asyncpg
import structlog
from aiobotocore.session import get_session

from service.adapters.identity import ecs_worker_name
from service.adapters.migrate import check_schema
from service.adapters.payloads import S3Payloads, s3_client
from service.adapters.pgerrors import CONNECTION_ERRORS
from service.adapters.sinks import results_sink
from service.adapters.sqs import SqsQueue, sqs_client
from service.adapters.store import Store, create_pool
from service.core.retention import RetentionRefused, check_retention, queue_retention
from service.core.retry import Backoff
from service.envelope import Envelope
from service.errors import DatabaseError, SchemaBehind, TransientError, driver_error
from service.handlers import default_registry, load_handler_modules, load_reference_handlers
from service.observe import metrics
from service.ops import diagnose
from service.runtime.results import Publisher
from service.runtime.worker import EXIT_FATAL, Worker
from service.settings import (
    CONTROL_POOL_SIZE,
    MIN_VISIBILITY_TIMEOUT,
    Settings,
)

log = structlog.get_logger("sqs_ingest.app")


T = TypeVar("T")
_RETRYABLE: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, TransientError)


class _Startup:
    """Signals and readiness while the daemon is still connecting (DB or SQS not there
    yet); once the worker runs, both are handed to it."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.stop = asyncio.Event()
        self.db = False
        self.sqs = False

    def on_signal(self) -> None:
        if self.worker is not None:
            self.worker.request_stop()
        else:
            self.stop.set()

    async def healthy(self) -> tuple[bool, dict[str, object]]:
        if self.worker is None:
            return True, {"phase": "starting"}
        return self.worker.liveness()

    async def ready(self) -> tuple[bool, dict[str, object]]:
        if self.worker is None:
            return False, {"phase": "starting", "database": self.db, "sqs": self.sqs}
        return self.worker.readiness()


async def _retry(
    what: str, attempt: Callable[[], Awaitable[T]], stop: asyncio.Event
) -> T | None:
    """Retry ``attempt()`` with capped exponential backoff until it works or stop is set."""
    backoff = Backoff(0.5, 10.0)
    while True:
        try:
            return await attempt()
        except _RETRYABLE as exc:
            if diagnose.is_permanent(exc):
                raise  # a wrong queue URL or password: the CLI prints the fix, exit 2
            log.warning(f"{what}_unavailable", error=str(exc), retry_in=round(backoff.delay, 2),
                        hint=diagnose.hint(exc))
        if await backoff.wait(stop):
            return None


#: The cyclic garbage collector's first threshold in the daemon (Python's default: 700 net
#: allocations). Each message allocates and frees many short-lived objects (its parsed
#: JSON, the SQS client's request and response structures), nearly all freed by reference
#: counting: at 700 the collector ran about 32 times per 1,000 messages of a backlog (~6 %
#: of the daemon's CPU), at 10,000 less than once, the daemon's memory the same
#: (docs/benchmarks.md). The older generations keep Python's ratios.
GC_THRESHOLD = 10_000


async def run(settings: Settings, early_signals: list[int] | None = None) -> int:
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
    load_reference_handlers()
    load_handler_modules(settings.handler_modules)  # already imported by the CLI: cached
    state = _Startup()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, state.on_signal)
    if early_signals:
        state.stop.set()
    runner = None
    if settings.http_port:
        runner = await metrics.start_http(
            metrics.make_app(state.healthy, state.ready), settings.http_host, settings.http_port
        )
    log.info("starting", database=settings.database_redacted, queue=settings.queue_url,
             http_port=settings.http_port)
    try:
        return await _with_database(settings, state)
    except (asyncpg.PostgresError, DatabaseError) as exc:
        if diagnose.is_permanent(exc):
            raise  # wrong password, no such database: the CLI prints the fix, exit 2
        log.error("fatal_database_error", error=str(driver_error(exc)))
        return EXIT_FATAL
    finally:
        if runner is not None:
            await runner.cleanup()


async def _with_database(settings: Settings, state: _Startup) -> int:
    pool = await _retry(
        "database", lambda: create_pool(settings.database_dsn, settings.db_pool_size), state.stop
    )
    if pool is None:
        return 0
    try:
        async with pool.acquire() as conn:
            await check_schema(conn)
    except SchemaBehind as exc:
        log.error("schema_behind", error=str(exc))
        print(f"sqs-ingest: {exc}", flush=True)
        return EXIT_FATAL
    state.db = True
    control_pool = await create_pool(settings.database_dsn, CONTROL_POOL_SIZE)
    pools = [pool, control_pool]
    if settings.results_enabled:
        # The publisher holds a connection across each send: its own, one per loop.
        pools.append(await create_pool(settings.database_dsn, settings.results_publishers + 1))
    store = Store(pool, control_pool=control_pool, results=settings.results_enabled,
                  outbox_pool=pools[2] if settings.results_enabled else None,
                  lease=settings.worker_lease)
    try:
        return await _with_queue(settings, state, store)
    finally:
        for p in pools:
            try:
                await asyncio.wait_for(p.close(), timeout=5)
            except TimeoutError:
                p.terminate()


def _visibility_timeout(settings: Settings, attrs: dict[str, str]) -> int:
    vt = settings.visibility_timeout or int(attrs.get("VisibilityTimeout", "30"))
    if vt < MIN_VISIBILITY_TIMEOUT:
        # The queue's own (the variable is checked in Settings): a zero timeout hides
        # nothing and would make the heartbeat spin.
        log.warning("visibility_timeout_too_small", queue_value=vt, using=30)
        vt = 30
    return vt


async def _named(settings: Settings) -> Settings:
    if not settings.worker_name:
        # On ECS: the task and container (unique, kept by an in-place restart), so a
        # restart releases its previous incarnation's claims at once (service.adapters.identity).
        ecs_name = await asyncio.to_thread(ecs_worker_name)
        if ecs_name:
            settings = settings.model_copy(update={"worker_name": ecs_name})
            log.info("worker_name_from_ecs_metadata", worker_name=ecs_name)
    return settings


async def _with_queue(settings: Settings, state: _Startup, store: Store) -> int:
    session = get_session()  # one credentials chain for SQS and S3
    metrics.count_aws_requests(session)
    async with sqs_client(settings.aws_region, settings.sqs_endpoint_url,
                          max_pool_connections=settings.pollers * 2 + 10,
                          session=session) as client:
        queue = SqsQueue(client, settings.queue_url)
        attrs = await _retry("sqs", queue.attributes, state.stop)
        if attrs is None:
            return 0
        state.sqs = True
        if settings.prune_interval > 0:
            try:
                check_retention(settings, queue_retention(attrs))
            except RetentionRefused as exc:
                return diagnose.report(diagnose.Diagnosis(str(exc), diagnose.EXIT_CONFIG))
        vt = _visibility_timeout(settings, attrs)
        # Never linger a committed batch's delete past a tenth of its visibility timeout.
        queue.delete_linger = min(settings.delete_linger, vt / 10)
        settings = named = await _named(settings)
        await _retry("database", lambda: store.register_worker(named.effective_worker_name),
                     state.stop)
        async with contextlib.AsyncExitStack() as stack:
            publisher = None
            if settings.results_enabled:
                sink = await stack.enter_async_context(results_sink(settings))
                publisher = Publisher(store, sink, concurrency=settings.results_publishers)
                log.info("results_on", destination=settings.results_topic_arn
                         or settings.results_queue_url, fifo=sink.fifo)
            # S3-offloaded payloads: no S3 call is made until a pointer arrives.
            s3 = await stack.enter_async_context(s3_client(
                session, settings.aws_region, settings.effective_s3_endpoint_url,
                max_pool_connections=settings.inflight_limit + 10))
            payloads = S3Payloads(s3, settings.max_payload_bytes, settings.s3_delete_after_ack,
                                  allowed=settings.s3_buckets,
                                  expected_owner=settings.s3_expected_owner,
                                  unreadable_after=settings.s3_unreadable_after)
            default_registry.envelope = Envelope.from_specs(  # an existing producer's layout
                settings.envelope_request_id, settings.envelope_type, settings.envelope_payload)
            default_registry.max_json_values = settings.max_json_values
            worker = Worker(settings, queue, store, default_registry, visibility_timeout=vt,
                            publisher=publisher, payloads=payloads,
                            max_message_bytes=int(attrs.get("MaximumMessageSize", 262144)))
            state.worker = worker
            queue.on_unawaited_ack_failure(worker.batches.ack_failed)
            if state.stop.is_set():
                worker.request_stop()
            return await worker.run()

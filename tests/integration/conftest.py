from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from service.adapters.sqs import SqsQueue, sqs_client
from service.adapters.store import Store, create_pool
from service.handlers import Registry, default_registry, load_reference_handlers
from service.runtime.worker import Worker
from service.settings import Settings


def make_settings(queue_url: str, database_url: str, endpoint: str, **over: Any) -> Settings:
    base: dict[str, Any] = dict(
        queue_url=queue_url, database_url=database_url, sqs_endpoint_url=endpoint,
        wait_time_seconds=1, pollers=2, http_port=0, shutdown_timeout=10,
        retry_base_seconds=1, contention_delay=1, gc_interval=1, worker_lease=5,
    )
    base.update(over)
    return Settings(**base)


@contextlib.asynccontextmanager
async def running_worker(
    settings: Settings, registry: Registry | None = None
) -> AsyncIterator[tuple[Worker, asyncio.Task[int]]]:
    if registry is None:
        load_reference_handlers()
        registry = default_registry
    pool = await create_pool(settings.database_dsn, 4)
    try:
        async with sqs_client(settings.aws_region, settings.sqs_endpoint_url) as client:
            store = Store(pool)
            await store.register_worker(settings.effective_worker_name)
            worker = Worker(settings, SqsQueue(client, settings.queue_url), store, registry,
                            visibility_timeout=30)
            task = asyncio.create_task(worker.run())
            try:
                yield worker, task
            finally:
                if not task.done():
                    worker.request_stop()
                await asyncio.wait_for(task, 30)
    finally:
        await pool.close()


async def eventually(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)

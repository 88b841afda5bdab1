"""Results out: the publisher of the transactional outbox (SPEC §5).

Completions and dead letters write their ``outbox`` row in the statement that commits them
(``service.adapters.store``); this module sends those rows to an SNS topic or an SQS queue
afterwards
(through a ``ResultsSink``: ``service.adapters.sinks``), ten per call, and marks them published only
once the destination accepted them. It runs
beside the pollers and never blocks them: with the destination down, ingestion goes on, the
outbox grows, and ``sqs_ingest_outbox_oldest_age_seconds`` says so.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Sequence
from datetime import UTC

import orjson
import structlog

from service.adapters.sqs import SEND_BATCH_MAX_BYTES, batched_by_size
from service.core.retry import Backoff, sleep_or_stop
from service.core.seams import OutboxRow, OutboxSeam, ResultsSink, Sent, refused_of
from service.errors import DB_ERRORS, TransientError
from service.observe import metrics
from service.secrets import safe

log = structlog.get_logger("sqs_ingest.results")

#: A failed publish attempt: the destination, or the database under the claim.
_PUBLISH_ERRORS: tuple[type[BaseException], ...] = (TransientError, *DB_ERRORS)

#: PublishBatch / SendMessageBatch take at most ten entries.
BATCH = 10
#: Rows one claim takes: up to this many calls of ten per transaction (fewer round trips to
#: the database when a backlog drains). Concurrent on a standard destination; in order on a
#: FIFO one, where a group's results must leave in commit order.
CLAIM = 5 * BATCH


#: What one call and one message may carry: SNS topics and SQS queues take 256 KiB by
#: default (a topic's or queue's MaximumMessageSize may allow up to 1 MiB; the smaller limit
#: holds everywhere). A call over it is refused whole (BatchRequestTooLong), so results go in
#: calls that stay under it (``service.adapters.sqs.batched_by_size``), and a result that is
#: larger on its own leaves without its ``result`` (``result_omitted``): it is in
#: ``modifications.result``.
MAX_BYTES = SEND_BATCH_MAX_BYTES


def result_body(row: OutboxRow, omit_result: bool = False) -> str:
    """The published JSON: {"request_id","type","status","result","reason","completed_at"}
    (plus ``"result_omitted": "too_large"`` when ``omit_result``)."""
    completed = row.completed_at.astimezone(UTC).isoformat().replace("+00:00", "Z")
    doc = {
        "request_id": row.request_id, "type": row.request_type, "status": row.status,
        "result": None if omit_result else row.result, "reason": row.reason,
        "completed_at": completed,
    }
    if omit_result:
        doc["result_omitted"] = "too_large"
    return orjson.dumps(doc).decode()


def _group(row: OutboxRow) -> str:
    """The row's group on a FIFO destination (its MessageGroupId,
    ``service.adapters.sinks.entry``)."""
    return row.group_id or row.request_id


def _size(row: OutboxRow, body: str) -> int:
    """What SNS/SQS count against the limits: the body and the ``request_id`` attribute
    (name, data type, value)."""
    return len(body.encode()) + len("request_id") + len("String") + len(row.request_id.encode())


def bodies_of(rows: Sequence[OutboxRow], max_bytes: int = MAX_BYTES) -> list[str]:
    """Each row's body; one over ``max_bytes`` (the destination's largest message) on its
    own is replaced by its form without ``result`` (logged: the destination would refuse
    it forever)."""
    out = []
    for r in rows:
        body = result_body(r)
        # UTF-8 takes at most 4 bytes a character: most bodies need no encoding to know.
        if 4 * (len(body) + len(r.request_id)) + 16 > max_bytes and _size(r, body) > max_bytes:
            log.warning("result_too_large", request_id=r.request_id, bytes=_size(r, body),
                        limit=max_bytes, hint="published without its result; read it from "
                        "modifications.result")
            body = result_body(r, omit_result=True)
        out.append(body)
    return out


class Publisher:
    """Sends the outbox: ``concurrency`` loops, each claim → send → mark in one transaction
    (``OutboxSeam.publish_outbox``), plus an upkeep loop for the gauges. Published rows are
    deleted by the one pruner, ``service.adapters.prune`` (``INGEST_RESULTS_RETENTION_DAYS``)."""

    def __init__(
        self,
        store: OutboxSeam,
        sink: ResultsSink,
        *,
        concurrency: int = 1,
        poll_interval: float = 1.0,
        linger: float = 0.05,
        stats_interval: float = 5.0,
    ) -> None:
        self.store = store
        self.sink = sink
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.linger = linger
        self.stats_interval = stats_interval
        self._never = asyncio.Event()

    def start(self) -> list[asyncio.Task[None]]:
        tasks = [asyncio.create_task(self._publish_loop(), name=f"results-{i}")
                 for i in range(self.concurrency)]
        tasks.append(asyncio.create_task(self._upkeep_loop(), name="results-upkeep"))
        return tasks

    async def _send(self, rows: list[OutboxRow]) -> set[int]:
        pairs = list(zip(rows, bodies_of(rows, self.sink.max_message_bytes),
                         strict=True))
        chunks = [([r for r, _ in call], [b for _, b in call])
                  for call in batched_by_size(pairs, lambda p: _size(*p))]
        outcomes: list[set[int] | BaseException] = []
        if self.sink.fifo:
            # A group's rows leave in order: after one that did not (its entry answered
            # Failed), the group's rows in the later calls wait for the next round, behind
            # it. (Entries of one call are answered by the destination, each on its own.)
            held: set[str] = set()
            for chunk_rows, chunk_bodies in chunks:
                keep = [i for i, r in enumerate(chunk_rows) if _group(r) not in held]
                if not keep:
                    continue
                chunk_rows = [chunk_rows[i] for i in keep]
                chunk_bodies = [chunk_bodies[i] for i in keep]
                try:
                    accepted = await self.sink.send(chunk_rows, chunk_bodies)
                except TransientError as exc:
                    outcomes.append(exc)
                    break  # the rest of a group must not overtake what failed
                outcomes.append(accepted)
                held.update(_group(r) for r in chunk_rows if r.id not in accepted)
        else:
            outcomes = await asyncio.gather(*(self.sink.send(r, b) for r, b in chunks),
                                            return_exceptions=True)
        sent = Sent()
        for out in outcomes:
            if isinstance(out, TransientError):
                continue
            if isinstance(out, BaseException):
                raise out
            sent |= out
            sent.refused.update(refused_of(out))
        if not sent and not sent.refused and outcomes and isinstance(outcomes[0],
                                                                     TransientError):
            raise outcomes[0]  # nothing went out: the destination is down
        for status, n in collections.Counter(r.status for r in rows if r.id in sent).items():
            metrics.results_published.labels(status).inc(n)
        for r in rows:
            if r.id in sent.refused:
                # Marked refused in the same transaction: never claimed again, so the
                # results behind it (and the rest of its FIFO group) go on.
                metrics.results_refused.inc()
                log.error("result_refused", outbox_id=r.id, request_id=safe(r.request_id),
                          status=r.status, error=safe(sent.refused[r.id]))
        return sent

    async def publish_once(self) -> tuple[int, int]:
        """One claim of up to ``CLAIM`` rows; (claimed, published)."""
        return await self.store.publish_outbox(self._send, CLAIM, self.sink.fifo)

    async def _publish_loop(self) -> None:
        # Capped low: once the destination is back, the backlog starts within seconds.
        backoff = Backoff(0.5, 5.0)
        while True:
            self.store.outbox_written.clear()
            try:
                claimed, sent = await self.publish_once()
            except _PUBLISH_ERRORS as exc:
                # Ingestion does not wait for this: the rows stay pending, the age grows.
                metrics.results_publish_failures.inc()
                log.warning("results_publish_failed", error=str(exc)[:500],
                            retry_in=round(backoff.delay, 2))
                await backoff.wait(self._never)
                continue
            if sent < claimed:
                await backoff.wait(self._never)  # some entries refused: not in a tight loop
                continue
            backoff.reset()
            if claimed < CLAIM:
                # Woken by this process's own commits; other replicas' rows are found by
                # the poll. The linger lets a busy stream fill calls of ten instead of
                # sending each batch's results on their own (CPU, API calls).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.store.outbox_written.wait(),
                                           self.poll_interval)
                await asyncio.sleep(self.linger)

    async def _upkeep_loop(self) -> None:
        while True:
            try:
                await self.update_gauges()
            except DB_ERRORS as exc:
                log.warning("outbox_upkeep_failed", error=str(exc)[:500])
            await sleep_or_stop(self.stats_interval, self._never)

    async def update_gauges(self) -> None:
        pending, age = await self.store.outbox_stats()
        metrics.outbox_pending.set(pending)
        metrics.outbox_oldest_age.set(age)

    async def drain(self, seconds: float) -> int:
        """At a graceful stop: publish what is pending until none is left or ``seconds``
        runs out (what remains is for the next process or another replica). Returns the
        rows published."""
        deadline = time.monotonic() + seconds
        published = 0
        while time.monotonic() < deadline:
            try:
                claimed, sent = await asyncio.wait_for(
                    self.publish_once(), max(0.1, deadline - time.monotonic()))
            except _PUBLISH_ERRORS as exc:  # TimeoutError included (DB_ERRORS)
                log.warning("results_drain_stopped", error=str(exc)[:500])
                break
            published += sent
            if claimed == 0 or sent < claimed:
                break
        with contextlib.suppress(*DB_ERRORS, TimeoutError):
            await asyncio.wait_for(self.update_gauges(), 2)
        return published

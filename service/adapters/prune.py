"""Retention: the one pruner of every table that only grows (SPEC §5 "retention").

What goes, and when (each retention is a setting, README "Retention"):

* ``modifications``: ``COMPLETED`` rows ``INGEST_RETENTION_DAYS`` after ``completed_at``,
  with their ``retry_attempts`` row; never ``IN_PROGRESS``; never a request whose id a
  dead letter carries while the letter is unreplayed or was replayed less than
  ``INGEST_DEAD_LETTER_RETENTION_DAYS`` ago (``dlq replay`` of that letter must meet it and
  be a duplicate, not apply it a second time — also while the replayed copy may still be
  in the queue, which that retention outlasts). Each delete also folds the deleted entity
  modifications into ``entity_checkpoints``, so reconciliation replays the same state.
* ``retry_attempts``: counts not touched for ``INGEST_RETENTION_DAYS`` (a message that
  stopped coming back).
* ``dead_letters``: replayed ones, ``INGEST_DEAD_LETTER_RETENTION_DAYS`` after the replay;
  unreplayed ones stay until somebody looks at them.
* ``reconciliation_discrepancies`` then ``reconciliation_runs``:
  ``INGEST_RECONCILE_RETENTION_DAYS`` after the run finished — by a role that may write
  them (the owner, running ``sqs-ingest prune``); the app role may not (the checker's
  evidence is the reconcile role's), so its passes skip them, and the reconcile job
  deletes its own runs past that retention after each run.
* ``workers``: ``INGEST_WORKER_RETENTION_DAYS`` after the last heartbeat, claims released.
* ``outbox``: published rows ``INGEST_RESULTS_RETENTION_DAYS`` after publication.
* ``payload_refusals``: a pointer's row ``INGEST_RETENTION_DAYS`` after S3 last refused it.
  Every refusal moves ``last_refused_at``, so a pointer S3 still refuses is never due; one
  not refused for that long belongs, as a rule, to a message the queue no longer holds
  (the same check as for ``modifications``). The row only times a refusal: if its message
  does come back (copies that met only S3 outages meanwhile, a ``dlq replay`` of its
  ``payload_unreadable`` letter), the next refusal starts the clock again, and the message
  is dead-lettered ``INGEST_S3_UNREADABLE_AFTER`` later instead of at once — nothing is
  lost or applied twice. ``last_refused_at``, not ``first_refused_at``: a pointer refused
  for longer than the retention would otherwise lose its clock while still refused. Last
  step: a database whose grants predate it (no DELETE: ``deploy/sql/roles.sql`` not run
  again) still has every other table pruned before the pass fails on it.

Exactly-once depends on the first one: a request deleted while SQS can still deliver it
again would be applied again. ``service.core.retention.check_retention`` refuses any retention
that does not exceed the queue's ``MessageRetentionPeriod`` (the daemon at start, before
each pass, and ``sqs-ingest prune``: ``service.ops.prune_command``).

This module is the data access of a pass (asyncpg); the rule is ``service.core.retention``.

How: batches of ``INGEST_PRUNE_BATCH_SIZE`` rows, each one statement in its own transaction,
picked oldest first by an index (migration 004; 006's for ``payload_refusals``) with ``FOR
UPDATE SKIP LOCKED``; ``INGEST_PRUNE_PAUSE`` seconds between batches. A pass is resumable
by construction: it keeps no state, so an interrupted one simply continues where the next
one starts.

One pruner at a time across replicas: a session advisory lock (``pg_try_advisory_lock``) on
the pass's own connection. A second pruner does not wait: it skips the pass. The lock goes
with the connection, so a pruner killed mid-pass never leaves it taken (a lease row would
need an expiry and a clock). Behind a transaction-mode pooler (pgbouncer) session locks do
not hold: point the daemon at the database directly, as migrations already require.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import asyncpg
import structlog

from service.adapters.pgerrors import translate
from service.adapters.sql import queries
from service.core.labels import PRUNED_TABLES
from service.core.retention import DAY
from service.observe import metrics
from service.settings import Settings

log = structlog.get_logger("sqs_ingest.prune")

Q = queries()

#: Distinct from the migration (0x5151_1E57) and reconcile (0x5151_2EC0) locks.
PRUNE_LOCK_KEY = 0x5151_9A7E
#: Every table the pruner deletes from: one ``sqs_ingest_pruned_rows_total`` series each.
TABLES = PRUNED_TABLES

@dataclass(frozen=True)
class Step:
    """One table's delete: ``statement($1 = retention seconds, $2 = batch size)`` (for
    ``modifications`` also ``$3``: the dead-letter retention, which pins requests)."""

    table: str
    statement: str
    count: str
    retention: Callable[[Settings], float]  # days


STEPS = (
    # First: what the exactly-once promise is about (and it also empties retry_attempts).
    Step("modifications", "prune_modifications", "prune_count_modifications",
         lambda s: s.retention_days),
    Step("retry_attempts", "prune_retry_attempts", "prune_count_retry_attempts",
         lambda s: s.retention_days),
    Step("dead_letters", "prune_dead_letters", "prune_count_dead_letters",
         lambda s: s.dead_letter_retention_days),
    # Discrepancies before their runs: the runs' cascade would take a run's in one go.
    Step("reconciliation_discrepancies", "prune_reconciliation_discrepancies",
         "prune_count_reconciliation_discrepancies", lambda s: s.reconcile_retention_days),
    Step("reconciliation_runs", "prune_reconciliation_runs", "prune_count_reconciliation_runs",
         lambda s: s.reconcile_retention_days),
    Step("workers", "prune_workers", "prune_count_workers", lambda s: s.worker_retention_days),
    Step("outbox", "outbox_prune", "prune_count_outbox", lambda s: s.results_retention_days),
    # Last: it needs the newest grant (DELETE, roles.sql), so a database whose grants
    # predate it has every other table pruned before the pass fails here.
    Step("payload_refusals", "prune_payload_refusals", "prune_count_payload_refusals",
         lambda s: s.retention_days),
)


#: Written by the reconcile role alone (deploy/sql/roles.sql).
RECONCILE_TABLES = frozenset({"reconciliation_discrepancies", "reconciliation_runs"})


async def delete_batch(conn: asyncpg.Connection, step: Step, settings: Settings,
                       limit: int) -> dict[str, int]:
    """One batch of ``step`` on ``conn`` (the caller owns the transaction): rows deleted
    per table. Tests call it inside their own transaction to hold a batch open."""
    seconds = step.retention(settings) * DAY
    if step.table == "modifications":
        row = await conn.fetchrow(Q[step.statement], seconds, limit,
                                  settings.dead_letter_retention_days * DAY)
        return {"modifications": int(row["modifications"]),
                "retry_attempts": int(row["retry_attempts"])}
    status = await conn.execute(Q[step.statement], seconds, limit)
    return {step.table: int(status.split()[-1])}


async def count_due(conn: asyncpg.Connection, settings: Settings) -> dict[str, int]:
    """What a pass would delete now (``--dry-run``): read only, no lock taken. The retry
    rows a pass deletes with their requests are not counted (completion clears them, so
    there are next to none)."""
    counts: dict[str, int] = {}
    for step in STEPS:
        pins = (settings.dead_letter_retention_days * DAY,) if step.table == "modifications" \
            else ()
        counts[step.table] = int(await conn.fetchval(
            Q[step.count], step.retention(settings) * DAY, *pins))
    return counts


@contextlib.asynccontextmanager
async def _connection(db: asyncpg.Pool | str) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(db, str):
        conn = await asyncpg.connect(db, command_timeout=300)
        try:
            yield conn
        finally:
            await conn.close(timeout=5)
    else:
        async with db.acquire() as conn:
            yield conn


async def prune_once(
    db: asyncpg.Pool | str,
    settings: Settings,
    *,
    dry_run: bool = False,
    stop: asyncio.Event | None = None,
) -> dict[str, int] | None:
    """One pass over every table: rows deleted per table (with ``dry_run``, rows that
    would be). ``None`` when another pruner holds the lock (nothing done).

    ``db``: a DSN (the pass opens and closes its own connection: the daemon's pools stay
    free) or a pool (one connection is held for the pass). ``stop`` ends the pass between
    batches. Batch size and pause: ``settings.prune_batch_size`` / ``prune_pause``.

    The driver's errors leave as ``service.errors`` (``DatabaseUnavailable``,
    ``DatabaseError``), the driver's own as their cause.
    """
    try:
        async with _connection(db) as conn:
            if dry_run:
                return await count_due(conn, settings)
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", PRUNE_LOCK_KEY):
                log.info("prune_skipped", reason="another pruner holds the lock")
                return None
            try:
                return await _pass(conn, settings, stop)
            finally:
                await _unlock(conn)
    except Exception as exc:
        ours = translate(exc)
        if ours is None:
            raise
        raise ours from exc


async def _unlock(conn: asyncpg.Connection) -> None:
    """Give the lock back; if the session cannot (a pass cancelled mid-statement), end
    it: the lock goes with it, and a pooled connection never keeps it."""
    if conn.is_closed():
        return
    try:
        await conn.execute("SELECT pg_advisory_unlock($1)", PRUNE_LOCK_KEY)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
        conn.terminate()


async def _pass(conn: asyncpg.Connection, settings: Settings,
                stop: asyncio.Event | None) -> dict[str, int]:
    totals: dict[str, int] = dict.fromkeys(TABLES, 0)
    limit = settings.prune_batch_size
    started = time.monotonic()
    for step in STEPS:
        if step.table in RECONCILE_TABLES and not await conn.fetchval(
                "SELECT has_table_privilege($1, 'DELETE') AND has_table_privilege($1, 'UPDATE')",
                step.table):
            continue  # the reconcile role's evidence (roles.sql): its job prunes it
        while stop is None or not stop.is_set():
            async with conn.transaction():
                deleted = await delete_batch(conn, step, settings, limit)
            for table, n in deleted.items():
                totals[table] += n
                if n:
                    metrics.pruned_rows.labels(table).inc(n)
            if deleted[step.table] < limit:
                break  # the rest is younger (or locked: next pass)
            if settings.prune_pause:
                await asyncio.sleep(settings.prune_pause)
    log.info("pruned", seconds=round(time.monotonic() - started, 3),
             **{t: n for t, n in totals.items() if n})
    return totals

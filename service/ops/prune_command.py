"""``sqs-ingest prune [--dry-run]``: the retention safety check against the live queue, one
pass (``service.adapters.prune``), a line per table."""

from __future__ import annotations

import sys

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from service.adapters import prune
from service.adapters.sqs import SqsQueue, sqs_client
from service.core.retention import (
    RetentionRefused,
    check_retention,
    queue_retention,
    safe_without_queue,
)
from service.errors import DB_ERRORS, TransientError, driver_error
from service.secrets import safe
from service.settings import Settings

log = structlog.get_logger("sqs_ingest.prune")


async def _ask_queue(settings: Settings) -> int:
    async with sqs_client(settings.aws_region, settings.sqs_endpoint_url) as client:
        return queue_retention(await SqsQueue(client, settings.queue_url).attributes())


async def command(settings: Settings, dry_run: bool, queue_url_set: bool = True) -> int:
    """``sqs-ingest prune [--dry-run]``: the safety check, one pass, a line per table.

    The queue cannot be asked (unset, unreachable, gone): a retention above SQS's maximum
    MessageRetentionPeriod (14 days) is safe whatever the queue says, so the pass runs, with
    a warning; a shorter one cannot be proven safe, so nothing is deleted (exit 1)."""
    try:
        if not queue_url_set:
            raise TransientError("INGEST_QUEUE_URL is not set")
        check_retention(settings, await _ask_queue(settings))
    except RetentionRefused as exc:
        print(safe(f"sqs-ingest: {exc}"), file=sys.stderr)
        return 2
    except (TransientError, BotoCoreError, ClientError, OSError) as exc:  # cannot ask
        if not safe_without_queue(settings):
            print(safe(f"sqs-ingest: prune refused: cannot read the queue's "
                       f"MessageRetentionPeriod ({type(exc).__name__}: {str(exc)[:300]}) and "
                       f"INGEST_RETENTION_DAYS / INGEST_DEAD_LETTER_RETENTION_DAYS do not exceed"
                       f" SQS's maximum (14 days)"), file=sys.stderr)
            return 1
        log.warning("prune_queue_unchecked", error=f"{type(exc).__name__}: {str(exc)[:300]}",
                    reason="retentions exceed SQS's maximum MessageRetentionPeriod")
    try:
        counts = await prune.prune_once(settings.database_dsn, settings, dry_run=dry_run)
    except DB_ERRORS as failed:  # the driver's error is the cause (service.adapters.pgerrors)
        cause = driver_error(failed)
        print(safe(f"sqs-ingest: prune failed on {settings.database_redacted}: "
                   f"{type(cause).__name__}: {cause}"), file=sys.stderr)
        return 1
    if counts is None:
        print("another pruner holds the lock (a daemon replica or a prune run): nothing done")
        return 0
    verb = "would delete" if dry_run else "deleted"
    for table in prune.TABLES:
        print(f"{table:<30} {counts[table]:>12}")
    print(f"{verb} {sum(counts.values())} row(s)")
    return 0

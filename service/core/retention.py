"""The retention safety rule (pure): every retention that keeps a redelivery out must exceed
the queue's ``MessageRetentionPeriod``, or SQS could redeliver a request after it was pruned
and it would be applied again. Checked by the daemon at start and before each prune pass
(``service.runtime.maintenance``) and by ``sqs-ingest prune`` (``service.ops.prune_command``)."""

from __future__ import annotations

from service.errors import RetentionRefused
from service.settings import Settings

__all__ = ["DAY", "SQS_MAX_RETENTION", "RetentionRefused", "check_retention",
           "queue_retention", "safe_without_queue"]

DAY = 86_400.0
#: The longest MessageRetentionPeriod SQS accepts (14 days): a retention above it is safe
#: whatever the queue says, so ``prune`` may go on when the queue cannot be asked.
SQS_MAX_RETENTION = 1_209_600


def check_retention(settings: Settings, queue_retention_seconds: int) -> None:
    """Raise RetentionRefused unless every retention that keeps a redelivery out exceeds
    the queue's ``MessageRetentionPeriod``: ``INGEST_RETENTION_DAYS`` (the request is the
    duplicate check) and ``INGEST_DEAD_LETTER_RETENTION_DAYS`` (the dead letter is what
    keeps a dead-lettered message from being applied if SQS delivers it again)."""
    for var, days in (("INGEST_RETENTION_DAYS", settings.retention_days),
                      ("INGEST_DEAD_LETTER_RETENTION_DAYS", settings.dead_letter_retention_days)):
        if days * DAY <= queue_retention_seconds:
            raise RetentionRefused(
                f"configuration error: {var}={days:g} ({days * DAY:.0f} s) does not exceed "
                f"the queue's MessageRetentionPeriod={queue_retention_seconds} s "
                f"({queue_retention_seconds / DAY:g} days): SQS could redeliver a request "
                f"after it was pruned; set {var} above {queue_retention_seconds / DAY:g}")


def safe_without_queue(settings: Settings) -> bool:
    """True when no SQS queue can hold a message as long as the retentions: the check
    holds whatever the queue's own MessageRetentionPeriod."""
    return min(settings.retention_days, settings.dead_letter_retention_days) * DAY \
        > SQS_MAX_RETENTION


def queue_retention(attrs: dict[str, str]) -> int:
    """The queue's MessageRetentionPeriod (seconds); SQS's maximum if it does not say."""
    return int(attrs.get("MessageRetentionPeriod", SQS_MAX_RETENTION))

"""The error hierarchy: what is permanent (dead-letter), transient (retry) or fatal."""

from __future__ import annotations


class IngestError(Exception):
    """Base of sqs-ingest's own errors."""


class TransientError(IngestError):
    """Retry later: the message stays on the queue."""


class DatabaseUnavailable(TransientError):
    """PostgreSQL cannot be reached; stop receiving until it comes back."""


class AckFailed(IngestError):
    """DeleteMessage(Batch) failed after the outcome was committed.

    Fatal on purpose (exit 3): swallowing it leaves the message on the queue with its
    effect already committed; only a restart (which runs orphan GC) makes that safe.
    """

    def __init__(self, message_ids: list[str], detail: str) -> None:
        super().__init__(f"ack failed for {len(message_ids)} message(s): {detail}")
        self.message_ids = message_ids
        self.detail = detail


class RetentionRefused(Exception):
    """A retention a redelivery could outlive: exit 2 with this one line."""

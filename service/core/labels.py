"""Every value a metric label takes, in one leaf module (no imports from ``service``).

``service.observe.metrics`` creates each labelled series at 0 from these sets (``prime``); the
modules that count import the names they count with from here, so a new value is added
once, where the dashboard, the alerts and the tests read it.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

#: ``messages_processed_total{type}`` of a message whose type is unknown or unreadable.
INVALID_TYPE_LABEL: Final = "_invalid"

#: ``messages_processed_total{outcome}`` (SPEC §1).
Outcome = Literal["completed", "duplicate", "dead_lettered", "retried"]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

#: ``dead_letters_total{reason}``: every reason a dead letter is stored with.
DeadLetterReason = Literal[
    "invalid_json", "invalid_envelope", "missing_request_id", "missing_type", "unknown_type",
    "invalid_payload", "request_id_too_long", "type_too_long", "idempotency_key_reused",
    "max_receives_exceeded", "rejected_by_database", "processing_error",
    "payload_object_missing", "payload_too_large", "payload_bucket_not_allowed",
    "payload_unreadable", "payload_too_complex",
]
DEAD_LETTER_REASONS: tuple[DeadLetterReason, ...] = get_args(DeadLetterReason)

#: ``s3_fetches_total{outcome}``.
FetchOutcome = Literal["fetched", "missing", "too_large", "error"]
FETCH_OUTCOMES: tuple[FetchOutcome, ...] = get_args(FetchOutcome)

#: ``s3_errors_total{kind}``: a small, fixed set of S3 failure kinds.
S3ErrorKind = Literal["access_denied", "throttled", "server", "client", "network"]
ERROR_KINDS: tuple[S3ErrorKind, ...] = get_args(S3ErrorKind)

#: ``s3_deletes_total{outcome}``.
DeleteOutcome = Literal["deleted", "failed"]
DELETE_OUTCOMES: tuple[DeleteOutcome, ...] = get_args(DeleteOutcome)

#: ``pruned_rows_total{table}``: every table the pruner deletes from (``service.adapters.prune``).
PrunedTable = Literal[
    "modifications", "retry_attempts", "dead_letters", "reconciliation_discrepancies",
    "reconciliation_runs", "workers", "outbox", "payload_refusals",
]
PRUNED_TABLES: tuple[PrunedTable, ...] = get_args(PrunedTable)

#: ``sqs_errors_total{operation}``.
SqsOperation = Literal["receive", "change_visibility", "requeue", "get_queue_attributes"]
SQS_OPERATIONS: tuple[SqsOperation, ...] = get_args(SqsOperation)

#: ``aws_requests_total{service="sqs", operation}``: the actions of the daemon's own loops, the
#: series that exist from the start (any other action's appears at its first request).
SqsLoopAction = Literal[
    "ReceiveMessage", "DeleteMessageBatch", "ChangeMessageVisibilityBatch", "GetQueueAttributes"]
SQS_LOOP_ACTIONS: tuple[SqsLoopAction, ...] = get_args(SqsLoopAction)

#: ``results_published_total{status}``: a result's status (SPEC §5).
ResultStatus = Literal["COMPLETED", "FAILED"]
RESULT_STATUSES: tuple[ResultStatus, ...] = get_args(ResultStatus)

"""``sqs-ingest redrive [--dry-run]``: moves what is in the queue's own dead-letter queue (its
``RedrivePolicy``) back to the source queue with ``StartMessageMoveTask`` and reports
progress.

What the policy means for the daemon lives in ``service.core.retry`` (``RedrivePolicy``,
``ReceiveLimit``):

- ``ReceiveLimit``: SQS moves a message to the policy's dead-letter queue on the receive
  after ``maxReceiveCount``. The daemon must dead-letter an always-failing message itself
  before that (into ``dead_letters``, where ``dlq list``/``dlq replay`` see it), so its
  failure limit is ``min(INGEST_MAX_RECEIVE_COUNT, maxReceiveCount)`` and a failure on the
  last receive SQS allows is final. The policy is read at start and with every periodic
  GetQueueAttributes (``service.runtime.maintenance``): one shared object, so a policy changed on
  the queue takes effect without a restart.
- The deferral rule (``ReceiveLimit.must_requeue``): a message handed back for a reason
  that is not its fault (contention, database outage, shutdown) still spends a receive.
  When that would leave SQS fewer receives than the daemon's tries, the daemon sends a
  fresh copy (new receive count) and deletes the original instead (``SqsQueue.requeue``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from service.adapters.sqs import sqs_client
from service.core.retry import RedrivePolicy

log = structlog.get_logger("sqs_ingest.redrive")

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
TERMINAL = ("COMPLETED", "CANCELLED", "FAILED")


# -- sqs-ingest redrive ------------------------------------------------------------------


def queue_name_of(arn: str) -> tuple[str, str]:
    """(queue name, account id) of ``arn:aws:sqs:REGION:ACCOUNT:NAME``."""
    parts = arn.split(":")
    if len(parts) != 6 or parts[2] != "sqs":
        raise ValueError(f"not an SQS queue ARN: {arn}")
    return parts[5], parts[4]


async def redrive(
    client: Any, queue_url: str, dry_run: bool, out: Callable[[str], None] = print,
    poll_seconds: float = 1.0, follow_for: float | None = None,
) -> int:
    """Move the source queue's dead-letter queue back into it; returns the exit code."""
    try:
        attrs = (await client.get_queue_attributes(
            QueueUrl=queue_url, AttributeNames=["QueueArn", "RedrivePolicy"]))["Attributes"]
    except (ClientError, BotoCoreError) as exc:
        print(f"sqs-ingest: redrive failed: GetQueueAttributes on {queue_url}: {exc}",
              file=sys.stderr)
        return EXIT_FAILED
    policy = RedrivePolicy.from_attributes(attrs)
    if policy is None:
        print(f"sqs-ingest: redrive refused: {queue_url} has no RedrivePolicy, so there is "
              "no dead-letter queue to move messages from", file=sys.stderr)
        return EXIT_REFUSED
    source_arn, dlq_arn = attrs["QueueArn"], policy.dead_letter_target_arn
    try:
        name, account = queue_name_of(dlq_arn)
        dlq_url = (await client.get_queue_url(
            QueueName=name, QueueOwnerAWSAccountId=account))["QueueUrl"]
        dlq = (await client.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=[
            "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]))["Attributes"]
    except (ValueError, ClientError, BotoCoreError) as exc:
        print(f"sqs-ingest: redrive failed: dead-letter queue {dlq_arn}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    waiting = int(dlq.get("ApproximateNumberOfMessages", "0"))
    hidden = int(dlq.get("ApproximateNumberOfMessagesNotVisible", "0"))
    out(f"dead-letter queue: {dlq_arn} ({dlq_url})")
    out(f"messages: {waiting} visible, {hidden} in flight; maxReceiveCount "
        f"{policy.max_receive_count}")
    if dry_run:
        out(f"dry run: would move {waiting} message(s) from {dlq_arn} to {source_arn} "
            "(StartMessageMoveTask); nothing changed")
        return EXIT_OK
    if waiting == 0 and hidden == 0:
        out("nothing to move")
        return EXIT_OK
    try:
        handle = (await client.start_message_move_task(
            SourceArn=dlq_arn, DestinationArn=source_arn))["TaskHandle"]
    except (ClientError, BotoCoreError) as exc:
        print(f"sqs-ingest: redrive failed: StartMessageMoveTask: {exc}", file=sys.stderr)
        return EXIT_FAILED
    out(f"move task started: {dlq_arn} -> {source_arn} ({handle})")
    return await _follow(client, dlq_arn, out, poll_seconds, follow_for)


async def _follow(
    client: Any, dlq_arn: str, out: Callable[[str], None], poll_seconds: float,
    follow_for: float | None,
) -> int:
    """Poll ListMessageMoveTasks (newest first: ours, since a source queue runs one task
    at a time) and print each change of progress until the task ends."""
    deadline = None if follow_for is None else time.monotonic() + follow_for
    last: tuple[object, ...] | None = None
    while True:
        try:
            results = (await client.list_message_move_tasks(
                SourceArn=dlq_arn, MaxResults=1)).get("Results") or []
        except (ClientError, BotoCoreError) as exc:
            print(f"sqs-ingest: redrive: ListMessageMoveTasks failed: {exc} (the task goes "
                  "on; run redrive --dry-run to see what is left)", file=sys.stderr)
            return EXIT_FAILED
        if results:
            task = results[0]
            status = str(task.get("Status"))
            moved = task.get("ApproximateNumberOfMessagesMoved", 0)
            total = task.get("ApproximateNumberOfMessagesToMove", "?")
            now = (status, moved, total)
            if now != last:
                out(f"moved {moved}/{total} ({status})")
                last = now
            if status in TERMINAL:
                if status == "COMPLETED":
                    return EXIT_OK
                print(f"sqs-ingest: redrive {status.lower()}: "
                      f"{task.get('FailureReason') or 'no reason given'}", file=sys.stderr)
                return EXIT_FAILED
        if deadline is not None and time.monotonic() > deadline:
            print("sqs-ingest: redrive: stopped following the task (timeout); it goes on",
                  file=sys.stderr)
            return EXIT_FAILED
        await asyncio.sleep(poll_seconds)


async def main(settings: Any, dry_run: bool) -> int:
    """``sqs-ingest redrive [--dry-run]`` on ``INGEST_QUEUE_URL``."""
    async with sqs_client(settings.aws_region, settings.sqs_endpoint_url) as client:
        return await redrive(client, settings.queue_url, dry_run)

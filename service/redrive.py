"""The queue's own dead-letter queue (its ``RedrivePolicy``).

Three things follow from it:

- ``ReceiveLimit``: SQS moves a message to the policy's dead-letter queue on the receive
  after ``maxReceiveCount``. The daemon must dead-letter an always-failing message itself
  before that (into ``dead_letters``, where ``dlq list``/``dlq replay`` see it), so its
  failure limit is ``min(INGEST_MAX_RECEIVE_COUNT, maxReceiveCount)`` and a failure on the
  last receive SQS allows is final. The policy is read at start and with every periodic
  GetQueueAttributes (``service.maintenance``): one shared object, so a policy changed on
  the queue takes effect without a restart.
- The deferral rule (``ReceiveLimit.must_requeue``): a message handed back for a reason
  that is not its fault (contention, database outage, shutdown) still spends a receive.
  When that would leave SQS fewer receives than the daemon's tries, the daemon sends a
  fresh copy (new receive count) and deletes the original instead (``SqsQueue.requeue``).
- ``sqs-ingest redrive [--dry-run]``: moves what is in that dead-letter queue back to the
  source queue with ``StartMessageMoveTask`` and reports progress.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from botocore.exceptions import BotoCoreError, ClientError

from service import metrics

log = structlog.get_logger("sqs_ingest.redrive")

EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
TERMINAL = ("COMPLETED", "CANCELLED", "FAILED")


@dataclass(frozen=True, slots=True)
class RedrivePolicy:
    """The queue attribute ``RedrivePolicy``: where SQS moves a message, and after how many
    receives."""

    dead_letter_target_arn: str
    max_receive_count: int

    @classmethod
    def from_attributes(cls, attributes: Mapping[str, str]) -> RedrivePolicy | None:
        """None when the queue has no policy (or one this daemon cannot read: logged)."""
        raw = attributes.get("RedrivePolicy")
        if not raw:
            return None
        try:
            doc = json.loads(raw)
            # SQS returns maxReceiveCount as a number; some tools store it as a string.
            return cls(str(doc["deadLetterTargetArn"]), int(doc["maxReceiveCount"]))
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("redrive_policy_unreadable", value=raw[:300], error=repr(exc))
            return None


class ReceiveLimit:
    """The daemon's dead-letter limit as it stands now, shared by the batch path (which
    reads it) and maintenance (which updates it from the queue's attributes)."""

    def __init__(self, configured: int, fifo: bool = False) -> None:
        self.configured = configured  # INGEST_MAX_RECEIVE_COUNT
        self.fifo = fifo
        self.policy: RedrivePolicy | None = None
        metrics.receive_limit.set(configured)

    @property
    def max_failures(self) -> int:
        """Handler failures before the daemon dead-letters a message."""
        if self.policy is None:
            return self.configured
        return min(self.configured, self.policy.max_receive_count)

    def last_receive(self, receive_count: int) -> bool:
        """SQS moves this message to its dead-letter queue if it is received again."""
        return self.policy is not None and receive_count >= self.policy.max_receive_count

    def exhausted(self, failures: int, receive_count: int) -> bool:
        """A handler failure that must be final: the limit, or SQS's last receive."""
        return failures >= self.max_failures or self.last_receive(receive_count)

    def must_requeue(self, receive_count: int) -> bool:
        """A message handed back through no fault of its own (contention, outage, shutdown):
        True when a plain hand-back would leave SQS fewer receives than the daemon's tries,
        so a fresh copy has to replace it. FIFO: only when the next receive would move it
        (a copy goes behind its group's later messages; order yields only to data loss)."""
        if self.policy is None:
            return False
        left = self.policy.max_receive_count - receive_count
        if self.fifo:
            return left <= 0
        return left < self.max_failures

    def update(self, attributes: Mapping[str, str]) -> None:
        """Take the policy from GetQueueAttributes; say so in the log when it changed."""
        policy = RedrivePolicy.from_attributes(attributes)
        if policy == self.policy:
            return
        before, self.policy = self.policy, policy
        metrics.receive_limit.set(self.max_failures)
        if policy is None:
            log.info("redrive_policy_removed", max_failures=self.max_failures)
        elif policy.max_receive_count < self.configured:
            log.warning(
                "receive_limit_lowered_by_redrive_policy",
                configured=self.configured, max_receive_count=policy.max_receive_count,
                max_failures=self.max_failures, dead_letter_queue=policy.dead_letter_target_arn,
                hint="INGEST_MAX_RECEIVE_COUNT is above the queue's maxReceiveCount: the "
                     "daemon dead-letters on the last receive SQS allows")
        else:
            log.info("redrive_policy", max_receive_count=policy.max_receive_count,
                     max_failures=self.max_failures,
                     dead_letter_queue=policy.dead_letter_target_arn, changed=before is not None)


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
    from service.sqs import sqs_client

    async with sqs_client(settings.aws_region, settings.sqs_endpoint_url) as client:
        return await redrive(client, settings.queue_url, dry_run)

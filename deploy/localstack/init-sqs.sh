#!/bin/sh
# LocalStack "ready" hook (mounted into /etc/localstack/init/ready.d/): creates the
# queue the daemon drains. Idempotent: CreateQueue with identical attributes is a no-op,
# so a restarted LocalStack container runs it again harmlessly.
set -eu

QUEUE_NAME="${INGEST_QUEUE_NAME:-sqs-ingest}"

awslocal sqs create-queue \
    --queue-name "$QUEUE_NAME" \
    --attributes VisibilityTimeout=60,ReceiveMessageWaitTimeSeconds=20

echo "queue ready: $(awslocal sqs get-queue-url --queue-name "$QUEUE_NAME" --output text)"

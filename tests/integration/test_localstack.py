"""The LocalStack fixture serves what the realistic tests rely on: SQS redrive to a DLQ,
SNS → SQS delivery and S3 objects — checked once here so a broken emulator install fails
with a clear message instead of inside a daemon test."""

from __future__ import annotations

import json
import uuid

import boto3

from tests.servers import wait_until


def _client(service: str, endpoint: str):
    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1")


def test_sqs_moves_a_message_to_the_dlq_after_max_receive_count(localstack: str) -> None:
    sqs = _client("sqs", localstack)
    tag = uuid.uuid4().hex[:10]
    dlq = sqs.create_queue(QueueName=f"dlq-{tag}")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    src = sqs.create_queue(QueueName=f"src-{tag}", Attributes={
        "VisibilityTimeout": "0",
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": "2"}),
    })["QueueUrl"]
    sqs.send_message(QueueUrl=src, MessageBody="x")
    for _ in range(2):
        wait_until(lambda: sqs.receive_message(QueueUrl=src, WaitTimeSeconds=1).get("Messages"),
                   30, "a receive")

    def in_dlq() -> bool:
        sqs.receive_message(QueueUrl=src, WaitTimeSeconds=0)  # the third receive moves it
        got = sqs.receive_message(QueueUrl=dlq, WaitTimeSeconds=0).get("Messages", [])
        return bool(got) and got[0]["Body"] == "x"

    wait_until(in_dlq, 30, "the message in the DLQ")


def test_sns_delivers_to_sqs_and_s3_stores_objects(localstack: str) -> None:
    sqs, sns, s3 = (_client(s, localstack) for s in ("sqs", "sns", "s3"))
    tag = uuid.uuid4().hex[:10]
    q = sqs.create_queue(QueueName=f"sub-{tag}")["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=q, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    topic = sns.create_topic(Name=f"t-{tag}")["TopicArn"]
    sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=arn,
                  Attributes={"RawMessageDelivery": "true"})
    sns.publish(TopicArn=topic, Message="hello")
    got = wait_until(lambda: sqs.receive_message(QueueUrl=q, WaitTimeSeconds=1).get("Messages"),
                     15, "the SNS delivery")
    assert got[0]["Body"] == "hello"

    s3.create_bucket(Bucket=f"b-{tag}")
    s3.put_object(Bucket=f"b-{tag}", Key="k", Body=b"payload")
    assert s3.get_object(Bucket=f"b-{tag}", Key="k")["Body"].read() == b"payload"

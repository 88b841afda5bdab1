"""What a sender cannot make the daemon do with S3 (issue 20), on LocalStack (SQS, S3) in
host mode with the real daemon process and PostgreSQL, S3 reached through a small proxy
that records every request and refuses reads as a bucket policy or a disabled KMS key
would (403 AccessDenied):

- a pointer to a bucket outside ``INGEST_S3_BUCKETS`` is dead-lettered on its first
  receive, byte for byte, and its object — which exists — is never requested.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import asyncpg
from aiohttp import web

from tests.acceptance.harness import Daemon, daemon_env
from tests.acceptance.test_extended_clients import (
    CURRENT,
    HANDLERS,
    Producers,
    make_queue,
    upsert,
    wait_for,
)
from tests.faultproxy import FaultProxy


class S3Gate(FaultProxy):
    """S3 in front of LocalStack: records each request's path; answers 403 AccessDenied to
    the reads of keys containing one of ``refuse`` (every read while ``refuse_all``)."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.paths: list[str] = []
        self.refuse: set[str] = set()
        self.refuse_all = False
        self.refused = 0

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(f"{request.method} {request.path}")
        if request.method == "GET" and (self.refuse_all or any(
                k in request.path for k in self.refuse)):
            self.refused += 1
            return web.Response(status=403, content_type="application/xml", text=(
                "<?xml version='1.0' encoding='UTF-8'?><Error><Code>AccessDenied</Code>"
                "<Message>injected: Access Denied</Message></Error>"))
        return await super()._serve(request)


def pointer(bucket: str, key: str) -> str:
    return json.dumps([CURRENT, {"s3BucketName": bucket, "s3Key": key}])


async def test_a_pointer_to_a_bucket_outside_the_allow_list_is_never_read(
    database_url: str, localstack: str, spawn: Callable[..., Daemon],
) -> None:
    tag = uuid.uuid4().hex[:10]
    p = Producers(localstack, f"allowed-{tag}")
    other = f"other-{tag}"
    p.s3.create_bucket(Bucket=other)
    url, _ = make_queue(p.plain_sqs)
    body, _ = upsert("r-other", "e-other", 2_000, 1)
    p.s3.put_object(Bucket=other, Key="k-other", Body=body.encode())  # exists, readable
    body, kept = upsert("r-ok", "e-ok", 2_000, 2)
    p.s3.put_object(Bucket=p.bucket, Key="k-ok", Body=body.encode())
    refused = pointer(other, "k-other")
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=refused)
    p.plain_sqs.send_message(QueueUrl=url, MessageBody=pointer(p.bucket, "k-ok"))
    with S3Gate(localstack) as s3:
        d = spawn(daemon_env(database_url, url, localstack, INGEST_HANDLERS=HANDLERS,
                             INGEST_S3_ENDPOINT_URL=s3.url, INGEST_S3_BUCKETS=p.bucket))
        conn = await asyncpg.connect(database_url)
        try:
            await wait_for(conn, "SELECT count(*) FROM dead_letters", 1, "the dead letter", d)
            await wait_for(conn, "SELECT count(*) FROM entities", 1, "the allowed one", d)
            rows = await conn.fetch("SELECT reason, body, receive_count, error FROM dead_letters")
            assert [(r["reason"], r["body"], r["receive_count"]) for r in rows] == [
                ("payload_bucket_not_allowed", refused, 1)]  # byte for byte, first receive
            assert "INGEST_S3_BUCKETS" in rows[0]["error"]
            assert json.loads(await conn.fetchval(
                "SELECT data FROM entities WHERE entity_id = 'e-ok'")) == kept
            assert await conn.fetchval(
                "SELECT count(*) FROM entities WHERE entity_id = 'e-other'") == 0
        finally:
            await conn.close()
        assert d.stop() == 0
    assert [x for x in s3.paths if other in x] == [], s3.paths  # never requested
    assert any(f"/{p.bucket}/k-ok" in x for x in s3.paths), s3.paths



"""``S3Payloads`` with the real aiobotocore S3 client against LocalStack's S3: what S3
itself answers (codes, lengths, checksums), which the fakes of tests/unit only imitate."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import boto3
import pytest
from aiobotocore.session import get_session

from service.adapters.payloads import S3Payloads, s3_client
from service.core.pointers import Fetched, Pointer, Refused, Unreachable


@pytest.fixture
def bucket(localstack: str) -> str:
    name = f"payloads-{uuid.uuid4().hex[:10]}"
    s3 = boto3.client("s3", endpoint_url=localstack, region_name="us-east-1")
    s3.create_bucket(Bucket=name)
    # boto3 stores a CRC32 with each object: the daemon's read is checked against it.
    s3.put_object(Bucket=name, Key="ok", Body=b'{"request_id": "r"}' + b" " * 300_000)
    s3.put_object(Bucket=name, Key="big", Body=b"x" * 70_000)
    return name


@pytest.fixture
async def client(localstack: str) -> AsyncIterator[Any]:
    async with s3_client(get_session(), "us-east-1", localstack) as c:
        yield c


async def test_what_s3_answers_becomes_the_right_outcome(client: Any, bucket: str) -> None:
    payloads = S3Payloads(client, max_bytes=65_536, allowed=f"{bucket},no-such-{bucket}")
    assert not client.made  # no pointer yet: S3's client (and its service model) not loaded
    big = await payloads.fetch(Pointer(bucket, "big"))
    assert client.made
    assert isinstance(big, Refused) and big.reason == "payload_too_large"
    payloads.max_bytes = 1 << 20
    ok = await payloads.fetch(Pointer(bucket, "ok"))
    assert isinstance(ok, Fetched) and ok.data == b'{"request_id": "r"}' + b" " * 300_000
    for where in (Pointer(bucket, "gone"), Pointer(f"no-such-{bucket}", "k")):
        r = await payloads.fetch(where)
        assert isinstance(r, Refused) and r.reason == "payload_object_missing", r
    # The connection dropped unread by the too-large answer did not poison the pool.
    again = await payloads.fetch(Pointer(bucket, "ok"))
    assert isinstance(again, Fetched)


async def test_an_unreachable_s3_is_transient() -> None:
    from tests.servers import free_port

    async with s3_client(get_session(), "us-east-1", f"http://127.0.0.1:{free_port()}") as c:
        r = await S3Payloads(c, 1 << 20, allowed="payloads").fetch(Pointer("payloads", "k"))
    assert isinstance(r, Unreachable)


async def test_a_body_cut_off_mid_stream_is_transient() -> None:
    """S3 (or a proxy in front of it) closes the connection after part of the body: aiohttp
    raises its own ClientPayloadError, not an OSError or a BotoCoreError. Transient like
    any other S3 failure — escaping the fetch it failed the whole batch, inline neighbours
    included, and on the last receive dead-lettered healthy messages (processing_error)."""
    import asyncio

    async def cut_short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # the request's headers (GetObject has no body)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n"
                     b"Content-Type: application/octet-stream\r\n\r\n" + b"{" * 1000)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut_short, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with s3_client(get_session(), "us-east-1", f"http://127.0.0.1:{port}") as c:
            r = await S3Payloads(c, 1 << 20, allowed="payloads").fetch(Pointer("payloads", "k"))
        assert isinstance(r, Unreachable), r
    finally:
        server.close()
        await server.wait_closed()

"""What counts as permanent at start-up: only what a retry cannot fix. An outage (refused
connection, endpoint down) must keep the daemon retrying, never exit 2."""

from __future__ import annotations

import errno

import asyncpg
from botocore.exceptions import ClientError, EndpointConnectionError

from service.errors import DatabaseUnavailable, TransientError
from service.ops import diagnose


def _wrapped(exc: BaseException) -> TransientError:
    try:
        raise TransientError("GetQueueAttributes failed") from exc
    except TransientError as outer:
        return outer


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetQueueAttributes")


def test_outages_are_not_permanent() -> None:
    for exc in (ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
                DatabaseUnavailable("database unavailable"),
                _wrapped(EndpointConnectionError(endpoint_url="http://127.0.0.1:1")),
                _wrapped(_client_error("ServiceUnavailable", 503)),
                asyncpg.CannotConnectNowError("starting up")):
        assert not diagnose.is_permanent(exc), exc
    assert "INGEST_SQS_ENDPOINT_URL" in diagnose.hint(
        _wrapped(EndpointConnectionError(endpoint_url="http://127.0.0.1:1")))


def test_permanent_kinds_through_our_wrappers() -> None:
    assert diagnose.kind(_wrapped(_client_error("AWS.SimpleQueueService.NonExistentQueue",
                                                400))) == "queue_missing"
    assert diagnose.kind(_wrapped(_client_error("403", 403))) == "aws_credentials_rejected"
    assert diagnose.kind(asyncpg.InvalidPasswordError("no")) == "db_password"
    assert diagnose.kind(ValueError("a bug")) is None
    # An HTTP bind error is the port's; while connecting the same errno is not permanent.
    in_use = OSError(errno.EADDRINUSE, "address already in use")
    assert diagnose.kind(in_use) == "port_in_use" and not diagnose.is_permanent(in_use)


def test_suppressed_context_is_not_read() -> None:
    try:
        try:
            raise asyncpg.InvalidPasswordError("earlier, unrelated")
        except asyncpg.InvalidPasswordError:
            raise RuntimeError("a bug") from None
    except RuntimeError as exc:
        assert diagnose.kind(exc) is None

"""First contact: a start-up failure turned into one line that says what to fix.

A new user's first ``sqs-ingest run`` meets a wrong queue URL, missing credentials, a wrong
password, a port already taken. Each of those is permanent — retrying cannot fix it — so
the daemon stops with exit ``2`` (configuration) and one line naming the variable, instead
of a traceback or an endless retry loop. What a retry *can* fix (the endpoint or the
database not reachable yet: compose start order, a network blip at deploy time) keeps
retrying, and :func:`hint` adds the likely fix to each retry's warning.

The table of every line lives in the README's "Troubleshooting" section.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import asyncpg
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
)

from service.errors import IngestError, SchemaBehind
from service.secrets import safe
from service.settings import Settings

EXIT_FATAL = 1
EXIT_CONFIG = 2

_QUEUE_MISSING = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}
_BAD_CREDENTIALS = {
    "InvalidClientTokenId", "UnrecognizedClientException", "SignatureDoesNotMatch",
    "InvalidSignatureException", "IncompleteSignature", "MissingAuthenticationToken",
    "ExpiredToken", "ExpiredTokenException", "InvalidAccessKeyId",
}
_ACCESS_DENIED = {"AccessDenied", "AccessDeniedException", "AWS.SimpleQueueService.AccessDenied"}


@dataclass(frozen=True)
class Diagnosis:
    """One line for the operator, and the exit code of ``sqs-ingest run``."""

    line: str
    exit_code: int


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and what caused it (our wrappers keep the driver's error as cause)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        # As Python prints it: the explicit cause, else the context unless `from None`.
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)


def _aws_code(exc: BaseException) -> str | None:
    for e in _chain(exc):
        if isinstance(e, ClientError):
            return str(e.response.get("Error", {}).get("Code", ""))
    return None


def _aws_status(exc: BaseException) -> int | None:
    for e in _chain(exc):
        if isinstance(e, ClientError):
            return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    return None


def _found(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    return next((e for e in _chain(exc) if isinstance(e, kind)), None)


def kind(exc: BaseException) -> str | None:
    """What permanent start-up failure ``exc`` is (a key of :func:`explain`'s lines), or None
    when it is not one this module knows: transient, or a bug to surface as it is."""
    code = _aws_code(exc)
    if code in _QUEUE_MISSING:
        return "queue_missing"
    if code in _BAD_CREDENTIALS:
        return "aws_credentials_rejected"
    if code in _ACCESS_DENIED:
        return "aws_access_denied"
    if code is not None and _aws_status(exc) == 403:
        # Forbidden is never transient; emulators answer it without a parseable code.
        return "aws_credentials_rejected"
    if _found(exc, NoCredentialsError) or _found(exc, PartialCredentialsError):
        return "aws_credentials_missing"
    if _found(exc, NoRegionError):
        return "aws_region_missing"
    pg = _found(exc, asyncpg.PostgresError)
    for cls, name in _PG_KINDS:
        if isinstance(pg, cls):
            return name
    if _found(exc, SchemaBehind) is not None:
        return "schema_behind"
    os_error = _found(exc, OSError)
    if isinstance(os_error, OSError) and os_error.errno == errno.EADDRINUSE:
        return "port_in_use"
    if isinstance(os_error, OSError) and os_error.errno == errno.EACCES:
        return "port_privileged"
    return None


_PG_KINDS: tuple[tuple[type[BaseException], str], ...] = (
    (asyncpg.InvalidPasswordError, "db_password"),
    (asyncpg.InvalidAuthorizationSpecificationError, "db_login_refused"),
    (asyncpg.InvalidCatalogNameError, "db_missing"),
    (asyncpg.InsufficientPrivilegeError, "db_privilege"),
)


def explain(exc: BaseException, settings: Settings) -> Diagnosis | None:
    """The one-line diagnosis of a permanent start-up failure, or None (see :func:`kind`)."""
    k = kind(exc)
    if k is None:
        return None
    db = settings.database_redacted
    where = settings.sqs_endpoint_url or f"AWS {settings.aws_region}"
    cause = next((e for e in _chain(exc) if not isinstance(e, IngestError)), exc)
    lines = {
        "queue_missing": (
            f"INGEST_QUEUE_URL: queue {settings.queue_url} does not exist at {where}: create "
            "it, or fix INGEST_QUEUE_URL (and INGEST_AWS_REGION / INGEST_SQS_ENDPOINT_URL)"),
        "aws_credentials_rejected": (
            f"AWS credentials rejected by {where} ({_aws_code(exc)}): check AWS_ACCESS_KEY_ID /"
            " AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE, or the task role (IRSA)"),
        "aws_access_denied": (
            f"AWS credentials may not use queue {settings.queue_url} ({_aws_code(exc)}): grant "
            "the role the daemon runs as the actions of deploy/ecs/iam-policy.json"),
        "aws_credentials_missing": (
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run with a task role (ECS) / service account role (IRSA)"),
        "aws_region_missing": "no AWS region: set INGEST_AWS_REGION",
        "db_password": (
            f"INGEST_DATABASE_URL: password authentication failed for {db}: fix the user or "
            "password in INGEST_DATABASE_URL"),
        "db_login_refused": (
            f"INGEST_DATABASE_URL: PostgreSQL refused the login for {db} ({cause}): fix the "
            "user in INGEST_DATABASE_URL, or allow it in pg_hba.conf"),
        "db_missing": (
            f"INGEST_DATABASE_URL: {cause} on {db}: create it (CREATE DATABASE) and run "
            "`sqs-ingest migrate`, or fix the database name in INGEST_DATABASE_URL"),
        "db_privilege": (
            f"INGEST_DATABASE_URL: the role of {db} lacks a privilege ({cause}): grant it as "
            "in deploy/sql/roles.sql (migrate runs as the owner role, the daemon as the app "
            "role)"),
        "schema_behind": f"{_found(exc, SchemaBehind)} (database {db})",
        "port_in_use": (
            f"INGEST_HTTP_PORT: port {settings.http_port} on {settings.http_host} is already in "
            "use: stop the other process or choose another INGEST_HTTP_PORT (0 disables HTTP)"),
        "port_privileged": (
            f"INGEST_HTTP_PORT: port {settings.http_port} needs privileges the daemon does not "
            "have (it runs as a non-root user): choose a port above 1023"),
    }
    return Diagnosis(lines[k], EXIT_FATAL if k == "schema_behind" else EXIT_CONFIG)


def hint(exc: BaseException) -> str:
    """The likely fix for a failure that is retried (the service is not reachable yet)."""
    if _found(exc, EndpointConnectionError):
        return ("nothing answers at that SQS endpoint: start the emulator or fix "
                "INGEST_SQS_ENDPOINT_URL (unset = AWS in INGEST_AWS_REGION); retrying")
    if _found(exc, socket.gaierror) or _found(exc, ConnectionRefusedError) or _found(
            exc, asyncpg.CannotConnectNowError):
        return ("PostgreSQL is not accepting connections at INGEST_DATABASE_URL's host and "
                "port: start it or fix the URL; retrying")
    return "retrying"


def is_permanent(exc: BaseException) -> bool:
    """True when retrying cannot help: stop and report instead."""
    # A port error is the HTTP server's; an OSError while connecting is an outage.
    return kind(exc) not in (None, "port_in_use", "port_privileged")


def report(diagnosis: Diagnosis) -> int:
    """Print the line on stderr (the one place an operator looks first) and return the code."""
    print(safe(f"sqs-ingest: {diagnosis.line}"), file=sys.stderr, flush=True)
    return diagnosis.exit_code


def guard(settings: Settings, run: Callable[[], int]) -> int:
    """``run()``'s exit code; a permanent start-up failure escaping it becomes its one line
    and exit code instead of a traceback."""
    try:
        return run()
    except Exception as exc:
        diagnosis = explain(exc, settings)
        if diagnosis is None:
            raise
        return report(diagnosis)

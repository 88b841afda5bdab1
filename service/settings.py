"""The one settings class. Nothing else in the daemon reads ``os.environ``."""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from service import secrets

# Re-exported: ``from service.settings import ConfigError`` keeps working.
from service.errors import ConfigError as ConfigError
from service.s3access import AllowList

ENV_PREFIX = "INGEST_"
#: Connections of the daemon's control pool (heartbeat, GC, releases: never behind a batch).
CONTROL_POOL_SIZE = 2
# SQS refuses a visibility timeout beyond 12 hours.
SQS_MAX_VISIBILITY = 43_200
#: Shortest visibility timeout the daemon works with (app.py already replaced a queue's own
#: 0 or 1 by 30): the heartbeat extends every half timeout, so at 1 s it would make two
#: ChangeMessageVisibility calls a second per batch and lose the message to another
#: receive whenever the batch's start plus one call took over half a second (at 0 it would
#: not sleep at all). INGEST_VISIBILITY_TIMEOUT=1 is refused (exit 2) rather than replaced.
MIN_VISIBILITY_TIMEOUT = 2
#: Shortest INGEST_WORKER_LEASE: a worker heartbeats every lease / 3, so at 3 s it beats
#: every second and counts as dead only when a beat is 2 s late — a database round trip
#: under load, a control connection busy with a GC pass, a handler holding the event loop.
#: Shorter, another replica's GC collects the claims of a live worker (measured: at 0.15 s
#: in 0.17 s; at 0.3 s after one 0.4 s event-loop stall); the fence keeps them from being
#: applied twice, but the batch's work is lost and comes back as a false orphan.
MIN_WORKER_LEASE = 3.0
#: Longest lease PostgreSQL can subtract from now() (GC's cutoff): a century, like retention.
MAX_WORKER_LEASE = 36_500 * 86_400.0
#: Longest retention (days) a prune can express: PostgreSQL's cutoff, now() - the
#: retention, must stay a timestamp (and ``inf`` is no interval). A century.
MAX_RETENTION_DAYS = 36_500
#: INGEST_MAX_INFLIGHT_BYTES: bodies + S3 payloads in flight. Measured end to end
#: (BENCHMARKS.md "Memory budget", 40 x 6 MiB pointers of small JSON records): a peak of
#: 641 MiB at a 24 MiB budget and 551 MiB at 16 MiB, over the 512 Mi of deploy/k8s; the
#: default is the smallest budget that still holds one INGEST_MAX_PAYLOAD_BYTES payload.
DEFAULT_MAX_INFLIGHT_BYTES = 10 * 1024 * 1024
#: Shortest period of the timed loops (INGEST_GC_INTERVAL, INGEST_QUEUE_ATTRIBUTES_INTERVAL,
#: INGEST_PRUNE_INTERVAL). asyncio waits no shorter (epoll counts milliseconds: periods of
#: 1e-5 to 1e-3 s all measured ~900 wakeups a second), and at 1e-6 s or less it does not wait
#: at all: the GC and prune loops, which skip their work while the database is down and
#: sleep again, measured 96% of a core through an outage at 1e-9.
MIN_LOOP_INTERVAL = 0.001


# Field checks (a ValueError names the variable in load_settings's one line).
def _queue_url(v: str) -> str:
    if not v.startswith(("http://", "https://")):
        raise ValueError("must be an SQS queue URL (http(s)://…)")
    return v


def _endpoint(v: str | None) -> str | None:
    if v is not None and not v.startswith(("http://", "https://")):
        raise ValueError("must be an http(s):// URL")
    return v or None


def _topic_arn(v: str | None) -> str | None:
    if v and not v.startswith("arn:"):
        raise ValueError("must be an SNS topic ARN (arn:…:sns:…)")
    return v or None


def _s3_buckets(v: str) -> str:
    AllowList.parse(v)  # ValueError names the entry
    return v


def _s3_owner(v: str | None) -> str | None:
    if v and not (len(v) == 12 and v.isdigit()):
        raise ValueError("must be a 12-digit AWS account id")
    return v or None


def _envelope_source(v: str) -> str:
    from service.envelope import Source

    Source.parse(v)  # ValueError says what is accepted
    return v


def _envelope_type(v: str) -> str:
    from service.envelope import Source

    Source.parse(v, constant_allowed=True)
    return v


def _zero_or_at_least(minimum: float, zero: str, why: str) -> AfterValidator:
    """0 (which means ``zero``) or at least ``minimum``."""

    def check(v: float) -> float:
        if 0 < v < minimum:
            raise ValueError(f"must be 0 ({zero}) or at least {minimum:g}: {why}")
        return v

    return AfterValidator(check)


def _lower(v: object) -> object:
    return v.lower() if isinstance(v, str) else v


QueueUrl = Annotated[str, AfterValidator(_queue_url)]
EndpointUrl = Annotated[str | None, AfterValidator(_endpoint)]


class Settings(BaseSettings):
    """Every option of the daemon, read from ``INGEST_*`` environment variables.

    Attributes:
        queue_url: the SQS queue to drain (required).
        database_url: the target database (required), a secret: a ``postgresql://`` URL or a
            libpq ``key=value`` string, from ``INGEST_DATABASE_URL`` or the file named by
            ``INGEST_DATABASE_URL_FILE``; ``INGEST_DATABASE_PASSWORD`` /
            ``INGEST_DATABASE_PASSWORD_FILE`` (a password, or an RDS-managed JSON secret
            ``{"username", "password"}``) override its credentials. Held canonical
            (percent-encoded); use :attr:`database_dsn` to connect and
            :attr:`database_redacted` to print.
        database_url_file: read ``INGEST_DATABASE_URL`` from this file (a mounted secret; one
            trailing newline ignored); setting both is exit 2.
        database_password: overrides the URL's password: the password itself, or an
            RDS-managed / Secrets Manager JSON secret ``{"username", "password"}`` (its
            ``username``, when present, overrides the user too).
        database_password_file: the same, read from a file; setting both is exit 2.
        database_tls: ``verify`` (default): a TCP connection to a host other than
            loopback needs ``sslmode=verify-full`` (or ``verify-ca``) in the DSN, else exit
            2; ``disable-verification`` accepts whatever sslmode the DSN has.
        sqs_endpoint_url: an emulator (LocalStack, moto) instead of AWS.
        aws_region: region of the AWS clients; unset: ``AWS_REGION`` or ``AWS_DEFAULT_REGION``
            (what ECS and IRSA inject), else the queue URL's region, else us-east-1.
        http_port: port of ``/metrics``, ``/healthz``, ``/readyz`` (0 disables).
        http_host: address the HTTP server binds (default 127.0.0.1; the image: 0.0.0.0).
        visibility_timeout: seconds a received message stays hidden; 0 = use the
            queue's own ``VisibilityTimeout`` attribute, read at startup; else at least
            ``MIN_VISIBILITY_TIMEOUT`` (2).
        max_receive_count: handler attempts before a message is dead-lettered; lowered to
            the queue's RedrivePolicy maxReceiveCount when that is smaller (service.ops.redrive).
        pollers: concurrent long-poll loops.
        max_inflight_batches: received batches being processed at once (0 = 2 x pollers:
            with INGEST_RECEIVES_PER_BATCH each batch carries up to 30 messages).
        receives_per_batch: with a backlog, up to this many full receives (10 messages
            each) make one batch: one claim and one completing transaction for all of
            them (1 = one receive per batch; FIFO queues always 1).
        wait_time_seconds: long-poll wait (SQS maximum 20).
        receive_window: while receives bring some but fewer than 10 messages (a trickle),
            the pollers' receives start at least receive_window / pollers apart, so that
            messages gather in the queue and one receive (and one delete) serves several
            (0 = no pacing). What it costs: a message may wait up to that spacing to be
            received (125 ms at the defaults). A backlog and an idle queue are not paced.
        delete_linger: seconds a small batch's delete may wait to share one
            DeleteMessageBatch with other batches' (0 = delete each batch at once; capped at
            a tenth of the visibility timeout). The outcome is committed before: a crash
            in the linger means only a redelivery, answered as a duplicate.
        shutdown_timeout: seconds to finish in-flight work after SIGTERM.
        handlers: comma-separated modules imported at startup to register handlers.
        handler_timeout: seconds one handler call may take before it counts as a failure
            (0 = no limit); without it a hung handler holds its batch for up to 12 h.
        worker_name: stable name of this replica (pod name); when set, claims of a
            dead previous incarnation with the same name are released at startup.
        worker_lease: seconds without heartbeat after which a worker is dead (heartbeat
            every lease / 3; at least ``MIN_WORKER_LEASE``, 3 s).
        gc_interval: seconds between orphan-GC passes (at least ``MIN_LOOP_INTERVAL``).
        retry_base_seconds / retry_max_seconds: exponential backoff of transient failures.
        contention_delay: visibility given to a message another live owner holds.
        queue_attributes_interval: seconds between GetQueueAttributes for the depth gauges
            and the queue's RedrivePolicy (at least ``MIN_LOOP_INTERVAL``).
        db_pool_size: PostgreSQL connections.
        log_format / log_level: ``json`` (default) or ``console``.
        results_topic_arn / results_queue_url: where each outcome's result message goes
            (SNS topic or SQS queue; at most one; unset = no results).
        results_endpoint_url: endpoint of that destination's API (default:
            ``sqs_endpoint_url``).
        results_publishers: concurrent publishing loops per replica (ten results a call).
        results_retention_days: published outbox rows are kept this long, then deleted.
        results_send_timeout: seconds one PublishBatch/SendMessageBatch may take.
        retention_days: completed modifications (and their retry counts) are deleted this
            long after ``completed_at``; must exceed the queue's MessageRetentionPeriod.
        prune_interval: seconds between the daemon's prune passes (0 = never prunes;
            else at least ``MIN_LOOP_INTERVAL``).
        prune_batch_size / prune_pause: rows per delete transaction, seconds between them.
        dead_letter_retention_days: replayed dead letters are kept this long after replay.
        reconcile_retention_days: reconciliation runs and their discrepancies.
        worker_retention_days: ``workers`` rows this long after their last heartbeat
            (at least ``worker_lease``).
        s3_endpoint_url: S3 endpoint for payloads offloaded by the AWS extended clients
            (default: ``sqs_endpoint_url``).
        max_payload_bytes: largest S3-offloaded payload read (checked before reading);
            a larger one is dead-lettered as ``payload_too_large``.
        s3_buckets: the buckets (``bucket`` or ``bucket/prefix``, comma-separated) S3
            pointers may be read from; a pointer elsewhere is dead-lettered unread as
            ``payload_bucket_not_allowed``. Unset: no pointer is read.
        s3_unreadable_after: seconds S3 may refuse a pointer (403, KMS; counted from its
            first refusal, kept in PostgreSQL) before its message is dead-lettered as
            ``payload_unreadable``.
        max_inflight_bytes: the memory budget: bytes of message bodies and S3 payloads
            held for messages in flight (a body also 64 for each JSON value it holds: what
            parsing it adds); when full, receiving waits. Must hold one
            ``max_payload_bytes`` payload.
        max_json_values: JSON values a body or an S3 payload may hold, counted before it
            is parsed (one per ``{``, ``[`` and ``,``, those inside strings included); more
            is dead-lettered unparsed as ``payload_too_complex``. A parsed value costs
            tens of bytes of memory (up to about 130 measured), so the default bounds one
            message's objects to about 3 MiB and eight pollers' receives to the 512 Mi of
            deploy/k8s; raise it, with the memory, for payloads of many small records.
        s3_expected_owner: account id passed as ``ExpectedBucketOwner`` on every S3 call.
        s3_delete_after_ack: delete an offloaded payload's S3 object once its request is
            committed and acked (default: keep it; expire it with a lifecycle rule).
        envelope_request_id / envelope_type / envelope_payload: where an existing producer's
            messages keep the request id, the type and the payload: a dotted path into the
            body (``order.id``; ``.`` is the whole body), ``attribute:NAME`` (a message
            attribute), or for the type ``const:TYPE`` (one type per queue). The defaults read
            the standard envelope ``{"request_id", "type", "payload"}``.
        migrate_lock_timeout: seconds a migration statement (``sqs-ingest migrate``) waits
            for a lock before it gives up its place in the lock queue, so ingestion never
            queues behind it; the migration is then tried again after a backoff.
        migrate_attempts: tries of a migration refused its locks before migrate exits 1.
        tracing: OpenTelemetry spans per message (needs the ``otel`` extra; exporter set by
            the standard ``OTEL_*`` variables); log lines then carry ``trace_id``.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    queue_url: QueueUrl
    database_url: SecretStr
    database_url_file: Path | None = None
    database_password: SecretStr | None = None
    database_password_file: Path | None = None
    database_tls: Annotated[Literal["verify", "disable-verification"],
                            BeforeValidator(_lower)] = "verify"
    sqs_endpoint_url: EndpointUrl = None
    aws_region: str = Field("", validate_default=True)
    http_port: int = Field(9102, ge=0, le=65535)
    # Loopback: `make run` on a laptop is not reachable from the network. The image sets
    # 0.0.0.0 in its own environment (Dockerfile), where probes and scrapes come from outside.
    http_host: str = "127.0.0.1"
    visibility_timeout: Annotated[int, _zero_or_at_least(
        MIN_VISIBILITY_TIMEOUT, "the queue's own", "the heartbeat extends every half timeout",
    )] = Field(0, ge=0, le=SQS_MAX_VISIBILITY)
    max_receive_count: int = Field(5, ge=1, le=1000)
    pollers: int = Field(8, ge=1, le=64)
    max_inflight_batches: int = Field(0, ge=0, le=512)
    receives_per_batch: int = Field(3, ge=1, le=10)
    wait_time_seconds: int = Field(20, ge=0, le=20)
    receive_window: float = Field(1.0, ge=0, le=20, allow_inf_nan=False)
    delete_linger: float = Field(0.2, ge=0, le=5, allow_inf_nan=False)
    shutdown_timeout: float = Field(30.0, gt=0)
    handlers: str = ""
    handler_timeout: float = Field(600.0, ge=0)
    worker_name: str = ""
    worker_lease: float = Field(30.0, ge=MIN_WORKER_LEASE, le=MAX_WORKER_LEASE,
                                allow_inf_nan=False)
    gc_interval: float = Field(10.0, ge=MIN_LOOP_INTERVAL)
    # inf: the outage hand-back's jitter, ceil(inf) (nan when the draw is 0), raised in the
    # except clause meant to give the batch back; 1e300 works (capped at 12 h).
    retry_base_seconds: float = Field(2.0, ge=0, allow_inf_nan=False)
    retry_max_seconds: float = Field(900.0, ge=0, le=SQS_MAX_VISIBILITY)
    contention_delay: float = Field(5.0, ge=0, le=SQS_MAX_VISIBILITY)
    queue_attributes_interval: float = Field(15.0, ge=MIN_LOOP_INTERVAL)
    db_pool_size: int = Field(10, ge=1, le=200)
    log_format: Annotated[Literal["json", "console"], BeforeValidator(_lower)] = "json"
    log_level: Annotated[Literal["debug", "info", "warning", "error"],
                         BeforeValidator(_lower)] = "info"
    tracing: bool = False
    s3_endpoint_url: EndpointUrl = None
    max_payload_bytes: int = Field(10 * 1024 * 1024, ge=1024, le=2**31)
    s3_delete_after_ack: bool = False
    s3_buckets: Annotated[str, AfterValidator(_s3_buckets)] = ""
    s3_expected_owner: Annotated[str | None, AfterValidator(_s3_owner)] = None
    s3_unreadable_after: float = Field(3600.0, gt=0, allow_inf_nan=False)
    max_inflight_bytes: int = Field(DEFAULT_MAX_INFLIGHT_BYTES, ge=1024, le=2**40)
    # service.core.limits.MAX_JSON_VALUES (core sits above settings; a unit test keeps both).
    max_json_values: int = Field(25_000, ge=100, le=2**31)
    results_topic_arn: Annotated[str | None, AfterValidator(_topic_arn)] = None
    results_queue_url: str | None = None
    results_endpoint_url: EndpointUrl = None
    results_publishers: int = Field(2, ge=1, le=32)
    results_retention_days: float = Field(7.0, ge=0, le=MAX_RETENTION_DAYS)
    results_send_timeout: float = Field(10.0, gt=0)
    retention_days: float = Field(30.0, gt=0, le=MAX_RETENTION_DAYS)
    prune_interval: Annotated[float, _zero_or_at_least(
        MIN_LOOP_INTERVAL, "off", "a shorter wait is a busy loop",
    )] = Field(3600.0, ge=0, allow_inf_nan=False)
    prune_batch_size: int = Field(5000, ge=1, le=100_000)
    prune_pause: float = Field(0.0, ge=0, allow_inf_nan=False)
    dead_letter_retention_days: float = Field(30.0, gt=0, le=MAX_RETENTION_DAYS)
    reconcile_retention_days: float = Field(90.0, gt=0, le=MAX_RETENTION_DAYS)
    worker_retention_days: float = Field(7.0, gt=0, le=MAX_RETENTION_DAYS)
    envelope_request_id: Annotated[str, AfterValidator(_envelope_source)] = "request_id"
    envelope_type: Annotated[str, AfterValidator(_envelope_type)] = "type"
    envelope_payload: Annotated[str, AfterValidator(_envelope_source)] = "payload"
    migrate_lock_timeout: float = Field(5.0, ge=0.001, le=3600, allow_inf_nan=False)
    migrate_attempts: int = Field(10, ge=1, le=1000)

    @model_validator(mode="before")
    @classmethod
    def _database_secret(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            url = resolve_database_url(data)
            if url is None:
                data.pop("database_url", None)  # reported as required
            else:
                data["database_url"] = url
        return data

    @field_validator("aws_region")
    @classmethod
    def _region(cls, v: str, info: ValidationInfo) -> str:
        return v or default_region(str(info.data.get("queue_url") or ""))
    @model_validator(mode="after")
    def _database_tls(self) -> Settings:
        # After the fields: a bad INGEST_* value is reported as itself, not hidden behind this.
        var = "INGEST_DATABASE_URL" + ("_FILE" if self.database_url_file else "")
        check_database_tls(var, secrets.parse_dsn(self.database_dsn), self.database_tls)
        return self

    @field_validator("results_queue_url")
    @classmethod
    def _results_queue(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError("must be an SQS queue URL (http(s)://…)")
        if v and info.data.get("results_topic_arn"):
            raise ValueError("and INGEST_RESULTS_TOPIC_ARN are both set: choose one")
        return v or None

    @field_validator("max_inflight_bytes")
    @classmethod
    def _budget(cls, v: int, info: ValidationInfo) -> int:
        payload = info.data.get("max_payload_bytes")
        if payload is not None and v < payload:
            raise ValueError(f"({v}) cannot hold one message of INGEST_MAX_PAYLOAD_BYTES "
                             f"({payload}): raise it or lower INGEST_MAX_PAYLOAD_BYTES")
        return v

    @field_validator("worker_retention_days")
    @classmethod
    def _worker_retention(cls, v: float, info: ValidationInfo) -> float:
        # Shorter than the lease, a prune pass deleted the row of a live worker between two
        # heartbeats (it holds no claim then); its next claim had an unknown owner, which
        # another replica's GC collected at once (measured: at 1e-6 days, a claim made
        # 0.2 s after a beat). At the lease or longer a pruned row is one GC counts dead.
        lease = info.data.get("worker_lease")
        if lease is not None and v * 86_400 < lease:
            raise ValueError(f"({v:g} days = {v * 86_400:g} s) is shorter than "
                             f"INGEST_WORKER_LEASE ({lease:g} s): the pruner would delete live "
                             "workers; raise it or lower INGEST_WORKER_LEASE")
        return v

    @property
    def database_dsn(self) -> str:
        """The canonical connection URL, password included: for drivers only, never printed."""
        return self.database_url.get_secret_value()

    @property
    def database_redacted(self) -> str:
        """``postgresql://user@host:port/db``: the only form of the database we print."""
        return secrets.redact_dsn(self.database_dsn)

    @property
    def effective_s3_endpoint_url(self) -> str | None:
        return self.s3_endpoint_url or self.sqs_endpoint_url

    @property
    def results_enabled(self) -> bool:
        return bool(self.results_topic_arn or self.results_queue_url)

    @property
    def db_connections(self) -> int:
        """PostgreSQL connections one replica opens at most: the batch pool
        (INGEST_DB_POOL_SIZE), the control pool and, with results on, the publishers' pool.
        Replicas x this must fit max_connections (README "Sizing"; tests/deploy)."""
        results = self.results_publishers + 1 if self.results_enabled else 0
        return self.db_pool_size + CONTROL_POOL_SIZE + results

    @property
    def is_fifo(self) -> bool:
        return self.queue_url.rstrip("/").endswith(".fifo")

    @property
    def inflight_limit(self) -> int:
        return self.max_inflight_batches or self.pollers * 2

    @property
    def handler_modules(self) -> list[str]:
        return [m.strip() for m in self.handlers.split(",") if m.strip()]

    @property
    def effective_worker_name(self) -> str:
        return self.worker_name or socket.gethostname()


#: ``INGEST_*`` variables read outside :class:`Settings`: the reconcile job's peers
#: (:func:`reconcile_peers_from_env`) and its sidecar's metrics address. Variables of the
#: test harness carry a prefix of theirs.
OTHER_VARIABLES = ("INGEST_RECONCILE_PEER_URLS", "INGEST_RECONCILE_PEER_URLS_FILE",
                   "INGEST_RECONCILE_METRICS_HOST")
_HARNESS_PREFIXES = ("INGEST_TEST_", "INGEST_TESTS_", "INGEST_MUTANT_")


_QUEUE_REGION = re.compile(r"^https?://sqs[.-]([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/")


def default_region(queue_url: str, environ: Mapping[str, str] | None = None) -> str:
    """The region when ``INGEST_AWS_REGION`` is not set: ``AWS_REGION`` or
    ``AWS_DEFAULT_REGION`` (what ECS and IRSA inject), else the queue URL's
    (``https://sqs.eu-west-1.amazonaws.com/…``), else us-east-1."""
    env = os.environ if environ is None else environ
    m = _QUEUE_REGION.match(queue_url)
    return (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
            or (m.group(1) if m else "") or "us-east-1")


def known_variables() -> list[str]:
    return [f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields] + list(
        OTHER_VARIABLES)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each ``INGEST_*`` variable sqs-ingest does not know (a typo would
    otherwise be ignored silently), naming the closest known name."""
    env = os.environ if environ is None else environ
    known = known_variables()
    lines = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in known or var.startswith(_HARNESS_PREFIXES):
            continue
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.6)
        hint = f": did you mean {close[0]}?" if close else ""
        lines.append(f"configuration error: {var} is not a setting of sqs-ingest{hint}")
    return lines


def _error_line(err: Mapping[str, Any]) -> str:
    loc = err["loc"][0] if err["loc"] else "?"
    var = f"{ENV_PREFIX}{str(loc).upper()}"
    msg = str(err["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    msg = msg[:1].lower() + msg[1:]
    if err["type"] == "missing":
        msg = "is required but not set"
    return f"configuration error: {var} {msg}"


def load_settings(**overrides: object) -> Settings:
    """Build Settings. Every unknown ``INGEST_*`` variable and every invalid one is reported,
    each on a line of its own, in one ConfigError."""
    lines = unknown_variables()
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        lines += [_error_line(err) for err in exc.errors()]
    except ConfigError as exc:
        lines.append(str(exc))
    if lines:
        raise ConfigError("\n".join(dict.fromkeys(lines))) from None
    return settings


def redact_dsn(dsn: str) -> str:
    """The DSN as it may be printed (see :func:`service.secrets.redact_dsn`)."""
    return secrets.redact_dsn(dsn)


def _plain(value: object) -> str | None:
    if value is None or value == "":
        return None
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return str(value)


def _read_secret_file(var: str, path: str) -> str:
    try:
        # Mounted secrets (Kubernetes, Docker, ECS bind mounts) often end in a newline.
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"configuration error: {var} cannot be read: {path}: "
                          f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None


def _one_of(data: Mapping[str, object], field: str) -> tuple[str, str | None]:
    """(variable it came from, value) of ``field`` given directly or as ``field_file``."""
    var = f"{ENV_PREFIX}{field.upper()}"
    value, path = _plain(data.get(field)), _plain(data.get(f"{field}_file"))
    if value is not None and path is not None:
        raise ConfigError(f"configuration error: {var} and {var}_FILE are both set: choose one")
    if path is not None:
        return f"{var}_FILE", _read_secret_file(f"{var}_FILE", path)
    return var, value


def _credentials(var: str, text: str) -> tuple[str | None, str]:
    """(user or None, password) from a password variable: the password as it is, or an
    RDS-managed / Secrets Manager JSON secret (``{"username": …, "password": …}``)."""
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("password"), str):
            user = doc.get("username")
            return (user if isinstance(user, str) and user else None), doc["password"]
        if isinstance(doc, dict):
            raise ConfigError(f"configuration error: {var} is a JSON object without a "
                              '"password" string (expected {"username": …, "password": …})')
    return None, text


#: INGEST_DATABASE_TLS: ``verify`` (default) refuses a TCP connection to a host other than
#: loopback unless the DSN's sslmode checks the server's certificate; the opt-out keeps
#: whatever the DSN says (a private network the operator vouches for).
DATABASE_TLS = ("verify", "disable-verification")
VERIFIED_SSLMODES = ("verify-ca", "verify-full")


def _loopback(host: str) -> bool:
    if host.startswith(("/", "@")) or host.lower() == "localhost":  # Unix socket, loopback
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_database_tls(var: str, dsn: secrets.Dsn, tls: str | None) -> None:
    """ConfigError naming ``var`` when ``dsn`` reaches a host beyond loopback without a
    verified certificate (sslmode below verify-ca, or none: libpq's and asyncpg's
    ``prefer`` falls back to plain text and checks no certificate), unless ``tls`` is
    ``disable-verification``."""
    tls = (tls or "verify").lower()
    if tls not in DATABASE_TLS:
        raise ConfigError("configuration error: INGEST_DATABASE_TLS must be 'verify' or "
                          "'disable-verification'")
    mode = dict(dsn.query).get("sslmode")
    if tls == "disable-verification" or mode in VERIFIED_SSLMODES:
        return
    remote = [h for h in dsn.hosts() if not _loopback(h)]
    if remote:
        said = f"sslmode={mode}" if mode in ("disable", "allow", "prefer", "require") else (
            "no sslmode" if mode is None else "an unknown sslmode")
        raise ConfigError(
            f"configuration error: {var} reaches a host beyond loopback without checking "
            f"its certificate ({said}): add sslmode=verify-full&sslrootcert=<CA bundle "
            "path> (key=value: sslmode=verify-full sslrootcert=…), or set "
            "INGEST_DATABASE_TLS=disable-verification to accept that")


def resolve_database_url(data: Mapping[str, object]) -> str | None:
    """The canonical DSN from ``database_url`` / ``database_url_file`` and the password
    overrides (keys as in Settings). Every password seen is remembered for scrubbing;
    a bad value raises ConfigError naming the variable and never echoing the value."""
    var, text = _one_of(data, "database_url")
    pw_var, pw_text = _one_of(data, "database_password")
    if text is None:
        return None  # pydantic then reports INGEST_DATABASE_URL as required
    try:
        dsn = secrets.parse_dsn(text)
    except secrets.DsnError as exc:
        secrets.remember(text)  # a password may sit anywhere in what we could not read
        raise ConfigError(f"configuration error: {var} {exc}") from None
    secrets.remember_dsn(dsn)
    if pw_text is not None:
        user, password = _credentials(pw_var, pw_text)
        secrets.remember(password)
        dsn = dsn.with_credentials(user, password)
    return dsn.url()


def is_set(*fields: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether any of these settings (field names: ``queue_url`` is ``INGEST_QUEUE_URL``) is
    set to something non-empty: which settings a command can do without."""
    env = os.environ if environ is None else environ
    return any(env.get(f"{ENV_PREFIX}{f.upper()}") for f in fields)


def database_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The canonical DSN from ``INGEST_DATABASE_URL[_FILE]`` and ``INGEST_DATABASE_PASSWORD
    [_FILE]`` alone (for commands that need no queue: reconcile)."""
    env = os.environ if environ is None else environ
    keys = ("database_url", "database_url_file", "database_password", "database_password_file")
    data = {k: env.get(f"{ENV_PREFIX}{k.upper()}") for k in keys}
    url = resolve_database_url(data)
    if url is not None:
        var = "INGEST_DATABASE_URL" + ("_FILE" if data["database_url_file"] else "")
        check_database_tls(var, secrets.parse_dsn(url), env.get("INGEST_DATABASE_TLS"))
    return url


def reconcile_peers_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """Peer DSNs for ``sqs-ingest reconcile``: ``INGEST_RECONCILE_PEER_URLS`` (one per line)
    or the file named by ``INGEST_RECONCILE_PEER_URLS_FILE`` (one per line, ``#`` comments),
    so they stay out of ``ps``, pod specs and ECS commands."""
    env = os.environ if environ is None else environ
    _, text = _one_of({k: env.get(f"{ENV_PREFIX}{k.upper()}") for k in
                         ("reconcile_peer_urls", "reconcile_peer_urls_file")},
                        "reconcile_peer_urls")
    if text is None:
        return []
    return peer_lines(text)


def peer_lines(text: str) -> list[str]:
    lines = [line.strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]

"""Every error of sqs-ingest's own, and what each means: permanent (dead-letter), transient
(retry), fatal, or bad configuration.

The adapters translate their drivers' errors into these once, where they happen: the store
turns asyncpg's into ``DatabaseUnavailable`` / ``DataRejected`` / ``DatabaseError`` at the
connection (the driver's error stays the ``__cause__``: ``service.ops.diagnose`` reads it), the
queue and the S3 client turn botocore's into ``TransientError`` / ``AckFailed``. Nothing
above the adapters imports a driver's exceptions (the import-linter contract in
pyproject.toml).
"""

from __future__ import annotations

from typing import Protocol


class IngestError(Exception):
    """Base of sqs-ingest's own errors."""


class TransientError(IngestError):
    """Retry later: the message stays on the queue."""


class PermanentError(IngestError):
    """Retrying cannot help: the message at fault is dead-lettered."""


class DatabaseUnavailable(TransientError):
    """PostgreSQL cannot be reached; stop receiving until it comes back."""


class DatabaseError(IngestError):
    """A statement failed on the database's side while the database is there (a bad
    statement, a privilege, a constraint): the store's translation of the driver's error,
    which is its ``__cause__``."""


class DatabaseBusy(DatabaseUnavailable, DatabaseError):
    """The database refused a statement for a reason of its own making while it is there: a
    serialization failure or deadlock, a lock or statement timeout, insufficient resources,
    an operator's intervention, a read-only transaction. No message's fault: the batch is
    deferred like an outage's — never counted against a message, never dead-lettered, and
    copied afresh before SQS's ``maxReceiveCount`` could move it (SPEC §7)."""


class DataRejected(DatabaseError, PermanentError):
    """The database refused a value (SQLSTATE class 22 data exception, 54 program limit
    exceeded, e.g. an index entry too large): the fault of one message, not of its batch."""


#: What the orchestration treats as "the database call failed": an outage, a failed
#: statement, or a call that timed out (``TimeoutError`` is an ``OSError``).
DB_ERRORS: tuple[type[BaseException], ...] = (DatabaseUnavailable, DatabaseError, OSError)


class AckFailed(IngestError):
    """DeleteMessage(Batch) failed after the outcome was committed.

    Fatal on purpose (exit 3): swallowing it leaves the message on the queue with its
    effect already committed; only a restart (which runs orphan GC) makes that safe.
    """

    def __init__(self, message_ids: list[str], detail: str) -> None:
        super().__init__(f"ack failed for {len(message_ids)} message(s): {detail}")
        self.message_ids = message_ids
        self.detail = detail


class SchemaBehind(Exception):
    """The database lacks migrations this code needs."""


class _Migration(Protocol):
    @property
    def filename(self) -> str: ...


class MigrationChanged(SchemaBehind):
    """An applied migration's file no longer matches what was applied (its checksum).

    A ``SchemaBehind``: wherever a schema that is behind is refused (``run``, ``/readyz``),
    so is this one.
    """

    def __init__(self, migration: _Migration) -> None:
        super().__init__(
            f"migration {migration.filename} was changed after it was applied (checksum "
            "differs from ingest_schema_migrations): restore the file and put the change "
            "in a new migration"
        )
        self.migration = migration


class HandlerMigrationChanged(MigrationChanged):
    """A handler package's applied migration no longer matches what was applied: ``migrate``
    exits 2 (the installed package is wrong, not the database), naming the distribution
    and the file."""

    def __init__(self, migration: _Migration) -> None:
        SchemaBehind.__init__(
            self,
            f"migration {migration.filename} was changed after it was applied (checksum "
            "differs from ingest_handler_migrations): restore the file in the package and "
            "put the change in a new migration",
        )
        self.migration = migration


class MigrationBlocked(Exception):
    """A migration did not get its locks within ``lock_timeout`` in any of its attempts
    (a long transaction held its table): nothing of it was applied."""

    def __init__(self, migration: _Migration, attempts: int, lock_timeout: float,
                 cause: BaseException) -> None:
        super().__init__(
            f"migration {migration.filename} did not get its locks within lock_timeout "
            f"{lock_timeout:g} s in {attempts} attempt(s) ({cause}): a long transaction "
            "holds its table; run migrate again later, or raise INGEST_MIGRATE_LOCK_TIMEOUT "
            "/ INGEST_MIGRATE_ATTEMPTS"
        )
        self.migration = migration


class ConfigError(Exception):
    """Bad or missing configuration: the CLI exits 2 with this one-line message."""


class RetentionRefused(Exception):
    """A retention a redelivery could outlive: exit 2 with this one line."""


def driver_error(exc: BaseException) -> BaseException:
    """What to show of an error an adapter translated: the driver's own (its cause), so
    operator output and dead letters read as before the translation."""
    if isinstance(exc, DatabaseUnavailable | DatabaseError) and exc.__cause__ is not None:
        return exc.__cause__
    return exc

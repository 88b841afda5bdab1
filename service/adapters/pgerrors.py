"""The PostgreSQL driver's errors, read once: which asyncpg errors mean an outage, a refusal
of the database's own making, a value the database refuses, or a conflict worth rerunning,
and their translation into ``service.errors`` (the driver's error stays the ``__cause__``).
The store and the pruner translate at their connections; nothing above the adapters sees an
asyncpg error."""

from __future__ import annotations

import asyncpg

from service.errors import DatabaseBusy, DatabaseError, DatabaseUnavailable, DataRejected

#: Errors that mean "the database is not there", as opposed to a bad statement.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.TooManyConnectionsError,
)

#: Refusals of the database's own making while it is there, whichever statement meets them:
#: serialization failure and deadlock (SQLSTATE class 40), lock not available (55P03: a
#: ``lock_timeout``), query canceled (57014: a ``statement_timeout``) and the rest of class
#: 57 (operator intervention: admin or crash shutdown), insufficient resources (class 53:
#: disk full, out of memory, too many connections), a read-only transaction (25006: a
#: standby after a failover, ``default_transaction_read_only``). A message that meets one
#: is not at fault: its batch is deferred like an outage's (``DatabaseBusy``).
BUSY_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.TransactionRollbackError,
    asyncpg.LockNotAvailableError,
    asyncpg.OperatorInterventionError,
    asyncpg.InsufficientResourcesError,
    asyncpg.ReadOnlySQLTransactionError,
)

#: The database refused a value (SQLSTATE class 22 data exception, 54 program limit
#: exceeded, e.g. an index entry too large): the fault of a message, not of the batch.
DATA_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.DataError, asyncpg.ProgramLimitExceededError
)

#: Raised inside a handler by PostgreSQL itself, not by the handler's logic.
RETRY_TRANSACTION: tuple[type[BaseException], ...] = (
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
    asyncpg.LockNotAvailableError,
)


def unavailable(exc: BaseException) -> DatabaseUnavailable:
    return DatabaseUnavailable(f"database unavailable: {type(exc).__name__}: {exc}")


def translate(exc: BaseException) -> BaseException | None:
    """The ``service.errors`` form of a driver error (raise it ``from exc``); None for an
    error that is not the driver's (a handler's own, one of ours): it passes unchanged."""
    if isinstance(exc, CONNECTION_ERRORS):
        return unavailable(exc)
    if isinstance(exc, BUSY_ERRORS):
        return DatabaseBusy(f"database busy: {type(exc).__name__}: {exc}")
    if isinstance(exc, DATA_ERRORS):
        return DataRejected(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, asyncpg.PostgresError):
        return DatabaseError(f"{type(exc).__name__}: {exc}")
    return None

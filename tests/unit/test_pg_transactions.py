"""``store._PgTransactions.finish`` on fakes: after a committed batch the connection is reset;
a reset that fails on an open connection closes it (the commit stands: nothing raises), and
the connections taken to replace broken ones go back to the pool. ``_PgAttempt``: what its
COMMIT raises of the database's own making is an outage."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from service.adapters.store import _PgAttempt, _PgTransactions
from service.errors import DatabaseUnavailable


class Conn:
    def __init__(self, reset_fails: bool = False, closed: bool = False) -> None:
        self.reset_fails, self.closed = reset_fails, closed
        self.resets = self.terminated = 0

    def daemon_connection(self) -> Conn:
        return self

    def is_closed(self) -> bool:
        return self.closed

    async def reset(self) -> None:
        self.resets += 1
        if self.reset_fails:
            raise RuntimeError("reset failed")

    def terminate(self) -> None:
        self.terminated += 1
        self.closed = True


class Pool:
    def __init__(self) -> None:
        self.released: list[Any] = []

    async def release(self, conn: Any) -> None:
        self.released.append(conn)


async def test_a_committed_batch_resets_its_connection_and_returns_replacements() -> None:
    pool, conn, spare = Pool(), Conn(), Conn()
    txns = _PgTransactions(pool, conn, "w", results=False)
    txns.replacements.append(spare)
    await txns.finish(committed=True)
    assert (conn.resets, conn.terminated, pool.released) == (1, 0, [spare])


async def test_a_failed_reset_closes_the_open_connection_and_raises_nothing() -> None:
    pool, conn = Pool(), Conn(reset_fails=True)
    await _PgTransactions(pool, conn, "w", results=False).finish(committed=True)
    assert (conn.resets, conn.terminated) == (1, 1)


async def test_a_failed_reset_of_a_connection_already_gone_is_left_alone() -> None:
    pool, conn = Pool(), Conn(reset_fails=True, closed=True)
    await _PgTransactions(pool, conn, "w", results=False).finish(committed=True)
    assert conn.terminated == 0


async def test_nothing_committed_no_reset() -> None:
    pool, conn = Pool(), Conn()
    await _PgTransactions(pool, conn, "w", results=False).finish(committed=False)
    assert conn.resets == 0


class Tx:
    """asyncpg's transaction object: its COMMIT (``__aexit__`` without an error) raises."""

    def __init__(self, commit_raises: BaseException) -> None:
        self.commit_raises = commit_raises

    async def __aexit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            raise self.commit_raises


@pytest.mark.parametrize("error", [
    asyncpg.QueryCanceledError("canceling statement due to user request"),
    asyncpg.DiskFullError("could not extend file"),
    asyncpg.ReadOnlySQLTransactionError("cannot execute COMMIT in a read-only transaction"),
])
async def test_the_databases_own_trouble_at_commit_is_an_outage(error: Exception) -> None:
    attempt = _PgAttempt(_PgTransactions(Pool(), Conn(), "w", results=False))
    attempt._tx = Tx(error)
    with pytest.raises(DatabaseUnavailable) as raised:
        await attempt.__aexit__(None, None, None)
    assert raised.value.__cause__ is error
    assert str(raised.value) == f"database unavailable: {type(error).__name__}: {error}"


@pytest.mark.parametrize("error", [
    asyncpg.ForeignKeyViolationError("violates foreign key constraint"),  # one message's
    asyncpg.SerializationError("could not serialize access"),  # a conflict: rerun
])
async def test_other_errors_at_commit_are_left_to_the_attempt_loop(error: Exception) -> None:
    attempt = _PgAttempt(_PgTransactions(Pool(), Conn(), "w", results=False))
    attempt._tx = Tx(error)
    with pytest.raises(type(error)):
        await attempt.__aexit__(None, None, None)


class Commits:
    async def __aexit__(self, typ: Any, exc: BaseException | None, tb: Any) -> None:
        return None


async def test_a_half_that_committed_gets_the_reset_even_when_a_later_half_raised() -> None:
    """Bisection at COMMIT: the first half commits, the second raises. The committed half's
    handlers may have left session state (SET ROLE …): the connection is reset all the
    same, never handed to the next batch with it (Store.apply: committed_any)."""
    conn = Conn()
    txns = _PgTransactions(Pool(), conn, "w", results=False)
    first, second = _PgAttempt(txns), _PgAttempt(txns)
    first._tx = Commits()
    await first.__aexit__(None, None, None)
    second._tx = Tx(asyncpg.ForeignKeyViolationError("violates foreign key constraint"))
    with pytest.raises(asyncpg.ForeignKeyViolationError):
        await second.__aexit__(None, None, None)
    assert txns.committed_any
    await txns.finish(committed=False or txns.committed_any)
    assert conn.resets == 1

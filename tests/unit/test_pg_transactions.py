"""``store._PgTransactions.finish`` on fakes: after a committed batch the connection is reset;
a reset that fails on an open connection closes it (the commit stands: nothing raises), and
the connections taken to replace broken ones go back to the pool."""

from __future__ import annotations

from typing import Any

from service.adapters.store import _PgTransactions


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

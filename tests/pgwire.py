"""A TCP proxy in front of PostgreSQL that counts what crosses the wire: round trips (the
client sent something and then the server answered: a simple query, a Sync, or a Flush it
waits on, as asyncpg's first prepare of a statement does) and transactions (a
``ReadyForQuery`` whose status is idle ends one: an implicit single-statement transaction or
a COMMIT/ROLLBACK). Each connection's login (start-up through its first ReadyForQuery) is
counted as one round trip and one transaction: ``logins_excluded`` takes them off.
Used by the cost figures of ``make bench`` and by the test that pins the round trips of a
batch. Runs in a thread with its own event loop, so the process under test can be another.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from dataclasses import dataclass

from tests.faultproxy import LoopThread
from tests.servers import free_port

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104


@dataclass
class Counts:
    connections: int = 0
    round_trips: int = 0
    transactions: int = 0

    def minus(self, other: Counts) -> Counts:
        return Counts(self.connections - other.connections,
                      self.round_trips - other.round_trips,
                      self.transactions - other.transactions)


class PgWireCounter(LoopThread):
    """``dsn(db)`` connects through the proxy; ``counts()`` is a snapshot of the totals."""

    def __init__(self, host: str, port: int, user: str) -> None:
        super().__init__()
        self.upstream = (host, port)
        self.user = user
        self.port = free_port()
        self._totals = Counts()
        self._lock = threading.Lock()
        self._server: asyncio.base_events.Server | None = None

    def dsn(self, db: str = "postgres") -> str:
        # sslmode=disable: the counter reads the server's messages in the clear.
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}?sslmode=disable"

    def counts(self) -> Counts:
        with self._lock:
            return Counts(**vars(self._totals))

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(*self.upstream)
        except OSError:
            cw.close()
            return
        with self._lock:
            self._totals.connections += 1
        waiting = [False]  # the client sent something the server has not answered yet
        up = asyncio.create_task(self._client_to_server(cr, sw, waiting))
        down = asyncio.create_task(self._server_to_client(sr, cw, waiting))
        await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        for t in (up, down):
            t.cancel()
        for w in (cw, sw):
            w.close()

    async def _client_to_server(self, cr: asyncio.StreamReader, sw: asyncio.StreamWriter,
                                waiting: list[bool]) -> None:
        # Untyped start-up packets: an SSL or GSS request (refused by the server with one
        # byte, which the server side relays) until the startup message; then typed ones.
        while True:
            head = await cr.readexactly(4)
            (length,) = struct.unpack("!i", head)
            body = await cr.readexactly(length - 4)
            sw.write(head + body)
            await sw.drain()
            code = struct.unpack("!i", body[:4])[0] if len(body) >= 4 else 0
            if code not in (SSL_REQUEST, GSSENC_REQUEST):
                break
        waiting[0] = True  # the login: answered by its first ReadyForQuery
        while True:
            data = await cr.read(65536)
            if not data:
                return
            waiting[0] = True
            sw.write(data)
            await sw.drain()

    async def _server_to_client(self, sr: asyncio.StreamReader, cw: asyncio.StreamWriter,
                                waiting: list[bool]) -> None:
        first = True
        while True:
            kind = await sr.readexactly(1)
            if kind in (b"N", b"G") and first:  # the answer to an SSL/GSS request
                cw.write(kind)
                await cw.drain()
                continue
            first = False
            head = await sr.readexactly(4)
            (length,) = struct.unpack("!i", head)
            body = await sr.readexactly(length - 4)
            answered, waiting[0] = waiting[0], False
            # Counted before it is relayed: a client that has read the answer (and takes a
            # snapshot of the counts next) must find it counted.
            if answered or kind == b"Z":
                self._count(answered, kind == b"Z" and body[:1] == b"I")
            cw.write(kind + head + body)
            await cw.drain()

    def _count(self, round_trip: bool, transaction_ended: bool) -> None:
        with self._lock:
            self._totals.round_trips += round_trip
            self._totals.transactions += transaction_ended

    def logins_excluded(self, counts: Counts) -> Counts:
        """Counts without each connection's login (its first ReadyForQuery, idle)."""
        return Counts(counts.connections, counts.round_trips - counts.connections,
                      counts.transactions - counts.connections)

"""The handler author's kit (public): test a handler through the daemon's real path.

``pytest`` loads the fixtures (``service.testing.pytest_plugin``, entry point ``pytest11``);
this module is what they are made of, usable without pytest too:

- ``postgres_server()``: a throwaway PostgreSQL cluster (``initdb``) on a free loopback port,
  or ``ExistingPostgres(url)``: a server you already run (a CI service container, Docker on
  macOS), which the pytest fixtures use when ``INGEST_TEST_DATABASE_URL`` is set;
- ``create_template(pg, name, extra_sql)``: the migrated template database: sqs-ingest's
  migrations, then every installed handler package's (entry points ``sqs_ingest.migrations``,
  as ``sqs-ingest migrate`` applies them), then ``extra_sql``;
- ``handler_migrations(package)``: the SQL of a handler package's ``migrations/`` folder, for
  ``extra_sql`` (the ``ingest_schema_sql`` fixture) while the package is not installed;
- ``message(type, payload)``: a message body as a producer would send it;
- ``Runner(dsn).run(bodies)``: bodies through receive -> parse -> claim -> apply -> complete
  -> ack, with the real ``Store`` on that database and an in-memory queue
  (``service.testing.FakeQueue``); returns each message's ``Outcome``;
- ``check_lands_once(...)``: runs a body alone, then again beside a neighbour whose handler
  fails in the same batch (the transaction is rolled back and rerun without it, so the
  handler runs twice) and proves the database effect is the same — the one property a
  handler author can break (an effect outside the given connection lands twice).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import BaseModel

from service.core.registry import HandlerSpec, Registry, default_registry

__all__ = [
    "FAILING_TYPE",
    "ExistingPostgres",
    "Outcome",
    "Postgres",
    "Runner",
    "check_lands_once",
    "create_template",
    "free_port",
    "handler_migrations",
    "message",
    "postgres_server",
]

#: The message type of the failing neighbour ``check_lands_once`` puts in the batch.
FAILING_TYPE = "sqs_ingest.kit.failing_neighbour"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pg_bin(name: str) -> str:
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (d / name).exists():
            return str(d / name)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"PostgreSQL binary {name} not found (apt-get install postgresql)")
    return found


def _run_as_postgres(cmd: list[str]) -> None:
    if os.geteuid() == 0:  # initdb refuses root
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@dataclass
class Postgres:
    """A throwaway cluster: ``dsn(db)`` to connect, ``stop``/``start`` to bounce it."""

    port: int
    datadir: str
    sockdir: str
    user: str = "postgres"

    def dsn(self, db: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{db}"

    def stop(self, mode: str = "fast") -> None:
        self._ctl("stop", "-m", mode)

    def start(self) -> None:
        self._ctl(
            "start", "-l", os.path.join(self.datadir, "server.log"), "-o",
            # fsync=off survives a killed server (the OS keeps the WAL); synchronous_commit=off
            # would not: the chaos tests stop PostgreSQL with -m immediate.
            f"-p {self.port} -k {self.sockdir} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c max_connections=300",
        )

    def _ctl(self, *args: str) -> None:
        _run_as_postgres([_pg_bin("pg_ctl"), "-w", "-D", self.datadir, *args])


@dataclass(frozen=True)
class ExistingPostgres:
    """A PostgreSQL server you already run, by URL (``postgresql://user:pass@host:port/db``).
    The kit creates its template and per-test databases there and drops them afterwards, so
    the role needs ``CREATEDB``; ``dsn()`` is the URL's own database (for the admin
    statements), ``dsn(name)`` the same server and credentials with another database."""

    url: str

    def dsn(self, db: str | None = None) -> str:
        if db is None:
            return self.url
        parts = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit(parts._replace(path="/" + db))


def message(type_: str, payload: Mapping[str, Any] | BaseModel, *,
            request_id: str | None = None, sent_at: str | None = None,
            sns: bool = False) -> str:
    """A message body as a producer sends it: the envelope ``{"request_id", "type",
    "payload"}`` (a new request_id unless given; ``sent_at`` when given), as JSON; with
    ``sns=True`` wrapped in an SNS Notification envelope, as SNS delivers it to SQS."""
    data = payload.model_dump(mode="json") if isinstance(payload, BaseModel) else dict(payload)
    envelope: dict[str, Any] = {"request_id": request_id or f"kit-{uuid.uuid4()}",
                                "type": type_, "payload": data}
    if sent_at is not None:
        envelope["sent_at"] = sent_at
    body = json.dumps(envelope)
    if sns:
        body = json.dumps({"Type": "Notification", "MessageId": str(uuid.uuid4()),
                           "TopicArn": "arn:aws:sns:us-east-1:000000000000:kit",
                           "Message": body})
    return body


@contextlib.contextmanager
def postgres_server() -> Iterator[Postgres]:
    """Start a cluster from ``initdb`` on a free port; stop and delete it afterwards."""
    base = tempfile.mkdtemp(prefix="ingest-pg-")
    datadir, sockdir = os.path.join(base, "data"), os.path.join(base, "sock")
    os.makedirs(sockdir)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for p in (base, sockdir):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    user = "postgres" if os.geteuid() == 0 else pwd.getpwuid(os.geteuid()).pw_name
    _run_as_postgres([_pg_bin("initdb"), "-A", "trust", "-U", user, "-D", datadir])
    pg = Postgres(port=free_port(), datadir=datadir, sockdir=sockdir, user=user)
    pg.start()
    try:
        yield pg
    finally:
        with contextlib.suppress(Exception):
            pg.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


async def create_template(pg: Postgres | ExistingPostgres, name: str,
                          extra_sql: Sequence[str] = ()) -> None:
    """Create database ``name`` on ``pg``, migrated (sqs-ingest's migrations, then those of
    every installed handler package, as ``sqs-ingest migrate`` applies them), with
    ``extra_sql`` run in it: the template each test's database is copied from
    (``CREATE DATABASE … TEMPLATE name``)."""
    from service.adapters.migrate import migrate  # the runner pulls in the CLI's dependencies

    conn = await asyncpg.connect(pg.dsn())
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    await migrate(pg.dsn(name))
    if extra_sql:
        conn = await asyncpg.connect(pg.dsn(name))
        try:
            for sql in extra_sql:
                await conn.execute(sql)
        finally:
            await conn.close()


def handler_migrations(package: str) -> list[str]:
    """The SQL of ``package``'s ``migrations/NNN_name.sql``, in order, for ``extra_sql`` (the
    ``ingest_schema_sql`` fixture) while the package is importable but not installed (once it
    is installed, ``create_template`` applies its migrations itself: do not list them twice).
    A ``-- sqs-ingest: no-transaction`` file comes as its statements, one item each."""
    import importlib.resources

    from service.adapters.migrate import load_migrations, statements

    folder = Path(str(importlib.resources.files(package) / "migrations"))
    sql: list[str] = []
    for mig in load_migrations(folder):
        sql += [mig.sql] if mig.transactional else statements(mig.sql)
    return sql


@dataclass(frozen=True)
class Outcome:
    """What became of one message: ``completed`` (``result`` is what the handler returned),
    ``duplicate``, ``dead_lettered`` (``reason``, ``error``) or ``retried`` (handed back)."""

    message_id: str
    request_id: str | None
    outcome: str
    result: Any = None
    reason: str | None = None
    error: str | None = None


class Runner:
    """Pushes bodies through the daemon's batch path against a migrated database."""

    def __init__(self, dsn: str, registry: Registry | None = None) -> None:
        self.dsn = dsn
        self.registry = registry or default_registry

    async def run(self, bodies: Sequence[str]) -> list[Outcome]:
        """One receive per ten bodies, in order (one batch, as SQS would hand them out)."""
        from service.adapters.store import Store, create_pool
        from service.core.retry import ReceiveLimit, RetryPolicy
        from service.handlers import load_reference_handlers
        from service.runtime.batch import BatchProcessor
        from service.runtime.dbhealth import DatabaseHealth
        from service.testing import FakeQueue

        load_reference_handlers()
        pool = await create_pool(self.dsn, 4)
        try:
            store = Store(pool, f"kit-{uuid.uuid4().hex[:8]}")
            await store.register_worker("kit")
            queue = FakeQueue()
            fatal: list[Any] = []

            async def _noop() -> None:
                return None

            health = DatabaseHealth(store, asyncio.Event(), _noop)
            processor = BatchProcessor(
                queue, store, self.registry, RetryPolicy(), health, fifo=False,
                visibility_timeout=30, handler_timeout=60,
                fatal=lambda *a, **k: fatal.append((a, k)),
                limit=ReceiveLimit(RetryPolicy().max_failures))
            ids: list[str] = []
            for i in range(0, len(bodies), 10):
                sent = [queue.send(b) for b in bodies[i:i + 10]]
                batch = await queue.receive(10, 0, 30)
                assert [m.message_id for m in batch] == sent, "the in-memory queue lost order"
                await processor.run(batch)
                ids += sent
            if fatal:
                raise RuntimeError(f"the batch path stopped the worker: {fatal}")
            return await self._outcomes(pool, ids, bodies, set(queue.deleted))
        finally:
            await pool.close()

    async def _outcomes(self, pool: asyncpg.Pool, ids: list[str], bodies: Sequence[str],
                        acked: set[str]) -> list[Outcome]:
        letters = {r["sqs_message_id"]: r for r in await pool.fetch(
            "SELECT sqs_message_id, reason, error FROM dead_letters "
            "WHERE sqs_message_id = ANY($1::text[])", ids)}
        done = {r["sqs_message_id"]: r for r in await pool.fetch(
            "SELECT sqs_message_id, result FROM modifications WHERE status = 'COMPLETED' "
            "AND sqs_message_id = ANY($1::text[])", ids)}
        out = []
        for mid, body in zip(ids, bodies, strict=True):
            rid = _request_id(body, self.registry)
            if mid in letters:
                out.append(Outcome(mid, rid, "dead_lettered", reason=letters[mid]["reason"],
                                   error=letters[mid]["error"]))
            elif mid in acked and mid in done:
                result = done[mid]["result"]
                out.append(Outcome(mid, rid, "completed",
                                   json.loads(result) if isinstance(result, str) else result))
            elif mid in acked:
                out.append(Outcome(mid, rid, "duplicate"))
            else:
                out.append(Outcome(mid, rid, "retried"))
        return out


def _request_id(body: str, registry: Registry | None = None) -> str | None:
    """The body's request_id as the daemon reads it (through the registry's envelope
    mapping, when it has one)."""
    if registry is not None and registry.envelope is not None:
        from service.core.messages import Received, parse

        return parse(Received("kit", "kit", body), registry).request_id
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    rid = doc.get("request_id") if isinstance(doc, dict) else None
    return rid if isinstance(rid, str) else None


class _Failing(BaseModel):
    pass


async def _fail(_payload: _Failing, _conn: asyncpg.Connection) -> None:
    raise RuntimeError("the failing neighbour of check_lands_once fails on purpose")


def _counting(registry: Registry, calls: Counter[str]) -> Registry:
    """A copy of ``registry`` whose handlers count their calls per request_id, plus the
    failing neighbour's type."""
    from service.handlers import current_request_id

    def wrap(spec: HandlerSpec) -> HandlerSpec:
        async def fn(payload: Any, conn: asyncpg.Connection) -> Any:
            calls[current_request_id() or ""] += 1
            return await spec.fn(payload, conn)

        # Without its batch form: a message alone of its type runs the plain handler in the
        # daemon too, and one-by-one runs keep the batch's order (the body before the
        # failing neighbour, so the failure comes after the handler's effect).
        return dataclasses.replace(spec, fn=fn, batch_fn=None)

    copy = Registry()
    for t in registry.types():
        spec = registry.get(t)
        assert spec is not None
        copy._specs[t] = wrap(spec)
    copy.register(FAILING_TYPE, _Failing, _fail)
    return copy


async def check_lands_once(
    new_database: Callable[[], Awaitable[str]],
    body: str,
    snapshot: Callable[[asyncpg.Connection], Awaitable[Any]],
    registry: Registry | None = None,
) -> Any:
    """Fail (AssertionError) unless ``body``'s database effect is the same whether it runs
    alone or beside a neighbour that fails in its batch and makes its handler run again.

    ``new_database()`` gives a fresh migrated database each call (the ``ingest_database_factory``
    fixture); ``snapshot(conn)`` reads the effect (e.g. ``SELECT * FROM invoices ORDER BY id``).
    Returns the snapshot.
    """
    calls: Counter[str] = Counter()
    reg = _counting(registry or default_registry, calls)
    rid = _request_id(body)
    assert rid, "the body needs a request_id"
    neighbour = json.dumps({"request_id": f"kit-neighbour-{uuid.uuid4().hex[:8]}",
                            "type": FAILING_TYPE, "payload": {}})
    snaps = []
    for bodies in ([body], [body, neighbour]):
        dsn = await new_database()
        outcomes = await Runner(dsn, reg).run(bodies)
        assert outcomes[0].outcome == "completed", f"{rid}: {outcomes[0]}"
        conn = await asyncpg.connect(dsn)
        try:
            snaps.append(await snapshot(conn))
        finally:
            await conn.close()
    assert outcomes[1].outcome == "retried", f"the neighbour did not fail: {outcomes[1]}"
    assert calls[rid] >= 3, (
        f"{rid}'s handler ran {calls[rid]} time(s) in all: the rerun after the neighbour's "
        "failure did not happen, nothing was proven")
    assert snaps[0] == snaps[1], (
        f"{rid}: the effect differs when a neighbour fails and the batch is rerun "
        f"(alone: {snaps[0]!r}; with the failing neighbour: {snaps[1]!r}) — an effect made "
        "outside the handler's connection lands again on the rerun")
    return snaps[1]

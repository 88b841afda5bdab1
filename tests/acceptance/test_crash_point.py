"""The moment exactly-once exists for, made to happen on purpose: the daemon dies right
after a batch's commit and before any of its deletes (INGEST_TEST_CRASH_AT, a crash point the
harness installs: tests/crashpoint.py); restarted, it meets each committed message again and
resolves it as a duplicate — no effect twice. And the ledger check's broken twin: a handler
that applies twice turns it red."""

from __future__ import annotations

import signal
from typing import Any

import asyncpg
import pytest

from tests.acceptance.harness import (
    Daemon,
    Workload,
    check_ledger,
    counted,
    daemon_env,
    ledger,
    ledger_rows,
    queue_depth,
    send_all,
    upsert,
    wait_drained,
)

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

CRASH = "after_commit_before_delete"


def ledger_only(w: Workload, n: int, prefix: str) -> list[str]:
    """``n`` ledger appends (the counting effect), each sent once, recorded in ``w``."""
    out = []
    for i in range(n):
        rid, group = f"{prefix}-{i}", f"g{i % 4}"
        w.valid[rid] = ("ledger.append", group, i)
        out.append(ledger(rid, group, i))
    return out


async def completed_ids(dsn: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r["request_id"] for r in await conn.fetch(
            "SELECT request_id FROM modifications WHERE status = 'COMPLETED'")}
    finally:
        await conn.close()


async def crash_at_first_commit(spawn: Any, env: dict[str, str],
                                database_url: str) -> tuple[Daemon, set[str]]:
    """The daemon started with the crash point armed; it dies by its own SIGKILL there (its
    line is the last thing it wrote), after a commit. Returns it and the committed requests."""
    d: Daemon = spawn({**env, "INGEST_TEST_CRASH_AT": CRASH})
    assert d.wait(60) == -signal.SIGKILL, d.logs()
    marker = f"crash_point {CRASH}: SIGKILL (INGEST_TEST_CRASH_AT)"
    assert d.full_logs().rstrip().endswith(marker), d.logs()
    committed = await completed_ids(database_url)
    assert committed, "the crash came before any commit"
    return d, committed


def restart_and_drain(d: Daemon, sqs_client: Any, queue_url: str, sent: int,
                      committed: set[str]) -> None:
    """Restarted unarmed: each committed message comes back and is resolved as a duplicate
    (acked, not applied); the rest are applied once by the new process."""
    d.env.pop("INGEST_TEST_CRASH_AT")
    d.start()
    wait_drained(sqs_client, queue_url, [d])
    outcomes = counted(d, {"duplicate": len(committed), "completed": sent - len(committed)})
    assert outcomes["completed"] == sent - len(committed), outcomes
    assert d.stop() == 0, d.logs()


async def test_crash_after_commit_before_delete_resolves_as_duplicates(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, spawn: Any
) -> None:
    queue_url = make_queue(visibility=5)
    w = Workload()
    bodies = ledger_only(w, 40, "c")
    send_all(sqs_client, queue_url, bodies)
    env = daemon_env(database_url, queue_url, sqs_endpoint, INGEST_POLLERS="1")
    d, committed = await crash_at_first_commit(spawn, env, database_url)
    # ...after a commit: the batch's requests are COMPLETED and their effects are there...
    check_ledger(await ledger_rows(database_url), {r: w.valid[r][1:] for r in committed})
    # ...and before any delete: every message sent is still on the queue.
    assert queue_depth(sqs_client, queue_url) == len(bodies)

    restart_and_drain(d, sqs_client, queue_url, len(bodies), committed)
    check_ledger(await ledger_rows(database_url), w.ledger_entries())


async def entity_rows(dsn: str) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r["entity_id"]: r["request_id"] for r in await conn.fetch(
            "SELECT entity_id, request_id FROM entities")}
    finally:
        await conn.close()


async def test_a_crash_after_the_reference_handlers_one_statement_resolves_as_duplicates(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, spawn: Any
) -> None:
    """The same moment on the reference handlers' path (distinct entities, no handler of
    the user's: each batch one statement, its own commit)."""
    queue_url = make_queue(visibility=5)
    bodies = [upsert(f"u-{i}", f"e-{i}", 1) for i in range(40)]
    send_all(sqs_client, queue_url, bodies)
    env = daemon_env(database_url, queue_url, sqs_endpoint, INGEST_POLLERS="1")
    d, committed = await crash_at_first_commit(spawn, env, database_url)
    # the committed requests' entities, and no other
    assert await entity_rows(database_url) == {f"e-{r[2:]}": r for r in committed}
    assert queue_depth(sqs_client, queue_url) == len(bodies)

    restart_and_drain(d, sqs_client, queue_url, len(bodies), committed)
    assert await entity_rows(database_url) == {f"e-{i}": f"u-{i}" for i in range(40)}
    assert await completed_ids(database_url) == {f"u-{i}" for i in range(40)}


async def test_the_ledger_check_sees_a_handler_that_applies_twice(
    sqs_client: Any, sqs_endpoint: str, make_queue: Any, database_url: str, spawn: Any
) -> None:
    """The broken twin: the same workload through a ledger handler whose effect escapes the
    transaction and whose first attempt fails — every request's effect lands twice."""
    queue_url = make_queue(visibility=5)
    w = Workload()
    send_all(sqs_client, queue_url, ledger_only(w, 10, "b"))
    env = daemon_env(database_url, queue_url, sqs_endpoint, INGEST_POLLERS="1",
                     INGEST_HANDLERS="tests.acceptance.broken_ledger_handlers")
    d = spawn(env)
    wait_drained(sqs_client, queue_url, [d])
    assert d.stop() == 0, d.logs()
    rows = await ledger_rows(database_url)
    # The twin really applied more than once: at least twice per request (how many more
    # depends on how receives cut the batches, and so on the machine's load).
    assert len(rows) >= 2 * len(w.ledger_entries())
    with pytest.raises(AssertionError, match="effects applied more than once"):
        check_ledger(rows, w.ledger_entries())

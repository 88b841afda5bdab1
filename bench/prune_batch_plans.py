"""One prune batch, the statement as it was (``IN (SELECT …)``) against as it is
(``= ANY(ARRAY(SELECT …))``), on a throwaway PostgreSQL with ROWS rows in each table (half
past the retention):

    .venv/bin/python bench/prune_batch_plans.py          # ROWS=1000000 BATCH=5000

For ``retry_attempts``, ``outbox`` and ``dead_letters``: each form's time for one batch
(run in a transaction, rolled back; the two forms alternated, ROUNDS times) and the first
lines of its plan. The semi-join form scans the whole table per batch; the array form
deletes the batch by primary-key probes.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import asyncpg

from service.testing.kit import create_template
from tests.servers import Postgres, postgres_server

ROWS = int(os.environ.get("ROWS", "1000000"))
BATCH = int(os.environ.get("BATCH", "5000"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
RETENTION = 30 * 86400.0
AGE = "now() - (CASE WHEN g % 2 = 0 THEN interval '40 days' ELSE interval '1 day' END)"

FILL = {
    "retry_attempts": "INSERT INTO retry_attempts (request_id, failures, last_error, updated_at)"
                      f" SELECT 'r' || g, 1, 'e', {AGE} FROM generate_series(1, $1) g",
    "outbox": "INSERT INTO outbox (request_id, status, published_at)"
              f" SELECT 'r' || g, 'COMPLETED', {AGE} FROM generate_series(1, $1) g",
    "dead_letters": "INSERT INTO dead_letters (sqs_message_id, body, reason, replayed_at)"
                    f" SELECT 'm' || g, 'b', 'invalid_json', {AGE} FROM generate_series(1, $1) g",
}
#: table -> (key, time column)
TABLES = {"retry_attempts": ("request_id", "updated_at"), "outbox": ("id", "published_at"),
          "dead_letters": ("id", "replayed_at")}


def statements(table: str) -> dict[str, str]:
    key, col = TABLES[table]
    pick = (f"SELECT {key} FROM {table} WHERE {col} < now() - make_interval(secs => $1)"
            f" ORDER BY {col} LIMIT $2 FOR UPDATE SKIP LOCKED")
    return {"IN (SELECT)": f"DELETE FROM {table} WHERE {key} IN ({pick})",
            "= ANY(ARRAY(SELECT))": f"DELETE FROM {table} WHERE {key} = ANY(ARRAY({pick}))"}


async def one_batch(conn: asyncpg.Connection, sql: str) -> float:
    tx = conn.transaction()
    await tx.start()
    try:
        t = time.perf_counter()
        await conn.execute(sql, RETENTION, BATCH)
        return time.perf_counter() - t
    finally:
        await tx.rollback()


async def main(pg: Postgres) -> None:
    await create_template(pg, "prune_plans")
    conn = await asyncpg.connect(host="127.0.0.1", port=pg.port, user=pg.user,
                                 database="prune_plans")
    for table, fill in FILL.items():
        await conn.execute(fill, ROWS)
        await conn.execute(f"ANALYZE {table}")
    print(f"ROWS={ROWS} per table (half past the retention), BATCH={BATCH}, ROUNDS={ROUNDS}")
    for table in TABLES:
        times: dict[str, list[float]] = {form: [] for form in statements(table)}
        for r in range(ROUNDS):
            forms = list(statements(table).items())
            for form, sql in forms if r % 2 == 0 else forms[::-1]:
                times[form].append(await one_batch(conn, sql))
        for form, sql in statements(table).items():
            plan = await conn.fetch("EXPLAIN " + sql.replace("$1", str(RETENTION))
                                    .replace("$2", str(BATCH)))
            ms = [round(1000 * t) for t in times[form]]
            print(f"{table:15s} {form:21s} median {statistics.median(ms):5.0f} ms {ms}  plan: "
                  + " / ".join(p[0].strip() for p in plan[1:3]))
    await conn.close()


if __name__ == "__main__":
    with postgres_server() as server:
        asyncio.run(main(server))

"""What ``modifications``' fillfactor trades: WAL per message against heap per row, on a
throwaway PostgreSQL with the migrated schema (all of its indexes):

    .venv/bin/python bench/fillfactor.py        # FILLFACTORS=100,85,70,50 ROWS=90000 LAG=16

A model of the daemon's write pattern in SQL, not the daemon: batches of 30 claims (INSERT
IN_PROGRESS rows of a ~300-byte payload, as bench/throughput.py's messages), each completed
(UPDATE to COMPLETED, the result set) LAG batches later — the batches in flight between a
claim and its completion — every statement its own transaction, VACUUM every 9,000 rows (the
role autovacuum plays). A row's completion is written on its own page when the page has room
for it: a smaller WAL record (PostgreSQL logs only the changed middle of a tuple updated in
place) and no second record to lock the old version. Room left on every page is the price:
the table is that much larger for as long as its rows are kept. The default (100) stays;
docs/operations/sizing.md says how to change it and what it costs.
"""

from __future__ import annotations

import asyncio
import os

import asyncpg

from service.testing.kit import create_template
from tests.servers import Postgres, postgres_server

FILLFACTORS = [int(f) for f in os.environ.get("FILLFACTORS", "100,85,70,50").split(",")]
ROWS = int(os.environ.get("ROWS", "90000"))
LAG = int(os.environ.get("LAG", "16"))
BATCH = 30
VACUUM_EVERY = 9000

MODEL = """
CREATE TABLE pending (batch int PRIMARY KEY, ids bigint[]);
CREATE PROCEDURE model(first int, last int, claims_until int, lag int) LANGUAGE plpgsql AS $$
DECLARE b int; ids bigint[];
BEGIN
  FOR b IN first .. last LOOP
    IF b <= claims_until THEN
      WITH claimed AS (
        INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,
                                   sqs_message_id, owner, sent_at, claim_token)
        SELECT format('r-%s-%s', b, i), 'entity.upsert',
               jsonb_build_object('entity_id', format('e-%s-%s', b, i), 'version', 1,
                 'data', jsonb_build_object('name', 'customer ' || i,
                   'email', format('user%s@example.com', i), 'plan', 'pro', 'seats', i % 50,
                   'tags', jsonb_build_array('bench', 'throughput'),
                   'note', repeat('x', 120))),
               md5(b::text || '-' || i) || md5(i::text), 'IN_PROGRESS', gen_random_uuid()::text,
               'w-1', now(), gen_random_uuid()
          FROM generate_series(1, 30) i
        RETURNING id)
      INSERT INTO pending SELECT b, array_agg(id) FROM claimed;
      COMMIT;
    END IF;
    SELECT p.ids INTO ids FROM pending p WHERE p.batch = b - lag;
    IF ids IS NOT NULL THEN
      UPDATE modifications SET status = 'COMPLETED', completed_at = statement_timestamp(),
                               result = '{"applied": true}'
       WHERE id = ANY(ids) AND status = 'IN_PROGRESS';
      DELETE FROM pending p WHERE p.batch = b - lag;
      COMMIT;
    END IF;
  END LOOP;
END $$
"""


async def one(pg: Postgres, ff: int) -> tuple[float, float]:
    name = f"fillfactor_{ff}"
    admin = await asyncpg.connect(pg.dsn())
    try:
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE fillfactor_template")
    finally:
        await admin.close()
    conn = await asyncpg.connect(host="127.0.0.1", port=pg.port, user=pg.user, database=name)
    try:
        await conn.execute(f"ALTER TABLE modifications SET (fillfactor = {ff},"
                           " autovacuum_enabled = off)")
        await conn.execute(MODEL)
        wal0 = await conn.fetchval("SELECT pg_current_wal_lsn()::text")
        batches = ROWS // BATCH
        step = VACUUM_EVERY // BATCH
        for first in range(1, batches + LAG + 1, step):
            last = min(first + step - 1, batches + LAG)
            await conn.execute(f"CALL model({first}, {last}, {batches}, {LAG})")
            await conn.execute("VACUUM modifications")
        wal = await conn.fetchval(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)", wal0)
        heap = await conn.fetchval("SELECT pg_relation_size('modifications')")
        rows = await conn.fetchval("SELECT count(*) FROM modifications WHERE status = 'COMPLETED'")
        assert rows == batches * BATCH, rows
        return float(wal) / rows, float(heap) / rows
    finally:
        await conn.close()


async def main(pg: Postgres) -> None:
    await create_template(pg, "fillfactor_template")
    print(f"ROWS={ROWS} (batches of {BATCH}, completed {LAG} batches later,"
          f" VACUUM every {VACUUM_EVERY})")
    print("| fillfactor | WAL bytes per message | heap bytes per row |")
    print("| ---: | ---: | ---: |")
    base = None
    for ff in FILLFACTORS:
        wal, heap = await one(pg, ff)
        base = base or (wal, heap)
        print(f"| {ff} | {wal:,.0f} ({wal / base[0]:.2f}x) | {heap:,.0f} ({heap / base[1]:.2f}x) |",
              flush=True)


if __name__ == "__main__":
    with postgres_server() as server:
        asyncio.run(main(server))

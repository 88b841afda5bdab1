"""How long a FIFO group waits behind a claim left by a killed daemon (issue 25).

    .venv/bin/python bench/fifo_orphan_wait.py            # REPEAT=3 per mode
    REPEAT=5 MODES=named,unnamed .venv/bin/python bench/fifo_orphan_wait.py

Starts a throwaway PostgreSQL and LocalStack (SQS, host mode; tests/servers.py). Per run, on
a fresh database and FIFO queue (VisibilityTimeout 5 s): a group's head ``chaos.slow``
(3 s handler) and a follower ``ledger.append`` are sent; once the head is claimed the daemon
is killed -9 and started again at once. Measured from the kill: ``reclaimed`` — the head is
claimed again (its orphaned claim released and the message redelivered), and ``follower`` —
the follower is completed. Modes: ``named`` (``INGEST_WORKER_NAME`` set, the same across
the restart: the startup GC releases the previous incarnation's claims at once) and
``unnamed`` (no name: the claim waits for the lease). Production defaults for the lease
(30 s), the GC interval (10 s) and the contention delay (5 s). Writes JSON to bench/results/.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
import boto3  # noqa: E402

from service.adapters.migrate import migrate  # noqa: E402
from tests.acceptance.chaos_handlers import LEDGER_DDL  # noqa: E402
from tests.acceptance.harness import Daemon, daemon_env, ledger  # noqa: E402
from tests.servers import localstack_server, postgres_server, wait_until  # noqa: E402

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")

EFFECTS_DDL = "CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, request_id text NOT NULL)"


def fetchval(dsn: str, sql: str, *args: Any) -> Any:
    async def go() -> Any:
        conn = await asyncpg.connect(dsn)
        try:
            return await conn.fetchval(sql, *args)
        finally:
            await conn.close()

    return asyncio.run(go())


async def fresh(admin: str, base: str) -> str:
    name = "b_" + uuid.uuid4().hex[:10]
    conn = await asyncpg.connect(admin)
    try:
        await conn.execute(f"CREATE DATABASE {name}")
    finally:
        await conn.close()
    dsn = base.rsplit("/", 1)[0] + "/" + name
    await migrate(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(LEDGER_DDL)
        await conn.execute(EFFECTS_DDL)
    finally:
        await conn.close()
    return dsn


def one_run(endpoint: str, dsn: str, named: bool, log_dir: Path) -> dict[str, float]:
    sqs: Any = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
    url = sqs.create_queue(QueueName=f"orphan-{uuid.uuid4().hex[:8]}.fifo", Attributes={
        "FifoQueue": "true", "ContentBasedDeduplication": "true",
        "VisibilityTimeout": "5"})["QueueUrl"]
    extra = {"INGEST_WORKER_LEASE": "30", "INGEST_GC_INTERVAL": "10",
             "INGEST_CONTENTION_DELAY": "5", "CHAOS_DIR": str(log_dir)}
    if named:
        extra["INGEST_WORKER_NAME"] = "replica-0"
    d = Daemon(daemon_env(dsn, url, endpoint, **extra), log_dir)
    d.start()
    try:
        d.wait_ready(60)
        head = json.dumps({"request_id": "head", "type": "chaos.slow",
                           "payload": {"seconds": 3}})
        for body in (head, ledger("follower", "G", 2)):
            sqs.send_message(QueueUrl=url, MessageBody=body, MessageGroupId="G")
        wait_until(lambda: fetchval(dsn, "SELECT owner FROM modifications"
                                         " WHERE request_id = 'head'") is not None,
                   60, "head claimed")
        first_owner = fetchval(dsn, "SELECT owner FROM modifications WHERE request_id='head'")
        d.kill9()
        killed = time.monotonic()
        d.start()
        reclaimed = follower = None
        deadline = killed + 180
        while time.monotonic() < deadline and follower is None:
            owner = fetchval(dsn, "SELECT owner FROM modifications WHERE request_id='head'")
            if reclaimed is None and owner is not None and owner != first_owner:
                reclaimed = time.monotonic() - killed
            if fetchval(dsn, "SELECT status FROM modifications"
                             " WHERE request_id='follower'") == "COMPLETED":
                follower = time.monotonic() - killed
            time.sleep(0.1)
        assert follower is not None and reclaimed is not None, d.logs()
        return {"reclaimed_s": round(reclaimed, 2), "follower_s": round(follower, 2)}
    finally:
        if not d.exited():
            d.kill9()


def main() -> None:
    repeat = int(os.environ.get("REPEAT", "3"))
    modes = os.environ.get("MODES", "named,unnamed").split(",")
    out: dict[str, Any] = {"repeat": repeat, "runs": []}
    with postgres_server() as pg, localstack_server("sqs") as ls:
        for i in range(repeat):
            for mode in modes:  # alternating: the machine's load hits both alike
                dsn = asyncio.run(fresh(pg.dsn(), pg.dsn()))
                with tempfile.TemporaryDirectory() as tmp:
                    r = one_run(ls.url, dsn, mode == "named", Path(tmp))
                r.update(mode=mode, run=i)
                print(json.dumps(r), flush=True)
                out["runs"].append(r)
    for mode in modes:
        runs = [r for r in out["runs"] if r["mode"] == mode]
        for key in ("reclaimed_s", "follower_s"):
            vals = [r[key] for r in runs]
            print(f"{mode:8} {key:12} median {statistics.median(vals):6.2f} "
                  f"min {min(vals):6.2f} max {max(vals):6.2f}  (n={len(vals)})")
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "fifo_orphan_wait.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

"""S3-offloaded payloads: how fast the daemon drains 1 MB pointer payloads, and its peak RSS.

    .venv/bin/python bench/s3_payloads.py                 # N=300 payloads of 1 MB
    N=200 PAYLOAD_BYTES=2000000 INFLIGHT=4,32 .venv/bin/python bench/s3_payloads.py

Starts a throwaway PostgreSQL and LocalStack (host mode, SERVICES=sqs,s3; tests/servers.py),
puts N ``entity.upsert`` payloads of PAYLOAD_BYTES JSON each in S3 and sends, for each, the
pointer body the AWS extended clients write (``ExtendedPayloadSize`` attribute included),
then runs ``python -m service run`` once per INGEST_MAX_INFLIGHT_BATCHES value in INFLIGHT
(default ``4,32``: 32 is the default of 8 pollers) on a fresh queue and database. Reported
per drain: payloads/s and MB/s (N / (max - min ``completed_at``)), the daemon's CPU ms per
payload, its peak RSS (VmHWM) and its RSS before the drain. Writes JSON to bench/results/.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import free_port, localstack_server, postgres_server, stop_process  # noqa: E402

REGION = "us-east-1"
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
POINTER = "software.amazon.payloadoffloading.PayloadS3Pointer"


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def preload(endpoint: str, bucket: str, url: str, run: str, n: int, size: int) -> float:
    """N objects of ``size`` bytes of JSON in S3 and their pointers in the queue."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
    blob = base64.b64encode(random.Random(1).randbytes(size * 3 // 4)).decode()
    started = time.monotonic()

    def put(i: int) -> dict[str, Any]:
        rid = f"{run}-{i}"
        body = json.dumps({"request_id": rid, "type": "entity.upsert", "payload": {
            "entity_id": rid, "version": 1, "data": {"i": i, "blob": blob}}}).encode()
        s3.put_object(Bucket=bucket, Key=rid, Body=body)
        return {"Id": str(i % 10), "MessageBody": json.dumps(
            [POINTER, {"s3BucketName": bucket, "s3Key": rid}]),
            "MessageAttributes": {"ExtendedPayloadSize": {
                "DataType": "Number", "StringValue": str(len(body))}}}

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        entries = list(pool.map(put, range(n)))
    for start in range(0, n, 10):
        sqs.send_message_batch(QueueUrl=url, Entries=entries[start:start + 10])
    return time.monotonic() - started


async def _database(admin_dsn: str, dsn: str, name: str) -> None:
    import asyncpg

    from service.adapters.migrate import migrate

    conn = await asyncpg.connect(admin_dsn)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    await migrate(dsn)


async def _window(dsn: str) -> tuple[int, float, float]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        r = await conn.fetchrow("SELECT count(*) AS n, extract(epoch FROM min(completed_at)) AS a,"
                                " extract(epoch FROM max(completed_at)) AS b FROM modifications"
                                " WHERE status = 'COMPLETED'")
        return int(r["n"]), float(r["a"] or 0), float(r["b"] or 0)
    finally:
        await conn.close()


def drain(pg: Any, endpoint: str, n: int, size: int, inflight: int, tag: str) -> dict[str, Any]:
    import boto3

    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    bucket = f"bench-{tag}"
    s3.create_bucket(Bucket=bucket)
    url = sqs.create_queue(QueueName=f"bench-{tag}", Attributes={"VisibilityTimeout": "120"})[
        "QueueUrl"]
    load_s = preload(endpoint, bucket, url, tag, n, size)
    dsn = pg.dsn(f"bench_{tag}")
    asyncio.run(_database(pg.dsn(), dsn, f"bench_{tag}"))
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           "INGEST_DATABASE_URL": dsn, "INGEST_QUEUE_URL": url,
           "INGEST_SQS_ENDPOINT_URL": endpoint, "INGEST_HTTP_PORT": str(port),
           "INGEST_HTTP_HOST": "127.0.0.1", "INGEST_MAX_INFLIGHT_BATCHES": str(inflight),
           "INGEST_LOG_LEVEL": "warning", "INGEST_PRUNE_INTERVAL": "0",
           "INGEST_S3_BUCKETS": bucket,
           **{k: v for k, v in os.environ.items() if k == "INGEST_MAX_PAYLOAD_BYTES"},
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "PYTHONPATH": str(ROOT)}
    log = tempfile.NamedTemporaryFile(prefix="bench-s3-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "service", "run"], env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # ready: the drain has not started yet (nothing sent before)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start; see {log.name}")
            time.sleep(0.1)
        rss_idle = proc_status(proc.pid, "VmRSS")
        cpu0 = proc_cpu(proc.pid)
        deadline = time.monotonic() + 900
        while (done := asyncio.run(_window(dsn)))[0] < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"drain stopped at {done[0]} of {n}; see {log.name}")
            time.sleep(0.5)
        cpu = proc_cpu(proc.pid) - cpu0
        peak = proc_status(proc.pid, "VmHWM")
    finally:
        stop_process(proc, 30)
    _, first, last = done
    seconds = max(last - first, 1e-6)
    return {"inflight_batches": inflight, "n": n, "payload_bytes": size,
            "preload_s": round(load_s, 1), "drain_s": round(seconds, 2),
            "payloads_per_s": round(n / seconds, 1),
            "mb_per_s": round(n * size / seconds / 1e6, 1),
            "cpu_ms_per_payload": round(cpu / n * 1000, 1),
            "rss_idle_mb": round(rss_idle / 2**20), "peak_rss_mb": round(peak / 2**20),
            # The README's bound on raw payload bytes held at once (not on Python objects).
            "raw_bound_mb": round(inflight * 10 * int(os.environ.get(
                "INGEST_MAX_PAYLOAD_BYTES", 10 * 2**20)) / 2**20)}


def main() -> int:
    n = int(os.environ.get("N", "300"))
    size = int(os.environ.get("PAYLOAD_BYTES", "1000000"))
    inflights = [int(x) for x in os.environ.get("INFLIGHT", "4,32").split(",")]
    out: list[dict[str, Any]] = []
    with postgres_server() as pg, localstack_server("sqs,s3") as ls:
        for i, inflight in enumerate(inflights):
            r = drain(pg, ls.url, n, size, inflight, f"{int(time.time())}{i}")
            out.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'in-flight batches':>18} {'payloads/s':>11} {'MB/s':>6} {'CPU ms/payload':>15}"
          f" {'RSS idle MB':>12} {'peak RSS MB':>12} {'raw bound MB':>13}")
    for r in out:
        print(f"{r['inflight_batches']:>18} {r['payloads_per_s']:>11} {r['mb_per_s']:>6}"
              f" {r['cpu_ms_per_payload']:>15} {r['rss_idle_mb']:>12} {r['peak_rss_mb']:>12}"
              f" {r['raw_bound_mb']:>13}")
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    path = results / f"s3_payloads-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps({"runs": out, "python": sys.version.split()[0]}, indent=1))
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 20's "done when": a backlog of 40 pointers to 6 MiB objects plus 200 inline messages
drains with the daemon's defaults inside the Kubernetes memory limit, and the same backlog
with small payloads for the drain-time comparison (same run).

    make bench-memory                                  # or: .venv/bin/python bench/memory_budget.py
    POINTERS=40 PAYLOAD_BYTES=6291456 INLINE=200 SHAPE=blob .venv/bin/python bench/memory_budget.py

Starts a throwaway PostgreSQL and LocalStack (host mode, SERVICES=sqs,s3). For each run, a
fresh queue, bucket and database: POINTERS ``entity.upsert`` payloads of PAYLOAD_BYTES JSON
in S3 (SHAPE ``blob``: one long string; ``records``: a list of small objects, the most RSS
per raw byte measured by bench/payload_memory.py), their pointer bodies and INLINE small
inline messages in the queue, then ``python -m service run`` with its defaults (only the
queue, database, endpoint, INGEST_S3_BUCKETS and the HTTP port set). Reported: drain time
(first to last ``completed_at``), the daemon's peak RSS (VmHWM) against the limit in
deploy/k8s/deployment.yaml, every entity compared with what was sent, and the exit code
after SIGTERM. Writes JSON to bench/results/.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.s3_payloads import _database, _window, proc_status  # noqa: E402
from tests.servers import free_port, localstack_server, postgres_server  # noqa: E402

REGION = "us-east-1"
os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
POINTER = "software.amazon.payloadoffloading.PayloadS3Pointer"


def k8s_limit_bytes() -> int:
    text = (ROOT / "deploy/k8s/deployment.yaml").read_text()
    m = re.search(r"limits:\s*\n(?:\s+\w+:.*\n)*?\s+memory:\s*\"?(\d+)Mi", text)
    assert m, "no memory limit in deploy/k8s/deployment.yaml"
    return int(m.group(1)) * 2**20


def data_of(shape: str, size: int, seed: int) -> dict[str, Any]:
    if shape == "records":
        rec = {"id": 0, "name": "abcdefghij", "price": 12.5, "tags": ["a", "b"], "ok": True}
        return {"seed": seed, "rows": [dict(rec, id=i) for i in range(size // 75)]}
    blob = base64.b64encode(random.Random(seed).randbytes(size * 3 // 4)).decode()
    return {"seed": seed, "blob": blob}


def run(pg: Any, endpoint: str, tag: str, pointers: int, size: int, inline: int,
        shape: str) -> dict[str, Any]:
    import asyncpg
    import boto3

    sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    bucket = f"mem-{tag}"
    s3.create_bucket(Bucket=bucket)
    url = sqs.create_queue(QueueName=f"mem-{tag}",
                           Attributes={"VisibilityTimeout": "120"})["QueueUrl"]
    sent: dict[str, dict[str, Any]] = {}
    bodies = []
    for i in range(pointers):
        eid = f"p{i}"
        sent[eid] = data_of(shape, size, i)
        body = json.dumps({"request_id": f"{tag}-{eid}", "type": "entity.upsert", "payload": {
            "entity_id": eid, "version": 1, "data": sent[eid]}}).encode()
        s3.put_object(Bucket=bucket, Key=eid, Body=body)
        bodies.append(json.dumps([POINTER, {"s3BucketName": bucket, "s3Key": eid}]))
    for i in range(inline):
        eid = f"i{i}"
        sent[eid] = {"seed": i, "note": "x" * 500}
        bodies.append(json.dumps({"request_id": f"{tag}-{eid}", "type": "entity.upsert",
                                  "payload": {"entity_id": eid, "version": 1,
                                              "data": sent[eid]}}))
    random.Random(7).shuffle(bodies)
    for start in range(0, len(bodies), 10):
        sqs.send_message_batch(QueueUrl=url, Entries=[
            {"Id": str(j), "MessageBody": b} for j, b in enumerate(bodies[start:start + 10])])
    name = f"mem_{tag}"
    dsn = pg.dsn(name)
    asyncio.run(_database(pg.dsn(), dsn, name))
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("INGEST_")},
           "INGEST_DATABASE_URL": dsn, "INGEST_QUEUE_URL": url,
           "INGEST_SQS_ENDPOINT_URL": endpoint, "INGEST_S3_BUCKETS": bucket,
           "INGEST_HTTP_PORT": str(port), "INGEST_HTTP_HOST": "127.0.0.1",
           # The budget is what is measured: a records payload of 6 MiB holds ~700,000
           # JSON values, over the default INGEST_MAX_JSON_VALUES (it would be dead-lettered
           # unparsed). MAX_JSON_VALUES=25000 measures the defaults.
           "INGEST_MAX_JSON_VALUES": os.environ.get("MAX_JSON_VALUES", str(2**31)),
           "PYTHONPATH": str(ROOT)}
    log = tempfile.NamedTemporaryFile(prefix="bench-mem-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "service", "run"], env=env, cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT)
    n = pointers + inline
    try:
        deadline = time.monotonic() + 60
        while True:
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
        deadline = time.monotonic() + 1800
        while (done := asyncio.run(_window(dsn)))[0] < n:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"drain stopped at {done[0]} of {n}; see {log.name}")
            time.sleep(0.5)
        peak = proc_status(proc.pid, "VmHWM")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    async def stored() -> dict[str, Any]:
        conn = await asyncpg.connect(dsn)
        try:
            return {r["entity_id"]: json.loads(r["data"]) for r in await conn.fetch(
                "SELECT entity_id, data FROM entities")}
        finally:
            await conn.close()

    got = asyncio.run(stored())
    _, first, last = done
    return {"shape": shape, "pointers": pointers, "payload_bytes": size, "inline": inline,
            "drain_s": round(last - first, 2), "rss_idle_mib": round(rss_idle / 2**20),
            "peak_rss_mib": round(peak / 2**20), "k8s_limit_mib": k8s_limit_bytes() // 2**20,
            "all_stored_as_sent": got == sent, "exit_code_after_sigterm": code,
            "log": log.name}


def main() -> int:
    pointers = int(os.environ.get("POINTERS", "40"))
    size = int(os.environ.get("PAYLOAD_BYTES", str(6 * 2**20)))
    inline = int(os.environ.get("INLINE", "200"))
    shape = os.environ.get("SHAPE", "blob")
    out = []
    with postgres_server() as pg, localstack_server("sqs,s3") as ls:
        for label, psize in (("large", size), ("small", 2_000)):
            r = run(pg, ls.url, f"{int(time.time())}{label}", pointers, psize, inline, shape)
            r["run"] = label
            out.append(r)
            print(json.dumps(r), flush=True)
    large, small = out
    print(f"\n{'run':<6} {'payload':>9} {'drain s':>8} {'RSS idle MiB':>13} {'peak RSS MiB':>13}"
          f" {'limit MiB':>10} {'as sent':>8} {'exit':>5}")
    for r in out:
        print(f"{r['run']:<6} {r['payload_bytes']:>9} {r['drain_s']:>8} {r['rss_idle_mib']:>13}"
              f" {r['peak_rss_mib']:>13} {r['k8s_limit_mib']:>10}"
              f" {r['all_stored_as_sent']!s:>8} {r['exit_code_after_sigterm']:>5}")
    ratio = large["drain_s"] / max(small["drain_s"], 1e-6)
    print(f"\ndrain time large / small: {ratio:.1f}x")
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    path = results / f"memory_budget-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps({"runs": out, "python": sys.version.split()[0]}, indent=1))
    print(f"written {path}")
    ok = all(r["peak_rss_mib"] < r["k8s_limit_mib"] and r["all_stored_as_sent"]
             and r["exit_code_after_sigterm"] == 0 for r in out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

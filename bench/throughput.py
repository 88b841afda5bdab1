"""Throughput benchmark of the daemon against LocalStack SQS and PostgreSQL, side by side.

    .venv/bin/python bench/throughput.py            # what `make bench` runs
    N=5000 .venv/bin/python bench/throughput.py     # smaller run
    LATENCY_MS=20 .venv/bin/python bench/throughput.py
    SOAK=600 .venv/bin/python bench/throughput.py
    PROFILE=1 .venv/bin/python bench/throughput.py  # adds a py-spy profile of a drain
    BASELINE=62e8dcf^ .venv/bin/python bench/throughput.py  # + old vs new code, interleaved
    PEER=sqs-consumer .venv/bin/python bench/throughput.py  # + daemon vs bbc/sqs-consumer
    PHASES=peer N=10000 ROUNDS=4 .venv/bin/python bench/throughput.py  # only that

Starts a throwaway PostgreSQL (tests/servers.py) and LocalStack's SQS in host mode (no
Docker; LocalStack 2026.3.0 on Python 3.13 in bench/.venv-localstack, made by
scripts/localstack-venv.sh if missing; without a 3.13 the tests' venv), preloads N
messages (~300-byte ``entity.upsert`` bodies) into a fresh queue for each phase and
measures, one after the other:

1. ceiling — an SQS-only drain: ReceiveMessage(10) + DeleteMessageBatch, no database, with
   the daemon's concurrency (INGEST_POLLERS receive loops, INGEST_MAX_INFLIGHT_BATCHES
   batches in flight, the same aiobotocore client), in its own process;
2. naive — one message at a time: receive 1, INSERT modification + upsert entity, COMMIT,
   DeleteMessage, in its own process;
3. daemon — ``python -m service run`` (= ``sqs-ingest run``) draining the queue; the rate
   is N / (max - min ``completed_at``) read from the database; CPU seconds per message
   from /proc/<pid>/stat (utime+stime, sampled, over the same window); peak RSS (VmHWM);
   p50/p99 of ``sqs_ingest_message_lag_seconds`` from /metrics.

Environment knobs: N (default 20000), NAIVE_N (default min(N, 5000): the naive loop runs
at a steady ~10 % of the others, 5,000 messages measure it as well as 20,000 do), LATENCY_MS
(adds a ceiling + daemon pair through tests/faultproxy.FaultProxy injecting that delay on
every SQS request), SOAK (seconds of steady load at SOAK_RATE msg/s, default 500;
reports RSS at start and end), COSTS_N / COSTS_RATE / COSTS_SECONDS (the counted cost
figures of the ``costs`` phase, bench/costs.py: a backlog of COSTS_N, default 3,000, and a
trickle of COSTS_RATE msg/s, default 50, for COSTS_SECONDS, default 30; then slow handlers
under the visibility heartbeat: COSTS_SLOW_RATE / COSTS_SLOW_SECONDS / COSTS_SLOW_HANDLER /
COSTS_SLOW_VT, COSTS_SLOW_SECONDS=0 skips it; with PEER set, the peer's backlog and trickle
counted the same way), PROFILE=1 (one more daemon drain under ``py-spy record``,
raw collapsed stacks + a summary; PROFILE=native with C frames), HOT_ENTITIES=K (every message writes one of K entities
instead of its own: batches with several writes of one entity), PHASES (default ``ceiling,naive,daemon,costs``; also
``compare``, ``results``, ``peer``). INGEST_*
variables set in the environment reach the daemon (and the ceiling's concurrency), so
settings can be compared: ``INGEST_POLLERS=8 make bench``.

Old code against new code: ``BASELINE=<git ref> make bench`` exports that ref (``git archive``
into a temporary directory, removed afterwards) and adds a "compare" step: ROUNDS (default 3)
rounds of one daemon drain from the baseline tree and one from the candidate tree — the
working tree, or CANDIDATE=<git ref> exported the same way — in ABBA order (old,new then
new,old, ...) so that drift and noise from other work on the machine hit both alike. Each
drain is the daemon phase above: a fresh queue and a fresh database migrated by *that*
tree's ``python -m service migrate`` (so each code sees exactly its own schema; /readyz,
which checks the schema, must answer 200), the same interpreter, PostgreSQL and LocalStack,
cwd and PYTHONPATH = that tree. Reported: per code the median (and min-max) msg/s and daemon
CPU us/msg, the ratio new/old of the medians and the spread of the per-round ratios, and
the daemon's CPU divided by LocalStack's in the same drain (LocalStack's code is the same
for both, so that ratio removes most of the machine's noise). With
PROFILE=1 the baseline gets a profiled drain too. PHASES=compare runs only the comparison.

Results out on vs off (issue 10): ``RESULTS=1 make bench`` (or PHASES=results for only that)
adds ROUNDS rounds of two drains of this code, without and with INGEST_RESULTS_QUEUE_URL (a
fresh LocalStack SQS queue; one SendMessageBatch per ten results), in ABBA order. Each "on"
drain waits until all N results are in the results queue; reported: ingestion rate and CPU
per message for both, the per-round on/off ratios, and how long the results took to leave
(last ``published_at`` after the first commit; commit-to-publish delay p50 and max).
RESULTS_SINKS (default ``localstack,null``): the destination — a LocalStack queue (its CPU
shares this machine's two cores with the daemon, so the ratio also counts the destination's
work), and/or ``null``, an in-process HTTP stub that accepts every SendMessageBatch at
almost no cost: what results cost the daemon and PostgreSQL with a remote destination.

The peer (issue 26): ``PEER=sqs-consumer make bench`` (or PHASES=peer, which only runs that)
adds ROUNDS rounds of two drains, bbc/sqs-consumer and the daemon (this working tree, its
defaults), in ABBA order (peer,daemon / daemon,peer / ...). The peer is bench/peer/peer.mjs
on node (>= 20, on PATH): sqs-consumer 14.2.8 (the version the issue measured),
@aws-sdk/client-sqs and pg, pinned in bench/peer/package.json and package-lock.json
(integrity hashes, no ``resolved`` URLs: bench/peer/.npmrc sets
omit-lockfile-registry-resolved, so npm takes the configured registry). The phase runs
``npm ci`` into bench/peer/node_modules (gitignored) when the installed tree did not come
from that lock file (a sha256 stamp), and checks the installed versions against package.json.
The peer runs 8 ``Consumer.create`` instances (sqs-consumer has no concurrency option: one
Consumer is one receive -> handle -> delete loop, so 8 consumers = at most 8 batches in
flight; the daemon runs 8 pollers and 32 batches) sharing one SQSClient and a pg.Pool of 8,
batchSize 10, 20 s long polls, and a ``handleMessageBatch`` that, in one transaction per
batch, parses each body, checks it by hand, hashes the key-sorted payload, INSERTs the batch
into ``modifications`` (status COMPLETED, completed_at = statement_timestamp()) with ``ON
CONFLICT (request_id) DO NOTHING`` and upserts the inserted requests' entities with the
reference handler's ``ON CONFLICT (entity_id) DO UPDATE ... WHERE e.version <
EXCLUDED.version`` — one unnest statement each (PEER_STATEMENTS=each: two statements per
message); then sqs-consumer deletes the batch (DeleteMessageBatch). It does not do what the
daemon does besides: the separate claim statement and owner fencing, retries, dead letters,
visibility heartbeats, metrics, logs. Each drain: a fresh queue and a fresh database
(migrated by this code), N preloaded; both are measured alike — rate = N / (max - min
``completed_at``) from the database, CPU per message = utime+stime of the consumer process
(node's, the daemon's) from /proc over that window, LocalStack's and PostgreSQL's too — and
every drain must leave N modifications and N entities. Reported: per round both drains, the
medians, daemon/peer per round (msg/s, CPU per message) with their spread, and the CPU ratio
against LocalStack's CPU in the same drain (the control, as in compare).

Prints a table and writes everything as JSON to bench/results/ (gitignored).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from service.settings import Settings  # noqa: E402
from tests.servers import LocalStack, free_port, postgres_server, wait_until  # noqa: E402
from tests.servers import localstack_server as _localstack_server  # noqa: E402

BENCH = ROOT / "bench"
RESULTS = BENCH / "results"
REGION = "us-east-1"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

os.environ.setdefault("AWS_ACCESS_KEY_ID", "test")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "test")
os.environ.setdefault("AWS_DEFAULT_REGION", REGION)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "").strip()
    return int(v) if v else default


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name, "").strip()
    return float(v) if v else default


def daemon_concurrency() -> tuple[int, int]:
    """(pollers, in-flight batches) exactly as the daemon will compute them."""
    fields = Settings.model_fields
    pollers = _env_int("INGEST_POLLERS", fields["pollers"].default)
    inflight = _env_int("INGEST_MAX_INFLIGHT_BATCHES", fields["max_inflight_batches"].default)
    probe = Settings(queue_url="http://127.0.0.1:1/q", database_url="postgresql://x@127.0.0.1/d",
                     pollers=pollers, max_inflight_batches=inflight)
    return pollers, probe.inflight_limit


# -- message bodies --------------------------------------------------------------------


HOT_ENTITIES = int(os.environ.get("HOT_ENTITIES", "0"))


def make_body(run: str, i: int) -> str:
    """~300 bytes: an entity.upsert of a distinct entity (no row contention) — or, with
    HOT_ENTITIES=K, of one of K entities (message i writes entity i mod K at version i + 1),
    so batches hold several writes of one entity."""
    entity = i % HOT_ENTITIES if HOT_ENTITIES else i
    doc = {
        "request_id": f"{run}-{i:08d}",
        "type": "entity.upsert",
        "payload": {
            "entity_id": f"ent-{run}-{entity:08d}",
            "version": i + 1 if HOT_ENTITIES else 1,
            "data": {"name": f"customer {i}", "email": f"user{i}@example.com",
                     "plan": "pro", "seats": i % 50, "tags": ["bench", "throughput"],
                     "note": "x" * 88},
        },
    }
    return json.dumps(doc, separators=(",", ":"))


# -- LocalStack (host mode): tests/servers.py, venv from scripts/localstack-venv.sh -------


BENCH_LOCALSTACK = ("2026.3.0", BENCH / ".venv-localstack")


def _python313() -> str | None:
    """pyenv's 3.13 (what BENCHMARKS.md measured with), or LOCALSTACK_PYTHON."""
    if os.environ.get("LOCALSTACK_PYTHON"):
        return os.environ["LOCALSTACK_PYTHON"]
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        root = os.path.expanduser("~/.pyenv")
    py = Path(root) / "versions" / "3.13.0" / "bin" / "python3"
    return str(py) if py.exists() else None


@contextlib.contextmanager
def localstack_server() -> Iterator[LocalStack]:
    """SQS only: the other services would cost CPU the drains compete for. LocalStack
    2026.3.0 on Python 3.13 in bench/.venv-localstack when this machine has a 3.13 (the
    figures in BENCHMARKS.md); otherwise the tests' venv (4.13.1 on the system Python)."""
    script = str(ROOT / "scripts" / "localstack-venv.sh")
    py = _python313()
    if py:
        version, venv = BENCH_LOCALSTACK
        subprocess.run([script, str(venv), version, py], check=True)
    else:
        subprocess.run([script], check=True)
        venv = ROOT / ".venv-localstack"
    with _localstack_server("sqs", venv) as ls:
        yield ls


def sqs_sync(endpoint: str) -> Any:
    import boto3

    return boto3.client("sqs", endpoint_url=endpoint, region_name=REGION)


def create_queue(endpoint: str, name: str) -> str:
    return str(sqs_sync(endpoint).create_queue(
        QueueName=name, Attributes={"VisibilityTimeout": "60"})["QueueUrl"])


def queue_depth(endpoint: str, url: str) -> int:
    a = sqs_sync(endpoint).get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages",
                                      "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    return int(a["ApproximateNumberOfMessages"]) + int(a["ApproximateNumberOfMessagesNotVisible"])


async def _send_all(endpoint: str, url: str, bodies: list[str], concurrency: int = 16) -> None:
    from service.adapters.sqs import sqs_client

    async with sqs_client(REGION, endpoint, max_pool_connections=concurrency + 4) as client:
        chunks = [bodies[i:i + 10] for i in range(0, len(bodies), 10)]
        it = iter(chunks)

        async def sender() -> None:
            for chunk in it:
                resp = await client.send_message_batch(QueueUrl=url, Entries=[
                    {"Id": str(j), "MessageBody": b} for j, b in enumerate(chunk)])
                if resp.get("Failed"):
                    raise RuntimeError(f"send failed: {resp['Failed'][:1]}")

        await asyncio.gather(*(sender() for _ in range(concurrency)))


def preload(endpoint: str, url: str, run: str, n: int) -> float:
    t0 = time.monotonic()
    asyncio.run(_send_all(endpoint, url, [make_body(run, i) for i in range(n)]))
    depth = wait_until(lambda: queue_depth(endpoint, url) >= n or None, 30, "queue depth")
    assert depth
    return n / (time.monotonic() - t0)


# -- /proc sampling --------------------------------------------------------------------


def proc_cpu(pid: int) -> float:
    """utime + stime of one process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status(pid: int, key: str) -> int:
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def children_cpu(ppid: int) -> float:
    """CPU of the direct children of ppid (PostgreSQL backends of the postmaster)."""
    total = 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == ppid:
            total += (int(fields[11]) + int(fields[12])) / CLK_TCK
    return total


class Sampler:
    """Samples CPU seconds and RSS of a few processes every ``interval`` seconds."""

    def __init__(self, pids: dict[str, int], postmaster: int | None, interval: float = 0.1):
        self.pids = pids
        self.postmaster = postmaster
        self.interval = interval
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()

    def sample(self) -> dict[str, float]:
        s: dict[str, float] = {"t": time.time()}
        for name, pid in self.pids.items():
            try:
                s[name + "_cpu"] = proc_cpu(pid)
                s[name + "_rss"] = proc_status(pid, "VmRSS")
            except OSError:
                pass
        if self.postmaster:
            s["postgres_cpu"] = proc_cpu(self.postmaster) + children_cpu(self.postmaster)
        return s

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval)
        self.samples.append(self.sample())

    def at(self, t: float, key: str) -> float:
        """Value of ``key`` at time t, linearly interpolated between samples."""
        pts = [(s["t"], s[key]) for s in self.samples if key in s]
        if not pts:
            return float("nan")
        if t <= pts[0][0]:
            return pts[0][1]
        for (t0, v0), (t1, v1) in itertools.pairwise(pts):
            if t0 <= t <= t1:
                return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0)
        return pts[-1][1]


def postmaster_pid(datadir: str) -> int | None:
    try:
        return int(Path(datadir, "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# -- metrics ---------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)')


def _gc_collections(metrics: dict[tuple[str, str], float]) -> list[float]:
    """python_gc_collections_total of generations 0, 1, 2."""
    return [sum(v for (k, labels), v in metrics.items()
                if k == "python_gc_collections_total" and f'generation="{g}"' in labels)
            for g in range(3)]


def scrape(port: int) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def histogram(metrics: dict[tuple[str, str], float], name: str) -> list[tuple[float, float]]:
    """Cumulative (upper bound, count) pairs of a histogram, sorted."""
    buckets = []
    for (n, labels), v in metrics.items():
        if n == name + "_bucket":
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                buckets.append((float(le.group(1)), v))
    return sorted(buckets)


def hist_delta(after: list[tuple[float, float]],
               before: list[tuple[float, float]] | None) -> list[tuple[float, float]]:
    if not before:
        return after
    b = dict(before)
    return [(le, v - b.get(le, 0.0)) for le, v in after]


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket that holds rank q."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, prev = 0.0, 0.0
    for le, cum in buckets:
        if cum >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - prev) / (cum - prev) if cum > prev else 0)
        lower, prev = le, cum
    return lower


# -- phases run in their own process (`throughput.py _ceiling …`, `… _naive …`) ---------


async def _ceiling_main(endpoint: str, url: str, n: int, pollers: int, inflight: int) -> dict:
    """The daemon's receive/ack skeleton with nothing in between: the SQS-only ceiling."""
    from service.adapters.sqs import SqsQueue, sqs_client

    deleted = 0
    first = last = 0.0
    cpu_first = 0.0
    done = asyncio.Event()
    slots = asyncio.Semaphore(inflight)
    tasks: set[asyncio.Task[None]] = set()
    # Same client settings as service/app.py.
    async with sqs_client(REGION, endpoint, max_pool_connections=pollers * 2 + 10) as client:
        queue = SqsQueue(client, url)

        async def batch(msgs: list[Any]) -> None:
            nonlocal deleted, first, last, cpu_first
            try:
                await queue.delete_batch(msgs)
            finally:
                slots.release()
            deleted += len(msgs)
            last = time.time()
            if not first:
                first, cpu_first = last, time.process_time()
            if deleted >= n:
                done.set()

        async def poll() -> None:
            while not done.is_set():
                await slots.acquire()
                msgs = await queue.receive(10, 20, 60)
                if not msgs:
                    slots.release()
                    continue
                t = asyncio.create_task(batch(msgs))
                tasks.add(t)
                t.add_done_callback(tasks.discard)

        loops = [asyncio.create_task(poll()) for _ in range(pollers)]
        await done.wait()
        cpu = time.process_time() - cpu_first
        for t in loops:
            t.cancel()
        await asyncio.gather(*loops, *tasks, return_exceptions=True)
    return {"n": deleted, "first": first, "last": last, "client_cpu": cpu}


NAIVE_INSERT = """
INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,
                           sqs_message_id, owner, completed_at)
VALUES ($1, $2, $3::jsonb, $4, 'COMPLETED', $5, 'naive', now())
ON CONFLICT (request_id) DO NOTHING
"""
NAIVE_ENTITY = """
INSERT INTO entities AS e (entity_id, version, deleted, data, request_id, updated_at)
VALUES ($1, $2, false, $3::jsonb, $4, now())
ON CONFLICT (entity_id) DO UPDATE
   SET version = EXCLUDED.version, data = EXCLUDED.data, request_id = EXCLUDED.request_id,
       updated_at = now()
 WHERE e.version < EXCLUDED.version
"""


async def _naive_main(endpoint: str, url: str, dsn: str, n: int) -> dict:
    """What a first hand-written loop does: one message, one transaction, one delete."""
    import hashlib

    import asyncpg
    from aiobotocore.session import get_session

    conn = await asyncpg.connect(dsn)
    done = 0
    first = last = 0.0
    async with get_session().create_client("sqs", region_name=REGION,
                                           endpoint_url=endpoint) as sqs:
        while done < n:
            resp = await sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=1,
                                             WaitTimeSeconds=20)
            for m in resp.get("Messages", []):
                doc = json.loads(m["Body"])
                payload = json.dumps(doc["payload"], sort_keys=True)
                async with conn.transaction():
                    await conn.execute(NAIVE_INSERT, doc["request_id"], doc["type"], payload,
                                       hashlib.sha256(payload.encode()).hexdigest(),
                                       m["MessageId"])
                    p = doc["payload"]
                    await conn.execute(NAIVE_ENTITY, p["entity_id"], p["version"],
                                       json.dumps(p["data"]), doc["request_id"])
                await sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
                done += 1
                last = time.time()
                first = first or last
    await conn.close()
    return {"n": done, "first": first, "last": last}


def _run_async(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def run_phase_process(args: list[str], timeout: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- code trees: old vs new (BASELINE=<ref>, CANDIDATE=<ref>) -----------------------------


@dataclass
class CodeTree:
    """The code one daemon drain runs: this checkout, or a git ref exported to a temp dir."""

    name: str  # "old" / "new"
    ref: str  # what was asked for ("62e8dcf^", "HEAD", "working tree")
    commit: str  # full commit id (HEAD's for the working tree)
    path: Path
    dirty: bool = False  # working tree only: service/ or migrations/ differ from HEAD

    @property
    def label(self) -> str:
        return f"{self.name} ({self.ref} = {self.commit[:7]}{', dirty' if self.dirty else ''})"

    def env(self) -> dict[str, str]:
        return {"PYTHONPATH": str(self.path)}

    def migrations(self) -> list[int]:
        return sorted(int(f.name.split("_", 1)[0]) for f in (self.path / "migrations").glob("*.sql"))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def _imported_from(tree: CodeTree) -> str:
    """Where ``import service`` resolves with that tree's cwd and PYTHONPATH."""
    out = subprocess.run([sys.executable, "-c", "import service; print(service.__file__)"],
                         cwd=tree.path, env={**os.environ, **tree.env()}, capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()


@contextlib.contextmanager
def code_tree(name: str, ref: str | None) -> Iterator[CodeTree]:
    """``ref`` exported with ``git archive`` into a temporary directory (removed on exit);
    no ref: this working tree as it is."""
    if not ref:
        dirty = bool(_git("status", "--porcelain", "--", "service", "migrations"))
        tree = CodeTree(name, "working tree", _git("rev-parse", "HEAD"), ROOT, dirty)
        tmp = None
    else:
        commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
        tmp = tempfile.mkdtemp(prefix=f"bench-{name}-{commit[:7]}-")
        archive = subprocess.Popen(["git", "archive", "--format=tar", commit], cwd=ROOT,
                                   stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tmp], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {ref} failed")
        tree = CodeTree(name, ref, commit, Path(tmp))
    try:
        where = _imported_from(tree)
        if not where.startswith(str(tree.path) + os.sep):
            raise RuntimeError(f"{tree.label}: `import service` resolves to {where}")
        yield tree
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def phase_compare(env: Env, n: int, endpoint: str, old: CodeTree, new: CodeTree,
                  rounds: int) -> dict[str, Any]:
    """ROUNDS pairs of drains, old and new, in ABBA order (old,new / new,old / ...)."""
    drains: list[dict[str, Any]] = []
    for rnd in range(1, rounds + 1):
        for tree in (old, new) if rnd % 2 else (new, old):
            label = f"compare-r{rnd}-{tree.name}"
            print(f"bench: compare round {rnd}/{rounds}: {tree.label} ...", flush=True)
            d = phase_daemon(env, n, endpoint, label, tree=tree)
            d["round"] = rnd
            print(f"bench:   {d['rate']:,.0f} msg/s, daemon CPU {d['cpu_us_per_msg']:.0f} us/msg, "
                  f"exit {d['exit_code']}", flush=True)
            drains.append(d)
    keys = ("rate", "cpu_us_per_msg", "localstack_cpu_us_per_msg", "postgres_cpu_us_per_msg",
            "peak_rss_mb")
    per_code = {t.name: {k: _spread([d[k] for d in drains if d["code"] == t.name]) for k in keys}
                for t in (old, new)}
    by_round = {(d["round"], d["code"]): d for d in drains}

    def ratio(r: int, k: str) -> float:
        return float(by_round[(r, "new")][k] / by_round[(r, "old")][k])

    paired = {k: _spread([ratio(r, k) for r in range(1, rounds + 1)])
              for k in ("rate", "cpu_us_per_msg")}
    # LocalStack runs the same code in both drains: its CPU/msg moves only with the
    # machine (part-filled receives when a drain is slowed down), so dividing by it takes
    # most of that noise out of the daemon's figure.
    paired["cpu_per_localstack_cpu"] = _spread([
        ratio(r, "cpu_us_per_msg") / ratio(r, "localstack_cpu_us_per_msg")
        for r in range(1, rounds + 1)])
    return {
        "label": "compare", "n": n, "rounds": rounds,
        "old": {"ref": old.ref, "commit": old.commit},
        "new": {"ref": new.ref, "commit": new.commit, "dirty": new.dirty},
        "per_code": per_code,
        "ratio_of_medians": {k: per_code["new"][k]["median"] / per_code["old"][k]["median"]
                             for k in ("rate", "cpu_us_per_msg")},
        "paired_ratio": paired,
        "exit_codes": [d["exit_code"] for d in drains],
        "drains": drains,
    }


def report_compare(c: dict[str, Any]) -> list[str]:
    o, nw = c["old"], c["new"]
    lines = [f"old vs new, N={c['n']}, {c['rounds']} rounds ABBA: old = {o['ref']} "
             f"{o['commit'][:7]}, new = {nw['ref']} {nw['commit'][:7]}"
             + (" (+ uncommitted changes in service/ or migrations/)" if nw["dirty"] else ""),
             f"{'round':<7}{'code':<6}{'msg/s':>9}{'CPU us/msg':>12}{'LS us':>8}{'PG us':>8}"
             f"{'RSS MB':>8}{'exit':>6}"]
    for d in c["drains"]:
        lines.append(f"{d['round']:<7}{d['code']:<6}{d['rate']:>9,.0f}{d['cpu_us_per_msg']:>12.0f}"
                     f"{d['localstack_cpu_us_per_msg']:>8.0f}{d['postgres_cpu_us_per_msg']:>8.0f}"
                     f"{d['peak_rss_mb']:>8.1f}{d['exit_code']:>6}")
    for key, what, spec in (("rate", "msg/s", ",.0f"), ("cpu_us_per_msg", "CPU us/msg", ".0f")):
        po, pn = c["per_code"]["old"][key], c["per_code"]["new"][key]
        pr = c["paired_ratio"][key]
        lines.append(
            f"{what:<11} median old {po['median']:{spec}} ({po['min']:{spec}}-{po['max']:{spec}}), "
            f"new {pn['median']:{spec}} ({pn['min']:{spec}}-{pn['max']:{spec}}); "
            f"new/old = {c['ratio_of_medians'][key]:.3f} "
            f"(per round {pr['min']:.3f}-{pr['max']:.3f}, median {pr['median']:.3f})")
    pl = c["paired_ratio"]["cpu_per_localstack_cpu"]
    lines.append(f"CPU us/msg per LocalStack CPU us/msg (LocalStack as the control): new/old "
                 f"median {pl['median']:.3f} (per round {pl['min']:.3f}-{pl['max']:.3f})")
    return lines


class NullQueue:
    """A results destination that costs (almost) nothing: an HTTP server in this process
    that answers every SendMessageBatch with all entries accepted and keeps only a count.
    With it the "on" drains measure what results cost the daemon and PostgreSQL when the
    destination is not on this machine (as SNS/SQS are in production); against LocalStack
    the destination's own CPU competes for the same two cores."""

    def __init__(self) -> None:
        self.entries = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: Any = None

    def __enter__(self) -> NullQueue:
        from aiohttp import web

        async def handle(request: web.Request) -> web.Response:
            doc = json.loads(await request.read())
            entries = doc.get("Entries", [])
            self.entries += len(entries)
            return web.json_response(
                {"Successful": [{"Id": e["Id"], "MessageId": uuid.uuid4().hex,
                                 "MD5OfMessageBody": ""} for e in entries], "Failed": []},
                content_type="application/x-amz-json-1.0")

        async def start() -> None:
            app = web.Application(client_max_size=4 * 2**20)
            app.router.add_route("POST", "/{tail:.*}", handle)
            self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

        self._thread.start()
        asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def phase_results(env: Env, n: int, endpoint: str, rounds: int,
                  sink: str = "localstack") -> dict[str, Any]:
    """Results out on vs off (issue 10): ROUNDS pairs of drains of the same code, without
    and with ``INGEST_RESULTS_QUEUE_URL``, in ABBA order so that the machine's drift hits
    both alike. ``sink``: ``localstack`` (a fresh LocalStack SQS queue per drain: one
    SendMessageBatch per ten results, LocalStack's CPU on this machine) or ``null``
    (NullQueue: the destination's cost taken off this machine)."""
    drains: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        null = stack.enter_context(NullQueue()) if sink == "null" else None
        for rnd in range(1, rounds + 1):
            for mode in ("off", "on") if rnd % 2 else ("on", "off"):
                label = f"results-{sink}-r{rnd}-{mode}"
                extra: dict[str, str] = {}
                out = None
                if mode == "on" and null is not None:
                    base = null.entries
                    extra = {"INGEST_RESULTS_QUEUE_URL": f"{env.ls.url}/000000000000/null",
                             "INGEST_RESULTS_ENDPOINT_URL": null.url}
                    out = functools.partial(lambda b: null.entries - b, base)
                elif mode == "on":
                    url = create_queue(env.ls.url, env.next("results"))
                    extra = {"INGEST_RESULTS_QUEUE_URL": url}
                    out = functools.partial(queue_depth, env.ls.url, url)
                print(f"bench: results ({sink}) round {rnd}/{rounds}: results {mode} ...",
                      flush=True)
                d = phase_daemon(env, n, endpoint, label, extra_env=extra, results_out=out)
                d.update({"round": rnd, "mode": mode})
                print(f"bench:   {d['rate']:,.0f} msg/s, daemon CPU {d['cpu_us_per_msg']:.0f} us/msg"
                      + (f", all {d['results_in_queue']} results out "
                         f"{d['results_done_seconds']:.1f} s after the first commit"
                         if mode == "on" else ""), flush=True)
                drains.append(d)
    keys = ("rate", "cpu_us_per_msg", "localstack_cpu_us_per_msg", "postgres_cpu_us_per_msg")
    per_mode = {m: {k: _spread([d[k] for d in drains if d["mode"] == m]) for k in keys}
                for m in ("off", "on")}
    by_round = {(d["round"], d["mode"]): d for d in drains}
    paired = {k: _spread([by_round[(r, "on")][k] / by_round[(r, "off")][k]
                          for r in range(1, rounds + 1)]) for k in keys}
    on = [d for d in drains if d["mode"] == "on"]
    return {"label": "results", "sink": sink, "n": n, "rounds": rounds, "per_mode": per_mode,
            "paired_ratio": paired,
            "results_done_seconds": _spread([d["results_done_seconds"] for d in on]),
            "result_delay_p50": _spread([d["result_delay_p50"] for d in on]),
            "result_delay_max": _spread([d["result_delay_max"] for d in on]),
            "results_in_queue": [d["results_in_queue"] for d in on],
            "exit_codes": [d["exit_code"] for d in drains], "drains": drains}


def report_results(c: dict[str, Any]) -> list[str]:
    where = ("a LocalStack SQS queue on this machine" if c["sink"] == "localstack"
             else "a null destination (NullQueue: accepts all, costs ~nothing)")
    lines = [f"results on vs off, N={c['n']}, {c['rounds']} rounds ABBA, results to {where}",
             f"{'round':<7}{'mode':<6}{'msg/s':>9}{'CPU us/msg':>12}{'LS us':>8}{'PG us':>8}"
             f"{'out s':>8}{'exit':>6}"]
    for d in c["drains"]:
        out = f"{d['results_done_seconds']:.1f}" if d["mode"] == "on" else "-"
        lines.append(f"{d['round']:<7}{d['mode']:<6}{d['rate']:>9,.0f}{d['cpu_us_per_msg']:>12.0f}"
                     f"{d['localstack_cpu_us_per_msg']:>8.0f}{d['postgres_cpu_us_per_msg']:>8.0f}"
                     f"{out:>8}{d['exit_code']:>6}")
    for key, what, spec in (("rate", "msg/s", ",.0f"), ("cpu_us_per_msg", "CPU us/msg", ".0f"),
                            ("localstack_cpu_us_per_msg", "LocalStack us/msg", ".0f")):
        po, pn = c["per_mode"]["off"][key], c["per_mode"]["on"][key]
        pr = c["paired_ratio"][key]
        lines.append(
            f"{what:<18} median off {po['median']:{spec}} ({po['min']:{spec}}-{po['max']:{spec}}), "
            f"on {pn['median']:{spec}} ({pn['min']:{spec}}-{pn['max']:{spec}}); on/off per round "
            f"{pr['min']:.3f}-{pr['max']:.3f}, median {pr['median']:.3f}")
    rd, dm = c["results_done_seconds"], c["result_delay_max"]
    lines.append(f"results out: all {c['results_in_queue']} published "
                 f"{rd['median']:.1f} s (median) after the first commit; commit-to-publish "
                 f"p50 {c['result_delay_p50']['median']:.2f} s, max {dm['max']:.2f} s")
    lines.append(f"target: ingestion with results >= 0.8x without (median paired ratio "
                 f"{c['paired_ratio']['rate']['median']:.3f})")
    return lines


# -- the bench --------------------------------------------------------------------------


@dataclass
class Env:
    pg_dsn: Any  # callable db -> dsn
    pg_datadir: str
    ls: LocalStack
    results: dict[str, Any] = field(default_factory=dict)
    seq: int = 0

    def next(self, what: str) -> str:
        self.seq += 1
        return f"{what}{self.seq}"


def new_database(env: Env, name: str, tree: CodeTree | None = None) -> str:
    """A fresh database, migrated by this code or, given a tree, by that tree's own
    ``python -m service migrate`` (the schema the code in that tree expects)."""
    import asyncpg

    from service.adapters.migrate import migrate

    dsn = str(env.pg_dsn(name))

    async def go() -> None:
        conn = await asyncpg.connect(env.pg_dsn("postgres"))
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()
        if tree is None:
            await migrate(dsn)

    asyncio.run(go())
    if tree is not None:
        out = subprocess.run([sys.executable, "-m", "service", "migrate"], cwd=tree.path,
                             env={**os.environ, **tree.env(), "INGEST_DATABASE_URL": dsn},
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"migrate from {tree.label} failed ({out.returncode}): "
                               f"{out.stderr[-2000:]}")
    return dsn


def schema_versions(dsn: str) -> list[int]:
    import asyncpg

    async def go() -> list[int]:
        conn = await asyncpg.connect(dsn)
        try:
            return [int(r[0]) for r in await conn.fetch(
                "SELECT version FROM ingest_schema_migrations ORDER BY version")]
        finally:
            await conn.close()

    return asyncio.run(go())


#: Rows of one drain: received since it started (an index range scan on received_at, so
#: a database pre-filled with millions of rows — bench/cost_curve.py — is not counted).
_SINCE = "status = 'COMPLETED' AND received_at >= to_timestamp($1)"


def db_window(dsn: str, since: float = 0.0) -> tuple[int, float, float]:
    import asyncpg

    async def go() -> tuple[int, float, float]:
        conn = await asyncpg.connect(dsn)
        try:
            r = await conn.fetchrow(
                "SELECT count(*) AS n, extract(epoch FROM min(completed_at)) AS first,"
                " extract(epoch FROM max(completed_at)) AS last"
                f" FROM modifications WHERE {_SINCE}", since)
            return int(r["n"]), float(r["first"] or 0), float(r["last"] or 0)
        finally:
            await conn.close()

    return asyncio.run(go())


def outbox_window(dsn: str, first_completed: float) -> dict[str, Any]:
    """How long the results took to leave: the last ``published_at`` after the first
    completion, and the longest commit-to-publish delay of one result."""
    import asyncpg

    async def go() -> dict[str, Any]:
        conn = await asyncpg.connect(dsn)
        try:
            r = await conn.fetchrow(
                "SELECT count(*) FILTER (WHERE published_at IS NOT NULL) AS published,"
                " count(*) FILTER (WHERE published_at IS NULL) AS pending,"
                " extract(epoch FROM max(published_at)) AS last,"
                " extract(epoch FROM max(published_at - completed_at)) AS max_delay,"
                " extract(epoch FROM percentile_cont(0.5) WITHIN GROUP"
                "   (ORDER BY published_at - completed_at)) AS p50_delay"
                " FROM outbox")
            return {"outbox_published": int(r["published"]), "outbox_pending": int(r["pending"]),
                    "results_done_seconds": float(r["last"] or 0) - first_completed,
                    "result_delay_max": float(r["max_delay"] or 0),
                    "result_delay_p50": float(r["p50_delay"] or 0)}
        finally:
            await conn.close()

    return asyncio.run(go())


class CountPoller:
    """One connection kept open to count COMPLETED rows cheaply while the daemon drains."""

    def __init__(self, dsn: str, since: float = 0.0) -> None:
        import asyncpg

        self.since = since
        self.loop = asyncio.new_event_loop()
        self.conn = self.loop.run_until_complete(asyncpg.connect(dsn))

    def completed(self) -> int:
        return int(self.loop.run_until_complete(self.conn.fetchval(
            f"SELECT count(*) FROM modifications WHERE {_SINCE}", self.since)))

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()


def phase_ceiling(env: Env, n: int, endpoint: str, label: str) -> dict[str, Any]:
    pollers, inflight = daemon_concurrency()
    url = create_queue(env.ls.url, env.next("ceiling"))
    send_rate = preload(env.ls.url, url, label, n)
    with Sampler({"localstack": env.ls.pid}, None) as s:
        r = run_phase_process(["_ceiling", endpoint, url, str(n), str(pollers), str(inflight)],
                              timeout=max(300, n / 20))
    span = r["last"] - r["first"]
    ls_cpu = s.at(r["last"], "localstack_cpu") - s.at(r["first"], "localstack_cpu")
    return {"label": label, "n": r["n"], "seconds": span, "rate": r["n"] / span,
            "pollers": pollers, "inflight_batches": inflight,
            "client_cpu_us_per_msg": r["client_cpu"] / r["n"] * 1e6,
            "localstack_cpu_us_per_msg": ls_cpu / r["n"] * 1e6,
            "preload_rate": send_rate}


def phase_naive(env: Env, n: int) -> dict[str, Any]:
    dsn = new_database(env, env.next("naive"))
    url = create_queue(env.ls.url, env.next("naive"))
    preload(env.ls.url, url, "naive", n)
    r = run_phase_process(["_naive", env.ls.url, url, dsn, str(n)], timeout=max(600, n / 10))
    span = r["last"] - r["first"]
    return {"label": "naive", "n": r["n"], "seconds": span, "rate": r["n"] / span}


def phase_daemon(env: Env, n: int, endpoint: str, label: str, profile: bool = False,
                 soak: float = 0.0, soak_rate: int = 0,
                 tree: CodeTree | None = None,
                 extra_env: dict[str, str] | None = None,
                 dsn: str | None = None,
                 during: Any = None,
                 results_out: Any = None) -> dict[str, Any]:
    """One drain by ``python -m service run`` from this checkout, or from ``tree``;
    ``extra_env`` adds INGEST_* settings for this drain only (the results phase). ``dsn``:
    drain into that (already migrated, maybe pre-filled) database instead of a fresh one;
    ``during(res)`` is called once the daemon is ready (bench/cost_curve.py starts a prune
    there). ``results_out()``: results at the destination so far (the drain waits for N)."""
    since = time.time() - 1
    dsn = dsn or new_database(env, env.next("daemon"), tree)
    url = create_queue(env.ls.url, env.next("daemon"))
    if not soak:
        preload(env.ls.url, url, label, n)
    port = free_port()
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / f"daemon-{label}.log"
    denv = {**os.environ, "INGEST_QUEUE_URL": url, "INGEST_DATABASE_URL": dsn,
            "INGEST_SQS_ENDPOINT_URL": endpoint, "INGEST_HTTP_PORT": str(port),
            "INGEST_HTTP_HOST": "127.0.0.1", **(tree.env() if tree else {}),
            **(extra_env or {})}
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "service", "run"],
                            cwd=tree.path if tree else ROOT, env=denv,
                            stdout=log, stderr=subprocess.STDOUT)
    spy: subprocess.Popen[bytes] | None = None
    profile_path = RESULTS / f"profile-{label}.txt"
    res: dict[str, Any] = {"label": label, "n": n, "log": str(log_path.relative_to(ROOT))}
    if tree:
        res.update({"code": tree.name, "commit": tree.commit,
                    "schema_versions": schema_versions(dsn),
                    "tree_migrations": tree.migrations()})
    try:
        def ready(path: str = "/healthz") -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited {proc.returncode}; see {log_path}")
            try:  # a 503 (HTTPError) is an OSError too
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1).close()
                return True
            except OSError:
                return False

        pm = postmaster_pid(env.pg_datadir)
        with Sampler({"daemon": proc.pid, "localstack": env.ls.pid}, pm) as s:
            wait_until(ready, 60, "daemon /healthz")
            if tree:
                # /readyz checks the schema: the tree's code accepts its database.
                wait_until(lambda: ready("/readyz"), 30, "daemon /readyz")
                res["readyz"] = 200
            if profile:
                spy = subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "--pid",
                     str(proc.pid), "--rate", "200", "--gil",
                     # native: C frames too (asyncpg's protocol, the kernel's writes); it must
                     # stop the process to read them, so it cannot be nonblocking.
                     "--native" if os.environ.get("PROFILE") == "native" else "--nonblocking",
                     "--format", "raw",
                     "-o", str(profile_path)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            gc_before = _gc_collections(scrape(port))
            counter = CountPoller(dsn, since)
            if during is not None:
                during(res)
            try:
                if soak:
                    res.update(_soak(env, url, port, proc.pid, s, counter, soak, soak_rate))
                else:
                    deadline = time.monotonic() + max(120, n / 20)
                    while counter.completed() < n:
                        if proc.poll() is not None:
                            raise RuntimeError(f"daemon exited {proc.returncode}; see {log_path}")
                        if time.monotonic() > deadline:
                            raise TimeoutError("daemon did not drain the queue in time")
                        time.sleep(0.2)
            finally:
                counter.close()
            wait_until(lambda: queue_depth(env.ls.url, url) == 0, 60, "acks of the last batches")
            if results_out is not None and not soak:
                # Every result out before the daemon stops (SIGTERM would drain the rest).
                wait_until(lambda: results_out() >= n, max(60, n / 50),
                           "every result at the destination")
                res["results_in_queue"] = results_out()
            metrics = scrape(port)
            res["peak_rss_mb"] = proc_status(proc.pid, "VmHWM") / 2**20
            res["rss_end_mb"] = proc_status(proc.pid, "VmRSS") / 2**20
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(60)
        done, first, last = db_window(dsn, since)
        if not soak:
            span = last - first
            lag = histogram(metrics, "sqs_ingest_message_lag_seconds")
            res.update({
                "completed": done, "seconds": span, "rate": done / span,
                "cpu_us_per_msg": (s.at(last, "daemon_cpu") - s.at(first, "daemon_cpu"))
                / done * 1e6,
                "localstack_cpu_us_per_msg": (s.at(last, "localstack_cpu")
                                              - s.at(first, "localstack_cpu")) / done * 1e6,
                "postgres_cpu_us_per_msg": (s.at(last, "postgres_cpu")
                                            - s.at(first, "postgres_cpu")) / done * 1e6,
                "lag_p50": quantile(lag, 0.5), "lag_p99": quantile(lag, 0.99),
                # from /healthz to the end of the drain: the cyclic collector's runs
                "gc_collections_per_1000": [
                    (a - b) / done * 1000
                    for a, b in zip(_gc_collections(metrics), gc_before, strict=True)],
            })
        if results_out is not None and not soak:
            res.update(outbox_window(dsn, first))
        res["processed_total"] = sum(v for (k, _), v in metrics.items()
                                     if k == "sqs_ingest_messages_processed_total")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                res["exit_code"] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                res["exit_code"] = proc.wait()
        else:
            res["exit_code"] = proc.returncode
        log.close()
        if spy is not None and spy.poll() is None:
            spy.kill()
    if profile and profile_path.exists():
        res["profile"] = str(profile_path.relative_to(ROOT))
        res["profile_summary"] = summarize_profile(profile_path)
    return res


def _soak(env: Env, url: str, port: int, pid: int, s: Sampler, counter: CountPoller,
          seconds: float, rate: int) -> dict[str, Any]:
    """Steady load: ``rate`` msg/s for ``seconds``; RSS after warm-up and at the end."""
    from service.adapters.sqs import sqs_client

    warmup = min(30.0, seconds / 10)
    marks: dict[str, Any] = {}

    async def produce() -> int:
        sent = 0
        async with sqs_client(REGION, env.ls.url, max_pool_connections=16) as client:
            t0 = time.monotonic()
            tick = 0.1
            per_tick = max(1, round(rate * tick))
            i = 0
            while time.monotonic() - t0 < seconds:
                el = time.monotonic() - t0
                if "start" not in marks and el >= warmup:
                    # CountPoller drives its own loop: call it from a thread.
                    marks["start"] = await asyncio.to_thread(lambda: (
                        time.time(), proc_status(pid, "VmRSS"), counter.completed(),
                        scrape(port)))
                bodies = [make_body("soak", i + k) for k in range(per_tick)]
                i += per_tick
                await asyncio.gather(*(
                    client.send_message_batch(QueueUrl=url, Entries=[
                        {"Id": str(j), "MessageBody": b} for j, b in enumerate(bodies[c:c + 10])])
                    for c in range(0, len(bodies), 10)))
                sent += len(bodies)
                next_at = t0 + (sent / per_tick) * tick
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        return sent

    sent = asyncio.run(produce())
    wait_until(lambda: counter.completed() >= sent, 120, "soak backlog drained", interval=0.2)
    end_t, end_rss = time.time(), proc_status(pid, "VmRSS")
    t0, rss0, done0, m0 = marks["start"]
    m1 = scrape(port)
    done1 = counter.completed()
    lag = hist_delta(histogram(m1, "sqs_ingest_message_lag_seconds"),
                     histogram(m0, "sqs_ingest_message_lag_seconds"))
    rss_series = [x["daemon_rss"] for x in s.samples if "daemon_rss" in x and x["t"] >= t0]
    return {
        "soak_seconds": seconds, "soak_rate_target": rate, "sent": sent,
        "soak_rate_achieved": (done1 - done0) / (end_t - t0),
        "rss_start_mb": rss0 / 2**20, "rss_end_mb_soak": end_rss / 2**20,
        "rss_min_mb": min(rss_series) / 2**20, "rss_max_mb": max(rss_series) / 2**20,
        "rss_change_pct": (end_rss - rss0) / rss0 * 100,
        "cpu_us_per_msg": (s.at(end_t, "daemon_cpu") - s.at(t0, "daemon_cpu"))
        / max(1, done1 - done0) * 1e6,
        "lag_p50": quantile(lag, 0.5), "lag_p99": quantile(lag, 0.99),
    }


# -- the peer: bbc/sqs-consumer (PEER=sqs-consumer, issue 26) -----------------------------

PEER_DIR = BENCH / "peer"
#: The peers this bench can run: name -> the npm package pinned in bench/peer/package.json.
PEERS = {"sqs-consumer": "sqs-consumer"}


def peer_install(peer: str) -> dict[str, Any]:
    """``npm ci`` into bench/peer/node_modules (gitignored) from the committed, hashed
    package-lock.json, unless the installed tree already came from this very lock file.
    Returns what will run: node's version and the installed packages' versions."""
    import hashlib

    if peer not in PEERS:
        raise SystemExit(f"bench: PEER={peer!r} is not one of {', '.join(PEERS)}")
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        raise SystemExit("bench: the peer phase needs node (>= 20) and npm on PATH")
    lock = PEER_DIR / "package-lock.json"
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    stamp = PEER_DIR / "node_modules" / ".bench-lock-sha256"
    if not stamp.exists() or stamp.read_text().strip() != digest:
        print("bench: peer: npm ci (bench/peer/package-lock.json) ...", flush=True)
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=PEER_DIR, check=True,
                       timeout=600)
        stamp.write_text(digest + "\n")

    def version(pkg: str) -> str:
        doc = json.loads((PEER_DIR / "node_modules" / pkg / "package.json").read_text())
        return str(doc["version"])

    wanted = json.loads((PEER_DIR / "package.json").read_text())["dependencies"]
    got = {pkg: version(pkg) for pkg in wanted}
    if got != wanted:
        raise RuntimeError(f"bench: peer: installed {got}, package.json pins {wanted}")
    node_v = subprocess.run([node, "--version"], capture_output=True, text=True,
                            check=True).stdout.strip()
    return {"peer": peer, "node": node_v, "packages": got, "lock_sha256": digest}


def table_count(dsn: str, table: str) -> int:
    import asyncpg

    async def go() -> int:
        conn = await asyncpg.connect(dsn)
        try:
            return int(await conn.fetchval(f"SELECT count(*) FROM {table}"))
        finally:
            await conn.close()

    return asyncio.run(go())


def phase_peer(env: Env, n: int, endpoint: str, label: str) -> dict[str, Any]:
    """One drain by bench/peer/peer.mjs (sqs-consumer, 8 consumers, batch handler), measured
    exactly as phase_daemon measures the daemon: fresh queue and database (migrated by this
    code), N preloaded, rate = rows / (max - min completed_at), CPU of the node process from
    /proc over the same window, LocalStack's and PostgreSQL's too, then SIGTERM."""
    since = time.time() - 1
    dsn = new_database(env, env.next("peer"))
    url = create_queue(env.ls.url, env.next("peer"))
    preload(env.ls.url, url, label, n)
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = RESULTS / f"peer-{label}.log"
    penv = {**os.environ, "PEER_QUEUE_URL": url, "PEER_ENDPOINT": endpoint,
            "PEER_DATABASE_URL": dsn, "AWS_DEFAULT_REGION": REGION}
    log = open(log_path, "wb")
    proc = subprocess.Popen([str(shutil.which("node")), "peer.mjs"], cwd=PEER_DIR, env=penv,
                            stdout=subprocess.PIPE, stderr=log)
    res: dict[str, Any] = {"label": label, "n": n, "code": "peer",
                           "log": str(log_path.relative_to(ROOT))}
    try:
        pm = postmaster_pid(env.pg_datadir)
        with Sampler({"peer": proc.pid, "localstack": env.ls.pid}, pm) as s:
            counter = CountPoller(dsn, since)
            try:
                deadline = time.monotonic() + max(120, n / 20)
                while counter.completed() < n:
                    if proc.poll() is not None:
                        raise RuntimeError(f"peer exited {proc.returncode}; see {log_path}")
                    if time.monotonic() > deadline:
                        raise TimeoutError("peer did not drain the queue in time")
                    time.sleep(0.2)
            finally:
                counter.close()
            wait_until(lambda: queue_depth(env.ls.url, url) == 0, 60, "acks of the last batches")
            res["peak_rss_mb"] = proc_status(proc.pid, "VmHWM") / 2**20
        done, first, last = db_window(dsn, since)
        res.update({
            "completed": done, "entities": table_count(dsn, "entities"),
            "seconds": last - first, "rate": done / (last - first),
            "cpu_us_per_msg": (s.at(last, "peer_cpu") - s.at(first, "peer_cpu")) / done * 1e6,
            "localstack_cpu_us_per_msg": (s.at(last, "localstack_cpu")
                                          - s.at(first, "localstack_cpu")) / done * 1e6,
            "postgres_cpu_us_per_msg": (s.at(last, "postgres_cpu")
                                        - s.at(first, "postgres_cpu")) / done * 1e6,
        })
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        res["exit_code"] = proc.returncode
        log.close()
    lines = out.decode().strip().splitlines()
    res["peer_stats"] = json.loads(lines[-1]) if lines else None
    return res


def phase_peer_compare(env: Env, n: int, endpoint: str, rounds: int,
                       peer: dict[str, Any]) -> dict[str, Any]:
    """ROUNDS pairs of drains, the peer and the daemon (this working tree, its defaults), in
    ABBA order (peer,daemon / daemon,peer / ...): same LocalStack, PostgreSQL and backlog."""
    drains: list[dict[str, Any]] = []
    for rnd in range(1, rounds + 1):
        for who in ("peer", "daemon") if rnd % 2 else ("daemon", "peer"):
            label = f"peer-r{rnd}-{who}"
            print(f"bench: peer round {rnd}/{rounds}: {who} ...", flush=True)
            if who == "peer":
                d = phase_peer(env, n, endpoint, label)
            else:
                dsn = new_database(env, env.next("daemon"))
                d = phase_daemon(env, n, endpoint, label, dsn=dsn)
                d.update({"code": "daemon", "entities": table_count(dsn, "entities")})
            d["round"] = rnd
            print(f"bench:   {d['rate']:,.0f} msg/s, {who} CPU {d['cpu_us_per_msg']:.0f} us/msg, "
                  f"LocalStack {d['localstack_cpu_us_per_msg']:.0f} us/msg, "
                  f"exit {d['exit_code']}", flush=True)
            drains.append(d)
    keys = ("rate", "cpu_us_per_msg", "localstack_cpu_us_per_msg", "postgres_cpu_us_per_msg",
            "peak_rss_mb")
    per_code = {w: {k: _spread([d[k] for d in drains if d["code"] == w]) for k in keys}
                for w in ("peer", "daemon")}
    by_round = {(d["round"], d["code"]): d for d in drains}

    def ratio(r: int, k: str) -> float:
        return float(by_round[(r, "daemon")][k] / by_round[(r, "peer")][k])

    paired = {k: _spread([ratio(r, k) for r in range(1, rounds + 1)])
              for k in ("rate", "cpu_us_per_msg", "localstack_cpu_us_per_msg",
                        "postgres_cpu_us_per_msg")}
    paired["cpu_per_localstack_cpu"] = _spread([
        ratio(r, "cpu_us_per_msg") / ratio(r, "localstack_cpu_us_per_msg")
        for r in range(1, rounds + 1)])
    dirty = bool(_git("status", "--porcelain", "--", "service", "migrations"))
    return {"label": "peer", "n": n, "rounds": rounds, "peer": peer, "per_code": per_code,
            "daemon": {"commit": _git("rev-parse", "HEAD"), "dirty": dirty},
            "paired_ratio": paired,
            "per_round": [{k: ratio(r, k) for k in ("rate", "cpu_us_per_msg")}
                          for r in range(1, rounds + 1)],
            "all_completed": all(d["completed"] == n and d["entities"] == n for d in drains),
            "exit_codes": [d["exit_code"] for d in drains],
            "peer_errors": [d["peer_stats"]["errors"] if d.get("peer_stats") else None
                            for d in drains if d["code"] == "peer"],
            "drains": drains}


def report_peer(c: dict[str, Any]) -> list[str]:
    p = c["peer"]
    pk = ", ".join(f"{k} {v}" for k, v in p["packages"].items())
    dm = c["daemon"]
    lines = [f"daemon ({dm['commit'][:7]}{', service/ or migrations/ dirty' if dm['dirty'] else ''})"
             f" vs {p['peer']} (node {p['node']}; {pk}), N={c['n']}, {c['rounds']} "
             f"rounds ABBA (peer first)",
             f"{'round':<7}{'who':<8}{'msg/s':>9}{'CPU us/msg':>12}{'LS us':>8}{'PG us':>8}"
             f"{'RSS MB':>8}{'rows':>8}{'exit':>6}"]
    for d in c["drains"]:
        lines.append(f"{d['round']:<7}{d['code']:<8}{d['rate']:>9,.0f}"
                     f"{d['cpu_us_per_msg']:>12.0f}{d['localstack_cpu_us_per_msg']:>8.0f}"
                     f"{d['postgres_cpu_us_per_msg']:>8.0f}{d['peak_rss_mb']:>8.1f}"
                     f"{d['completed']:>8}{d['exit_code']:>6}")
    for key, what in (("rate", "msg/s"), ("cpu_us_per_msg", "CPU us/msg"),
                      ("localstack_cpu_us_per_msg", "LocalStack us/msg"),
                      ("postgres_cpu_us_per_msg", "PostgreSQL us/msg")):
        pp, pd = c["per_code"]["peer"][key], c["per_code"]["daemon"][key]
        pr = c["paired_ratio"][key]
        lines.append(f"{what:<18} median peer {pp['median']:,.0f} ({pp['min']:,.0f}-"
                     f"{pp['max']:,.0f}), daemon {pd['median']:,.0f} ({pd['min']:,.0f}-"
                     f"{pd['max']:,.0f}); daemon/peer per round {pr['min']:.3f}-{pr['max']:.3f},"
                     f" median {pr['median']:.3f}")
    pl = c["paired_ratio"]["cpu_per_localstack_cpu"]
    lines.append(f"CPU us/msg per LocalStack CPU us/msg (LocalStack as the control): "
                 f"daemon/peer median {pl['median']:.3f} (per round {pl['min']:.3f}-"
                 f"{pl['max']:.3f})")
    lines.append(f"target (issue 26): daemon/peer msg/s >= 1.15 (median "
                 f"{c['paired_ratio']['rate']['median']:.3f}), CPU/msg <= 0.8 (median "
                 f"{c['paired_ratio']['cpu_us_per_msg']['median']:.3f}); every drain all N "
                 f"rows and entities: {c['all_completed']}; peer errors {c['peer_errors']}")
    return lines


# -- profile summary --------------------------------------------------------------------

AREAS = [  # first match on a frame's file path wins
    ("service (our code)", "(service/"),
    ("asyncpg", "asyncpg"),
    ("botocore/aiobotocore (SQS client)", "botocore"),
    ("aiohttp (HTTP client/server)", "aiohttp"),
    ("pydantic", "pydantic"),
    ("structlog", "structlog"),
    ("prometheus_client", "prometheus_client"),
    ("json (stdlib)", "/json/"),
    ("asyncio/uvloop", "asyncio"),
    ("asyncio/uvloop", "uvloop"),
]


def _frame_area(frame: str) -> str:
    for area, needle in AREAS:
        if needle in frame:
            return area
    return "other (stdlib, urllib3, ...)"


def summarize_profile(path: Path, top: int = 25) -> dict[str, Any]:
    """Self time per function and per library, inclusive time per function.

    Recorded with ``--gil``: only samples holding the GIL count, so idle waits in the event
    loop (epoll) and in idle executor threads are left out and the shares are of CPU time.
    Time spent inside C code (asyncpg's protocol, uvloop) is charged to the Python frame
    that called it.
    """
    self_fn: dict[str, int] = defaultdict(int)
    self_area: dict[str, int] = defaultdict(int)
    incl_service: dict[str, int] = defaultdict(int)
    incl_fn: dict[str, int] = defaultdict(int)
    incl_area: dict[str, int] = defaultdict(int)
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        leaf = frames[-1]
        self_fn[leaf] += c
        self_area[_frame_area(leaf)] += c
        seen: set[str] = set()
        for fr in frames:
            key = re.sub(r":\d+\)$", ")", fr)
            if key not in seen:
                seen.add(key)
                incl_fn[key] += c
                if "(service/" in fr:
                    incl_service[key] += c
        for a in {_frame_area(f) for f in frames}:
            incl_area[a] += c

    def pct(d: dict[str, int], limit: int = top) -> list[tuple[str, float]]:
        return [(k, round(v / total * 100, 1))
                for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:limit]]

    return {"samples": total, "self_by_area_pct": pct(self_area),
            "inclusive_by_area_pct": pct(incl_area), "self_by_function_pct": pct(self_fn),
            "inclusive_service_functions_pct": pct(incl_service),
            "inclusive_functions_pct": pct(incl_fn, 60)}


# -- main -------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = proc_meminfo_total()
    pg = "?"
    with contextlib.suppress(Exception):
        from tests.servers import _pg_bin

        pg = subprocess.run([_pg_bin("postgres"), "--version"], capture_output=True,
                            text=True).stdout.strip()
    return {"cores": os.cpu_count(), "cpu": cpu, "memory_gib": mem,
            "kernel": platform.release(), "python": platform.python_version(), "postgres": pg}


def proc_meminfo_total() -> float:
    with open("/proc/meminfo") as f:
        return round(int(f.readline().split()[1]) / 2**20, 1)


def fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def report(r: dict[str, Any]) -> str:
    lines = []
    m = r["machine"]
    lines.append(f"machine: {m['cores']} cores {m['cpu']}, {m['memory_gib']} GiB, "
                 f"Python {m['python']}, {m['postgres']}, LocalStack {r['localstack']}")
    lines.append(f"N={r['n']}  pollers={r['pollers']}  inflight_batches={r['inflight_batches']}")
    lines.append(f"{'phase':<22}{'msgs':>8}{'seconds':>9}{'msg/s':>9}")
    for key in ("ceiling", "naive", "daemon", "ceiling_latency", "daemon_latency",
                "daemon_profiled"):
        p = r.get(key)
        if p and "rate" in p:
            lines.append(f"{p['label']:<22}{p['n']:>8}{p['seconds']:>9.2f}{p['rate']:>9,.0f}")
    d, c, nv = r.get("daemon"), r.get("ceiling"), r.get("naive")
    if d:
        if c:
            lines.append(f"daemon/ceiling = {d['rate'] / c['rate']:.2f}   (target >= 0.95)")
        if nv:
            lines.append(f"daemon/naive   = {d['rate'] / nv['rate']:.1f}x")
        lines.append(f"daemon CPU/msg = {d['cpu_us_per_msg']:.0f} us   (target <= 250); "
                     f"LocalStack {d['localstack_cpu_us_per_msg']:.0f} us, "
                     f"PostgreSQL {d['postgres_cpu_us_per_msg']:.0f} us")
        if d.get("gc_collections_per_1000"):
            lines.append("daemon GC collections per 1,000 messages = "
                         + " / ".join(f"{x:.1f}" for x in d["gc_collections_per_1000"])
                         + "  (generations 0 / 1 / 2)")
        lines.append(f"daemon peak RSS (VmHWM) = {d['peak_rss_mb']:.1f} MB   (target <= 120)")
        lines.append(f"message_lag_seconds p50 = {fmt(d['lag_p50'], '.2f')} s, "
                     f"p99 = {fmt(d['lag_p99'], '.2f')} s  (preloaded backlog: time in queue)")
        lines.append(f"daemon exit code after SIGTERM = {d['exit_code']}")
    if c:
        lines.append(f"ceiling client CPU/msg = {c['client_cpu_us_per_msg']:.0f} us, "
                     f"LocalStack CPU/msg = {c['localstack_cpu_us_per_msg']:.0f} us")
    dl = r.get("daemon_latency")
    if dl and d:
        cl = r.get("ceiling_latency")
        lines.append(f"with LATENCY_MS={r['latency_ms']:g}: daemon {dl['rate']:,.0f} msg/s = "
                     f"{dl['rate'] / d['rate']:.2f} x zero-latency daemon (target >= 0.8)"
                     + (f"; daemon/ceiling at that latency = {dl['rate'] / cl['rate']:.2f}"
                        if cl else ""))
    sk = r.get("soak")
    if sk:
        lines.append(f"soak {sk['soak_seconds']:g}s at {sk['soak_rate_target']} msg/s "
                     f"(achieved {sk['soak_rate_achieved']:.0f}): RSS start "
                     f"{sk['rss_start_mb']:.1f} MB, end {sk['rss_end_mb_soak']:.1f} MB "
                     f"({sk['rss_change_pct']:+.1f} %, target ±10 %), min/max "
                     f"{sk['rss_min_mb']:.1f}/{sk['rss_max_mb']:.1f} MB; "
                     f"CPU/msg {sk['cpu_us_per_msg']:.0f} us; lag p50 "
                     f"{fmt(sk['lag_p50'], '.3f')} s, p99 {fmt(sk['lag_p99'], '.3f')} s")
    if r.get("costs"):
        import costs

        lines.extend(costs.report(r["costs"]))
    if r.get("compare"):
        lines.extend(report_compare(r["compare"]))
    for key in ("results", "results_null"):
        if r.get(key):
            lines.extend(report_results(r[key]))
    if r.get("peer"):
        lines.extend(report_peer(r["peer"]))
    for key in ("daemon_profiled", "daemon_profiled_baseline"):
        dp = r.get(key)
        if dp and "profile_summary" in dp:
            ps = dp["profile_summary"]
            lines.append(f"profile ({ps['samples']} samples, {dp['profile']}): self time by area:")
            for k, v in ps["self_by_area_pct"]:
                lines.append(f"  {v:5.1f} %  {k}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=_env_int("N", 20_000))
    ap.add_argument("--naive-n", type=int, default=None)
    ap.add_argument("--latency-ms", type=float, default=_env_float("LATENCY_MS", 0))
    ap.add_argument("--soak", type=float, default=_env_float("SOAK", 0))
    ap.add_argument("--soak-rate", type=int, default=_env_int("SOAK_RATE", 500))
    ap.add_argument("--profile", action="store_true",
                    default=os.environ.get("PROFILE", "") not in ("", "0"))
    ap.add_argument("--phases", default=os.environ.get("PHASES", "ceiling,naive,daemon,costs"))
    ap.add_argument("--baseline", default=os.environ.get("BASELINE") or None,
                    help="git ref of the old code: adds the interleaved old-vs-new comparison")
    ap.add_argument("--candidate", default=os.environ.get("CANDIDATE") or None,
                    help="git ref of the new code (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=_env_int("ROUNDS", 3))
    ap.add_argument("--peer", default=os.environ.get("PEER") or None,
                    help="adds the peer phase: daemon vs that consumer (sqs-consumer)")
    a = ap.parse_args()
    naive_n = a.naive_n or _env_int("NAIVE_N", min(a.n, 5_000))
    phases = {p.strip() for p in a.phases.split(",") if p.strip()}
    pollers, inflight = daemon_concurrency()
    r: dict[str, Any] = {"machine": machine(), "n": a.n, "naive_n": naive_n,
                         "pollers": pollers, "inflight_batches": inflight,
                         "latency_ms": a.latency_ms, "started": time.strftime("%FT%TZ", time.gmtime()),
                         "ingest_env": {k: v for k, v in os.environ.items()
                                        if k.startswith("INGEST_")}}
    t0 = time.monotonic()
    if a.baseline:
        phases.add("compare")
    if os.environ.get("RESULTS", "") not in ("", "0"):
        phases.add("results")
    if a.peer:
        phases.add("peer")
    peer = peer_install(a.peer or "sqs-consumer") if "peer" in phases else None
    if "compare" in phases and not a.baseline:
        raise SystemExit("bench: PHASES=compare needs BASELINE=<git ref>")
    with contextlib.ExitStack() as stack:
        old = new = None
        if "compare" in phases:
            old = stack.enter_context(code_tree("old", a.baseline))
            new = stack.enter_context(code_tree("new", a.candidate))
            print(f"bench: old = {old.label} at {old.path}; new = {new.label} at {new.path}",
                  flush=True)
        pg = stack.enter_context(postgres_server())
        ls = stack.enter_context(localstack_server())
        r["localstack"] = ls.version
        env = Env(pg.dsn, pg.datadir, ls)

        def step(key: str, fn: Any, *args: Any, **kw: Any) -> None:
            print(f"bench: {key} ...", flush=True)
            r[key] = fn(*args, **kw)
            p = r[key]
            if "rate" in p:
                print(f"bench: {key}: {p['n']} msgs in {p['seconds']:.2f} s = "
                      f"{p['rate']:,.0f} msg/s", flush=True)

        if "ceiling" in phases:
            step("ceiling", phase_ceiling, env, a.n, ls.url, "ceiling")
        if "naive" in phases:
            step("naive", phase_naive, env, naive_n)
        if "daemon" in phases:
            step("daemon", phase_daemon, env, a.n, ls.url, "daemon")
        if "costs" in phases:
            import costs

            print("bench: costs (backlog, then a trickle) ...", flush=True)
            r["costs"] = costs.phase(sys.modules[__name__], env, a.peer)
            print("\n".join(costs.report(r["costs"])), flush=True)
        if old and new:
            step("compare", phase_compare, env, a.n, ls.url, old, new, a.rounds)
        if peer:
            step("peer", phase_peer_compare, env, a.n, ls.url, a.rounds, peer)
        if "results" in phases:
            sinks = os.environ.get("RESULTS_SINKS", "localstack,null").split(",")
            if "localstack" in sinks:
                step("results", phase_results, env, a.n, ls.url, a.rounds)
            if "null" in sinks:
                step("results_null", phase_results, env, a.n, ls.url, a.rounds, "null")
        if a.latency_ms:
            from tests.faultproxy import FaultProxy

            with FaultProxy(ls.url, latency_ms=a.latency_ms) as proxy:
                tag = f"latency{a.latency_ms:g}ms"
                if "ceiling" in phases:
                    step("ceiling_latency", phase_ceiling, env, a.n, proxy.url, f"ceiling+{tag}")
                step("daemon_latency", phase_daemon, env, a.n, proxy.url, f"daemon+{tag}")
        if a.profile:
            step("daemon_profiled", phase_daemon, env, a.n, ls.url, "daemon-profiled",
                 profile=True, tree=new)
            if old:
                step("daemon_profiled_baseline", phase_daemon, env, a.n, ls.url,
                     "daemon-profiled-baseline", profile=True, tree=old)
        if a.soak:
            step("soak", phase_daemon, env, 0, ls.url, "soak", soak=a.soak,
                 soak_rate=a.soak_rate)
    r["wall_seconds"] = time.monotonic() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"throughput-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(r, indent=2, default=str))
    print()
    print(report(r))
    print(f"\nfull results: {out.relative_to(ROOT)}  (wall {r['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_ceiling":
        ep, url, n, pollers, inflight = sys.argv[2:7]
        print(json.dumps(_run_async(_ceiling_main(ep, url, int(n), int(pollers), int(inflight)))))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "_naive":
        ep, url, dsn, n = sys.argv[2:6]
        print(json.dumps(_run_async(_naive_main(ep, url, dsn, int(n)))))
        sys.exit(0)
    sys.exit(main())

"""Drive the real ``sqs-ingest run`` process and check the exactly-once invariants."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.chaos_handlers import LEDGER_DDL
from tests.crashpoint import VARIABLE as CRASH_VARIABLE
from tests.servers import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
#: Loaded into every daemon the harness starts: ``ledger.append`` is the workload's
#: counting effect (see chaos_handlers), the other types serve test_chaos_handlers.
CHAOS_HANDLERS = "tests.acceptance.chaos_handlers"


def chaos_seed(default: int) -> int:
    """The seed of a randomised test: fixed per test, overridden by ``CHAOS_SEED`` to replay a
    failure, and printed (pytest shows it with the failure)."""
    seed = int(os.environ.get("CHAOS_SEED", default))
    print(f"CHAOS_SEED={seed}  (rerun with CHAOS_SEED={seed} to replay)")
    return seed


class Daemon:
    """One ``python -m service run`` process with its own log file and HTTP port (``python -m
    tests.crashpoint run`` when the env sets INGEST_TEST_CRASH_AT)."""

    def __init__(self, env: dict[str, str], log_dir: Path, name: str = "daemon") -> None:
        self.port = free_port()
        base = {k: v for k, v in os.environ.items() if not k.startswith("INGEST_")}
        self.env = {**base, "INGEST_HTTP_PORT": str(self.port), "INGEST_HTTP_HOST": "127.0.0.1",
                    **env}
        self.log_dir = log_dir
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> Daemon:
        self.starts += 1
        log = open(self.log_dir / f"{self.name}.{self.starts}.log", "wb")
        # With INGEST_TEST_CRASH_AT, through the harness's crash point (tests/crashpoint.py):
        # the daemon itself has none.
        main = "tests.crashpoint" if self.env.get(CRASH_VARIABLE) else "service"
        self.proc = subprocess.Popen([sys.executable, "-m", main, "run"], env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def get(self, path: str) -> tuple[int, str]:
        """Status and body of an HTTP answer. Raises OSError when nothing answers: a closed
        port is a dead or not yet listening process, never evidence of "not ready"."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def ready(self) -> bool:
        try:
            return self.get("/readyz")[0] == 200
        except OSError:
            return False  # not listening (yet, or any more)

    def wait_ready(self, timeout: float = 30) -> None:
        wait_until(lambda: self.ready() or self.exited(), timeout, f"{self.name} ready")
        assert not self.exited(), self.logs()

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.wait(10)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 60) -> int:
        if self.proc is None or self.exited():
            return self.proc.returncode if self.proc else 0
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def full_logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")
                         for p in sorted(self.log_dir.glob(f"{self.name}.*.log")))

    def logs(self) -> str:
        """The tail of each log file, for assertion messages."""
        return "\n".join(p.read_text(errors="replace")[-4000:]
                         for p in sorted(self.log_dir.glob(f"{self.name}.*.log")))

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` (e.g. ``…_total``) whose labels include
        ``labels``, parsed from ``/metrics``."""
        total = 0.0
        for family in text_string_to_metric_families(self.get("/metrics")[1]):
            total += sum(s.value for s in family.samples if s.name == name
                         and all(s.labels.get(k) == v for k, v in labels.items()))
        return total


def upsert(rid: str, eid: str, version: int, **extra: Any) -> str:
    return json.dumps({"request_id": rid, "type": "entity.upsert",
                       "payload": {"entity_id": eid, "version": version,
                                   "data": {"v": version, "pad": "x" * 40}}, **extra})


def delete(rid: str, eid: str, version: int) -> str:
    return json.dumps({"request_id": rid, "type": "entity.delete",
                       "payload": {"entity_id": eid, "version": version}})


def ledger(rid: str, group: str, seq: int) -> str:
    return json.dumps({"request_id": rid, "type": "ledger.append",
                       "payload": {"group": group, "seq": seq}})


async def create_ledger(dsn: str) -> None:
    """The table ``ledger.append`` writes to; the daemon under test needs it before it starts."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(LEDGER_DDL)
    finally:
        await conn.close()


@dataclass
class Workload:
    """A deterministic mix: valid upserts/deletes and ledger appends (the counting effect),
    ~20 % duplicates, SNS-wrapped copies, poison bodies (each unique), and — sent later —
    reused keys."""

    seed: int = 7
    entities: int = 40
    groups: int = 6
    ledger_share: float = 0.25  # 0 = the original entity-only mix
    # rid → (type, entity id or ledger group, version or ledger sequence number)
    valid: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    poison: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    _version: int = 0

    def ledger_entries(self) -> dict[str, tuple[str, int]]:
        """rid → (group, seq) of every ledger.append request."""
        return {rid: (g, n) for rid, (kind, g, n) in self.valid.items() if kind == "ledger.append"}

    def bodies(self, n: int, prefix: str = "r") -> list[str]:
        rng = random.Random(f"{self.seed}-{prefix}")
        out: list[str] = []
        for i in range(n):
            self._version += 1
            rid, eid = f"{prefix}-{i}", f"e{rng.randrange(self.entities)}"
            kind_draw = rng.random()
            if kind_draw < 0.15:
                body, kind = delete(rid, eid, self._version), "entity.delete"
            elif kind_draw < 0.15 + self.ledger_share:
                eid = f"g{rng.randrange(self.groups)}"
                body, kind = ledger(rid, eid, self._version), "ledger.append"
            else:
                body, kind = upsert(rid, eid, self._version), "entity.upsert"
            self.valid[rid] = (kind, eid, self._version)
            if rng.random() < 0.1:
                body = json.dumps({"Type": "Notification", "MessageId": f"sns-{rid}",
                                   "TopicArn": "arn:aws:sns:us-east-1:1:t", "Message": body})
            out.append(body)
            if rng.random() < 0.2:
                out.append(body)  # duplicate delivery
            if rng.random() < 0.05:
                p = rng.choice([
                    f"not json {prefix}-{i} \u00e9\t",
                    json.dumps({"request_id": f"{rid}-p", "type": "no.such.type", "payload": {}}),
                    json.dumps({"type": "entity.upsert", "payload": {}, "n": f"{rid}"}),
                    json.dumps({"request_id": f"{rid}-q", "type": "entity.upsert",
                                "payload": {"entity_id": 5, "version": "x"}}),
                ])
                self.poison.append(p)
                out.append(p)
        rng.shuffle(out)
        return out

    def reuse(self, rids: list[str]) -> list[str]:
        """Same request_id, different payload: each must end in dead_letters."""
        out = []
        for rid in rids:
            b = upsert(rid, "reused", 10**9, note=f"reuse of {rid}")
            self.reused.append(b)
            out.append(b)
        return out

    def expected_entities(self) -> dict[str, tuple[int, bool]]:
        state: dict[str, tuple[int, bool]] = {}
        for kind, eid, ver in self.valid.values():
            if kind == "ledger.append":
                continue
            if eid not in state or ver > state[eid][0]:
                state[eid] = (ver, kind == "entity.delete")
        return state


def fifo_ledger(w: Workload, groups: int, per_group: int, prefix: str = "f") -> list[tuple[str, str]]:
    """A FIFO workload of ledger appends: (group, body) in send order, groups interleaved,
    ``seq`` rising within each group; recorded in ``w`` for check_invariants."""
    rng = random.Random(f"{w.seed}-{prefix}")
    nxt = dict.fromkeys((f"{prefix}g{g}" for g in range(groups)), 0)
    out: list[tuple[str, str]] = []
    while any(n < per_group for n in nxt.values()):
        group = rng.choice([g for g, n in nxt.items() if n < per_group])
        nxt[group] += 1
        rid = f"{group}-{nxt[group]}"
        w.valid[rid] = ("ledger.append", group, nxt[group])
        out.append((group, ledger(rid, group, nxt[group])))
    return out


def send_fifo(sqs: Any, queue_url: str, items: list[tuple[str, str]]) -> None:
    """Send (group, body) pairs in order; each send is its own deduplication id, so a body
    sent twice is delivered twice."""
    for start in range(0, len(items), 10):
        chunk = items[start:start + 10]
        resp = sqs.send_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": str(i), "MessageBody": b, "MessageGroupId": g,
             "MessageDeduplicationId": uuid.uuid4().hex}
            for i, (g, b) in enumerate(chunk)])
        assert not resp.get("Failed"), resp


def in_flight(sqs: Any, queue_url: str) -> int:
    """Messages received and neither deleted nor visible again."""
    a = sqs.get_queue_attributes(QueueUrl=queue_url,
                                 AttributeNames=["ApproximateNumberOfMessagesNotVisible"])
    return int(a["Attributes"]["ApproximateNumberOfMessagesNotVisible"])


def log_events(d: Daemon, event: str) -> list[dict[str, Any]]:
    """The JSON log entries of every incarnation of ``d`` with this event name."""
    out = []
    for line in d.full_logs().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == event:
                out.append(entry)
    return out


def send_all(sqs: Any, queue_url: str, bodies: list[str]) -> None:
    for start in range(0, len(bodies), 10):
        chunk = bodies[start:start + 10]
        resp = sqs.send_message_batch(QueueUrl=queue_url, Entries=[
            {"Id": str(i), "MessageBody": b} for i, b in enumerate(chunk)])
        assert not resp.get("Failed"), resp


async def completed_rows(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(
            "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'"))
    finally:
        await conn.close()


def completed_now(dsn: str) -> int:
    """COMPLETED rows, for the sync wait loops of async tests (run on a private loop)."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, completed_rows(dsn)).result(30)


def queue_depth(sqs: Any, queue_url: str) -> int:
    a = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["All"])["Attributes"]
    return int(a["ApproximateNumberOfMessages"]) + int(a["ApproximateNumberOfMessagesNotVisible"])


async def ledger_rows(dsn: str) -> list[asyncpg.Record]:
    """The ledger in commit order within each group (ids are taken in insertion order)."""
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch("SELECT request_id, grp, seq FROM chaos_ledger ORDER BY id"))
    finally:
        await conn.close()


async def check_group_order(dsn: str, groups: int, per_group: int) -> None:
    """FIFO: every group's ledger effects in send order (seq 1..per_group, by commit)."""
    by_group: dict[str, list[int]] = {}
    for r in await ledger_rows(dsn):
        by_group.setdefault(r["grp"], []).append(r["seq"])
    assert len(by_group) == groups, by_group
    expected = list(range(1, per_group + 1))
    out_of_order = {g: seqs for g, seqs in by_group.items() if seqs != expected}
    assert not out_of_order, f"effects out of send order within a group: {out_of_order}"


def check_ledger(rows: list[asyncpg.Record], expected: dict[str, tuple[str, int]]) -> None:
    """Each ledger request's effect landed exactly once, with its own payload."""
    counts = Counter(r["request_id"] for r in rows)
    doubled = {rid: n for rid, n in counts.items() if n > 1}
    assert not doubled, f"effects applied more than once: {dict(list(doubled.items())[:5])}"
    assert set(counts) == set(expected), (
        f"missing={sorted(set(expected) - set(counts))[:5]} "
        f"extra={sorted(set(counts) - set(expected))[:5]}")
    wrong = [r["request_id"] for r in rows if (r["grp"], r["seq"]) != expected[r["request_id"]]]
    assert not wrong, f"ledger rows with another request's payload: {wrong[:5]}"


async def check_invariants(dsn: str, w: Workload, sqs: Any, queue_url: str) -> dict[str, int]:
    """Every valid request_id exactly one COMPLETED row, none IN_PROGRESS, each counting
    effect (ledger row) exactly once, entities equal the replayed state, every poison body
    stored once byte for byte, queue empty."""
    check_ledger(await ledger_rows(dsn), w.ledger_entries())
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT request_id, status FROM modifications")
        statuses = {r["request_id"]: r["status"] for r in rows}
        assert set(statuses) == set(w.valid), (
            f"missing={sorted(set(w.valid) - set(statuses))[:5]} "
            f"extra={sorted(set(statuses) - set(w.valid))[:5]}")
        in_progress = [r for r, s in statuses.items() if s != "COMPLETED"]
        assert not in_progress, f"IN_PROGRESS left: {in_progress[:5]}"
        ents = {r["entity_id"]: (r["version"], r["deleted"]) for r in await conn.fetch(
            "SELECT entity_id, version, deleted FROM entities")}
        expected = w.expected_entities()
        assert ents == expected, {e: (ents.get(e), expected.get(e))
                                  for e in set(ents) | set(expected)
                                  if ents.get(e) != expected.get(e)}
        # The stored data is the payload's data object (not a string, not another version's).
        bad = await conn.fetch(
            "SELECT e.entity_id FROM entities e JOIN modifications m ON m.request_id = e.request_id"
            " WHERE e.data IS DISTINCT FROM (m.payload -> 'data')"
            "    OR (NOT e.deleted AND jsonb_typeof(e.data) <> 'object')")
        assert not bad, f"entities.data differs from its modification: {bad[:5]}"
        dl = await conn.fetch("SELECT body, reason FROM dead_letters")
        bodies = [r["body"] for r in dl]
        assert sorted(bodies) == sorted(w.poison + w.reused), (
            f"dead letters: {len(bodies)} vs expected {len(w.poison) + len(w.reused)}")
        reasons = {r["body"]: r["reason"] for r in dl}
        assert all(reasons[b] == "idempotency_key_reused" for b in w.reused)
    finally:
        await conn.close()
    assert queue_depth(sqs, queue_url) == 0
    return {"completed": len(statuses), "entities": len(ents), "poison": len(w.poison),
            "reused": len(w.reused), "ledger": len(w.ledger_entries())}


def wait_drained(sqs: Any, queue_url: str, daemons: list[Daemon], timeout: float = 120) -> None:
    def drained() -> bool:
        for d in daemons:
            # why the ignore below: a started daemon has its process
            assert not d.exited() or d.proc.returncode == 0, d.logs()  # type: ignore[union-attr]
        return queue_depth(sqs, queue_url) == 0

    wait_until(drained, timeout, "queue drained", interval=0.3)


def counted(d: Daemon, at_least: dict[str, float], timeout: float = 30) -> dict[str, float]:
    """``sqs_ingest_messages_processed_total`` by outcome, once each outcome in ``at_least``
    has reached its count (bounded). A batch's outcomes are counted after its delete
    returns, so a queue already seen drained can still have its last batches uncounted."""
    def read() -> dict[str, float]:
        return {o: d.metric("sqs_ingest_messages_processed_total", outcome=o)
                for o in at_least}

    def reached() -> dict[str, float] | None:
        got = read()
        return got if all(got[o] >= n for o, n in at_least.items()) else None

    try:
        return wait_until(reached, timeout, "outcomes counted")
    except TimeoutError:
        raise AssertionError(f"outcomes {read()}, expected at least {at_least}") from None


def daemon_env(dsn: str, queue_url: str, endpoint: str, **extra: str) -> dict[str, str]:
    return {
        "INGEST_DATABASE_URL": dsn, "INGEST_QUEUE_URL": queue_url,
        "INGEST_SQS_ENDPOINT_URL": endpoint, "INGEST_WAIT_TIME_SECONDS": "2",
        "INGEST_LOG_LEVEL": "info", "INGEST_SHUTDOWN_TIMEOUT": "15",
        "INGEST_RETRY_BASE_SECONDS": "1", "INGEST_CONTENTION_DELAY": "2",
        "INGEST_GC_INTERVAL": "1", "INGEST_WORKER_LEASE": "4",
        "INGEST_QUEUE_ATTRIBUTES_INTERVAL": "1",
        "INGEST_HANDLERS": CHAOS_HANDLERS, "PYTHONPATH": str(REPO),
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        **extra,
    }


def now() -> float:
    return time.monotonic()

"""What a message costs, counted rather than timed (SPEC §7 "cost figures"): ``make bench``'s
``costs`` phase (``PHASES=costs``; part of the default phases).

One daemon with its defaults drains a fresh queue through two counting proxies:

* SQS requests by action — ``tests/faultproxy.FaultProxy`` between the daemon and
  LocalStack (the producer's sends go to LocalStack directly and are not counted);
* PostgreSQL round trips and transactions on the wire — ``tests/pgwire.PgWireCounter``
  between the daemon and PostgreSQL (each connection's login taken off);
* WAL bytes — ``pg_current_wal_lsn()`` before and after (the cluster serves nothing else);
* batches — ``sqs_ingest_batch_duration_seconds_count`` from the daemon's /metrics.

Two loads: a **backlog** (COSTS_N messages, default 3,000, preloaded before the daemon
starts) and a **trickle** (COSTS_RATE messages a second, default 50, for COSTS_SECONDS,
default 30, sent one SendMessage at a time), each counted from the daemon's first ready
answer until every message is COMPLETED and the queue is empty. The trickle also reports
send -> COMPLETED latency (p50, p99; the producer's clock and the database's, one host).
Idle long polls within the window are counted: they are what a trickle costs.

A third load, **slow** (COSTS_SLOW_RATE messages a second, default 20, for
COSTS_SLOW_SECONDS, default 10), is a trickle of ``bench.slow`` messages whose batches each
take COSTS_SLOW_HANDLER seconds (default 3; bench/slow_handler.py) under a visibility
timeout of COSTS_SLOW_VT (default 4): every batch is extended while it runs, and the
heartbeat's ChangeMessageVisibilityBatch requests are counted per message and per entry
(``sqs_ingest_visibility_extensions_total``). COSTS_SLOW_SECONDS=0 skips it.

With ``PEER=sqs-consumer``, the peer (bench/peer/peer.mjs: bbc/sqs-consumer, 8 consumers,
one transaction per batch of 10) is counted the same way, through the same proxies, on
the backlog and the trickle: what a consumer without the claim, the fence, retries and
dead letters costs. Its batches are its own count (the JSON line it prints on SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faultproxy import FaultProxy  # noqa: E402
from tests.pgwire import PgWireCounter  # noqa: E402
from tests.servers import free_port, wait_until  # noqa: E402


def _env_num(name: str, default: float) -> float:
    v = os.environ.get(name, "").strip()
    return float(v) if v else default


async def _fetch(dsn: str, sql: str, *args: Any) -> list[Any]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


def _one(dsn: str, sql: str, *args: Any) -> Any:
    return asyncio.run(_fetch(dsn, sql, *args))[0][0]


def measure(tp: Any, env: Any, mode: str, who: str = "daemon") -> dict[str, Any]:
    """One counted drain by ``who`` (the daemon, or the peer); ``tp`` is bench/throughput.py
    (its queue, daemon and peer helpers)."""
    n = int(_env_num("COSTS_N", 3000))
    rate = _env_num("COSTS_RATE", 50)
    seconds = _env_num("COSTS_SECONDS", 30)
    slow = mode == "slow"
    if slow:
        rate = _env_num("COSTS_SLOW_RATE", 20)
        seconds = _env_num("COSTS_SLOW_SECONDS", 10)
    label = env.next(f"costs-{mode}-" if who == "daemon" else f"costs-{who}-{mode}-")
    db = label.replace("-", "_")
    direct = tp.new_database(env, db)
    url = tp.create_queue(env.ls.url, label)
    if mode == "backlog":
        tp.preload(env.ls.url, url, label, n)
    pg = urllib.parse.urlsplit(env.pg_dsn("postgres"))
    port = free_port()
    res: dict[str, Any] = {"mode": mode}
    log_path = tp.RESULTS / f"{who}-{label}.log"
    tp.RESULTS.mkdir(parents=True, exist_ok=True)
    with FaultProxy(env.ls.url) as sqs, \
            PgWireCounter(pg.hostname or "127.0.0.1", pg.port or 5432, pg.username or "") as wire, \
            open(log_path, "wb") as log:
        denv = {**os.environ, "INGEST_QUEUE_URL": url, "INGEST_DATABASE_URL": wire.dsn(db),
                "INGEST_SQS_ENDPOINT_URL": sqs.url, "INGEST_HTTP_PORT": str(port),
                "INGEST_HTTP_HOST": "127.0.0.1"}
        if slow:
            denv.update(INGEST_HANDLERS="bench.slow_handler",
                        INGEST_VISIBILITY_TIMEOUT=str(int(_env_num("COSTS_SLOW_VT", 4))))
        def start_counts() -> tuple[Counter[str], Any, str]:
            return (Counter(sqs.by_action), wire.counts(),
                    _one(direct, "SELECT pg_current_wal_lsn()::text"))

        peer = who != "daemon"
        if peer:
            # Counted from before it starts: it has no readiness to wait for, and its pool
            # connects on first use (logins are taken off below).
            sqs0, pg0, wal0 = start_counts()
            penv = {**os.environ, "PEER_QUEUE_URL": url, "PEER_ENDPOINT": sqs.url,
                    "PEER_DATABASE_URL": wire.dsn(db), "AWS_DEFAULT_REGION": tp.REGION}
            proc = subprocess.Popen([str(shutil.which("node")), "peer.mjs"], cwd=tp.PEER_DIR,
                                    env=penv, stdout=subprocess.PIPE, stderr=log)
        else:
            proc = subprocess.Popen([sys.executable, "-m", "service", "run"], cwd=ROOT,
                                    env=denv, stdout=log, stderr=subprocess.STDOUT)
        try:
            if not peer:
                wait_until(lambda: _ready(port, proc), 60, "daemon /readyz")
                sqs0, pg0, wal0 = start_counts()
                batches0 = _batches(tp, port)
                extended0 = _metric(tp, port, "sqs_ingest_visibility_extensions_total")
            sent: dict[str, float] = {}
            if mode in ("trickle", "slow"):
                n = int(rate * seconds)
                sent = _trickle(tp, env.ls.url, url, label, n, rate,
                                _slow_body if slow else tp.make_body)
            deadline = time.monotonic() + max(120.0, n / 20)
            while _one(direct, "SELECT count(*) FROM modifications WHERE status = "
                               "'COMPLETED'") < n:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"costs {mode}: not drained; see {log_path}")
                time.sleep(0.5)
            wait_until(lambda: tp.queue_depth(env.ls.url, url) == 0, 60, "the last acks")
            sqs1, pg1 = Counter(sqs.by_action), wire.counts()
            wal = _one(direct, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)", wal0)
            if not peer:
                batches = _batches(tp, port) - batches0
                extended = _metric(tp, port, "sqs_ingest_visibility_extensions_total") - extended0
            if sent:
                res.update(_latency(direct, sent))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            res["exit_code"] = proc.returncode
            if peer:
                # It aborts its long polls on SIGTERM; the proxy still holds them upstream
                # (up to 20 s) and cannot stop before they end.
                wait_until(lambda: sum(sqs.in_flight.values()) == 0, 30,
                           "the peer's aborted long polls")
        if peer:
            lines = (out or b"").decode().strip().splitlines()
            stats = json.loads(lines[-1]) if lines else {}
            batches, extended = float(stats.get("batches", 0)), 0.0
            res["peer_errors"] = stats.get("errors")
    by_action = {k: sqs1[k] - sqs0[k] for k in sqs1 if sqs1[k] - sqs0[k]}
    trips = pg1.minus(pg0)
    requests = sum(by_action.values())
    res.update({
        "messages": n, "batches": batches, "sqs_requests": by_action,
        "sqs_requests_per_message": requests / n,
        "pg_round_trips": trips.round_trips - trips.connections,  # logins of new connections
        "pg_connections_opened": trips.connections,
        "pg_round_trips_per_message": (trips.round_trips - trips.connections) / n,
        "pg_round_trips_per_batch": (trips.round_trips - trips.connections) / max(batches, 1),
        "transactions_per_message": (trips.transactions - trips.connections) / n,
        "wal_bytes_per_message": float(wal) / n,
        "extensions_per_message": extended / n,
        "extension_requests_per_message": by_action.get("ChangeMessageVisibilityBatch", 0) / n,
        "log": str(log_path.relative_to(ROOT)),
    })
    return res


def _ready(port: int, proc: subprocess.Popen[bytes]) -> bool:
    if proc.poll() is not None:
        raise RuntimeError(f"daemon exited {proc.returncode}")
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).close()
        return True
    except OSError:
        return False


def _batches(tp: Any, port: int) -> float:
    return _metric(tp, port, "sqs_ingest_batch_duration_seconds_count")


def _metric(tp: Any, port: int, name: str) -> float:
    return float(sum(v for (k, _), v in tp.scrape(port).items() if k == name))


def _slow_body(label: str, i: int) -> str:
    return json.dumps({"request_id": f"{label}-{i:08d}", "type": "bench.slow",
                       "payload": {"n": i}})


def _trickle(tp: Any, endpoint: str, url: str, label: str, n: int,
             rate: float, make_body: Callable[[str, int], str]) -> dict[str, float]:
    """``n`` messages, one SendMessage each, every 1/rate s on a fixed schedule; returns
    request_id -> wall time of its send."""
    client = tp.sqs_sync(endpoint)
    sent: dict[str, float] = {}
    start = time.monotonic()
    for i in range(n):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        body = make_body(label, i)
        t = time.time()
        client.send_message(QueueUrl=url, MessageBody=body)
        sent[f"{label}-{i:08d}"] = t
    return sent


def _latency(dsn: str, sent: dict[str, float]) -> dict[str, Any]:
    rows = asyncio.run(_fetch(
        dsn, "SELECT request_id, extract(epoch FROM completed_at) FROM modifications "
             "WHERE status = 'COMPLETED'"))
    lat = sorted(float(r[1]) - sent[r[0]] for r in rows if r[0] in sent)
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else lat * 99
    return {"latency_p50_s": q[49], "latency_p99_s": q[98], "latency_max_s": lat[-1]}


def phase(tp: Any, env: Any, peer: str | None = None) -> dict[str, Any]:
    out = {"backlog": measure(tp, env, "backlog"), "trickle": measure(tp, env, "trickle")}
    if _env_num("COSTS_SLOW_SECONDS", 10) > 0:
        out["slow"] = measure(tp, env, "slow")
    if peer:
        out["peer"] = {"name": peer, "backlog": measure(tp, env, "backlog", who="peer"),
                       "trickle": measure(tp, env, "trickle", who="peer")}
    return out


#: The rows of the counted table: (figure, key in a measure() result, format).
ROWS = [("SQS requests per message", "sqs_requests_per_message", ".3f"),
        ("PostgreSQL round trips per message", "pg_round_trips_per_message", ".3f"),
        ("PostgreSQL round trips per batch", "pg_round_trips_per_batch", ".2f"),
        ("transactions per message", "transactions_per_message", ".3f"),
        ("WAL bytes per message", "wal_bytes_per_message", ",.0f"),
        ("batches", "batches", ",.0f")]


def _table(title: str, b: dict[str, Any], t: dict[str, Any], who: str) -> list[str]:
    """The counted figures of one consumer's backlog and trickle drains."""
    lines = ["", title, "| figure | backlog | trickle |", "| --- | ---: | ---: |",
             f"| messages | {b['messages']:,} | {t['messages']:,} "
             f"({_env_num('COSTS_RATE', 50):g}/s) |"]
    lines += [f"| {name} | {b.get(key, 0):{spec}} | {t.get(key, 0):{spec}} |"
              for name, key, spec in ROWS]
    for mode, r in (("backlog", b), ("trickle", t)):
        lines.append(f"{who}SQS requests ({mode}): " + ", ".join(
            f"{k} {v:,}" for k, v in sorted(r["sqs_requests"].items())))
    if "latency_p99_s" in t:
        lines.append(f"{who}trickle send -> COMPLETED: p50 {t['latency_p50_s']:.3f} s, "
                     f"p99 {t['latency_p99_s']:.3f} s, max {t['latency_max_s']:.3f} s")
    return lines


def report(c: dict[str, Any]) -> list[str]:
    lines = _table("Cost per message, counted (one daemon, defaults, reference handlers):",
                   c["backlog"], c["trickle"], "")
    p = c.get("peer")
    if p:
        lines += _table(f"The peer ({p['name']}), counted the same way:",
                        p["backlog"], p["trickle"], "peer ")
    s = c.get("slow")
    if s:
        requests = s["extension_requests_per_message"]
        per = s["extensions_per_message"] / requests if requests else 0.0
        lines.append(
            f"slow handlers ({s['messages']:,} messages at {_env_num('COSTS_SLOW_RATE', 20):g}/s, "
            f"{_env_num('COSTS_SLOW_HANDLER', 3):g} s a batch, visibility timeout "
            f"{_env_num('COSTS_SLOW_VT', 4):g} s; {s['batches']:,.0f} batches): heartbeat "
            f"ChangeMessageVisibilityBatch {requests:.3f} per message, "
            f"{s['extensions_per_message']:.3f} extensions per message, {per:.1f} entries "
            f"per request; SQS requests per message {s['sqs_requests_per_message']:.3f}")
    return lines

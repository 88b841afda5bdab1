"""The cost curve (issue 12): how the daemon's cost grows with its tables, and what pruning
costs it — in one run, on one throwaway PostgreSQL server and LocalStack SQS.

    .venv/bin/python bench/cost_curve.py             # what `make bench-growth` runs
    SIZES=0,1000000 PRUNE_ROWS=200000 .venv/bin/python bench/cost_curve.py   # quicker

1. Growth: the same database is filled to each of SIZES (default 0, 1 M, 10 M rows of
   ``COMPLETED`` modifications, ~300-byte payloads, completed within the retention window),
   then measured at each size:
   - claim + complete latency per batch of ten, p50/p99 (and max) over BATCHES batches,
     through the daemon's own ``Store.claim`` / ``Store.apply`` with the reference
     ``entity.upsert`` handler (the SQL and the code the daemon runs, no SQS in the way);
   - daemon throughput: ``sqs-ingest run`` draining N preloaded messages (bench/throughput's
     daemon phase: rate from ``completed_at``, CPU per message).
   The goal is flat: every statement an index lookup, not a scan.
2. Pruning under load, for each INGEST_PRUNE_PAUSE in PRUNE_PAUSES (default 0 and 0.5 s):
   a fresh database with PRUNE_ROWS expired rows (completed 40-60 days
   ago, past the default 30-day retention). Three drains of PRUNE_N messages: without
   pruning, with ``sqs-ingest prune`` started as the drain starts, without again (the two
   baselines bracket the pruned drain against drift). Reported: the daemon's rate while the
   prune ran ÷ the baselines' rate (goal ≥ 0.9), the prune's rows/s, and the longest lock
   wait any session saw (``log_lock_waits`` with ``deadlock_timeout`` = 10 ms: PostgreSQL
   logs every wait longer than that, so "none" means none over 10 ms).
3. Sizes: ``modifications`` heap, indexes and total before the prune, after it, and after
   a plain ``VACUUM`` (which makes the space reusable; it does not give it back to the OS).

Prints a table, writes JSON to bench/results/. Takes ~15 minutes with the defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import throughput as tp  # noqa: E402

ROOT = tp.ROOT
SIZES = [int(x) for x in os.environ.get("SIZES", "0,1000000,10000000").split(",") if x]
N = tp._env_int("N", 5000)
BATCHES = tp._env_int("BATCHES", 300)
PRUNE_ROWS = tp._env_int("PRUNE_ROWS", 1_000_000)
PRUNE_N = tp._env_int("PRUNE_N", 60_000)
#: INGEST_PRUNE_PAUSE values to measure, one bracketed pruned drain each (refilled between).
PRUNE_PAUSES = [float(x) for x in os.environ.get("PRUNE_PAUSES", "0,0.5").split(",") if x]
FILL_CHUNK = 500_000

# COMPLETED rows shaped like the daemon's: an entity.upsert payload, its hash, a result.
FILL = """
INSERT INTO modifications (request_id, request_type, payload, payload_sha256, status,
                           sqs_message_id, owner, sent_at, received_at, completed_at, result)
SELECT 'fill-' || g, 'entity.upsert', p, md5(p::text) || md5(g::text), 'COMPLETED',
       'msg-' || g, NULL, t, t, t + interval '20 milliseconds', '{"version": 1}'::jsonb
  FROM generate_series($1::bigint, $2::bigint) AS g,
       LATERAL (SELECT now() - make_interval(secs => $3 + random() * $4) AS t) AS ts,
       LATERAL (SELECT jsonb_build_object(
           'entity_id', 'fill-e-' || (g % 500000), 'version', g,
           'data', jsonb_build_object('name', 'customer ' || g, 'email', 'u' || g || '@example.com',
                                      'plan', 'pro', 'seats', g % 50, 'note', repeat('x', 88)))
           AS p) AS payload
"""
DAY = 86_400.0


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def fill(dsn: str, start: int, count: int, min_age_days: float, span_days: float) -> float:
    """Rows ``start`` … ``start + count - 1``; seconds it took (then ANALYZE)."""
    import asyncpg

    conn = await asyncpg.connect(dsn, command_timeout=3600)
    t0 = time.monotonic()
    try:
        for lo in range(start, start + count, FILL_CHUNK):
            hi = min(lo + FILL_CHUNK, start + count) - 1
            await conn.execute(FILL, lo, hi, min_age_days * DAY, span_days * DAY)
            print(f"bench: filled {hi + 1 - start:,}/{count:,}", flush=True)
        await conn.execute("VACUUM ANALYZE modifications")
    finally:
        await conn.close()
    return time.monotonic() - t0


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def store_latency(dsn: str, tag: str, batches: int) -> dict[str, Any]:
    """Claim + complete of ``batches`` batches of ten new requests, the daemon's code."""
    from service.adapters.store import Store, create_pool
    from service.core.messages import Message, Received, parse
    from service.handlers import default_registry, load_reference_handlers
    from service.handlers.invoke import Invoker

    load_reference_handlers()
    invoker = Invoker(default_registry)
    pool = await create_pool(dsn, 2)
    store = Store(pool, f"bench-{tag}")
    await store.register_worker(store.worker_id)
    claim_ms, complete_ms = [], []
    try:
        for b in range(batches):
            msgs = []
            for i in range(10):
                body = tp.make_body(f"lat-{tag}", b * 10 + i)
                m = parse(Received(f"m-{tag}-{b}-{i}", "rh", body), default_registry)
                assert isinstance(m, Message), m
                msgs.append(m)
            t0 = time.perf_counter()
            claims = await store.claim(msgs)
            t1 = time.perf_counter()
            assert all(c.claimed for c in claims.values())
            res = await store.apply(msgs, invoker.one, batch=invoker.batching)
            t2 = time.perf_counter()
            assert len(res.completed) == 10, res
            claim_ms.append((t1 - t0) * 1e3)
            complete_ms.append((t2 - t1) * 1e3)
    finally:
        await pool.close()
    total = [a + b for a, b in zip(claim_ms, complete_ms, strict=True)]
    return {
        "batches": batches,
        **{f"{k}_p50_ms": statistics.median(v) for k, v in
           (("claim", claim_ms), ("complete", complete_ms), ("total", total))},
        **{f"{k}_p99_ms": _pct(v, 0.99) for k, v in
           (("claim", claim_ms), ("complete", complete_ms), ("total", total))},
        "total_max_ms": max(total),
    }


async def sizes(dsn: str) -> dict[str, float]:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        r = await conn.fetchrow(
            "SELECT pg_relation_size('modifications') AS heap,"
            " pg_indexes_size('modifications') AS indexes,"
            " pg_total_relation_size('modifications') AS total,"
            " (SELECT count(*) FROM modifications) AS rows")
        return {"heap_mb": r["heap"] / 2**20, "indexes_mb": r["indexes"] / 2**20,
                "total_mb": r["total"] / 2**20, "rows": int(r["rows"])}
    finally:
        await conn.close()


async def sql(dsn: str, statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn, command_timeout=3600)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def lock_waits(log_path: str, offset: int) -> tuple[list[float], int]:
    """Lock waits PostgreSQL logged after ``offset`` (ms each), and the new offset."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
        end = f.tell()
    waits = [float(x) for x in re.findall(r"acquired \w+ on .*? after ([\d.]+) ms", text)]
    still = [float(x) for x in re.findall(r"still waiting for \w+ on .*? after ([\d.]+) ms", text)]
    return waits + still, end


class Pruner:
    """``sqs-ingest prune`` in its own process, started while the daemon drains."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.started = self.finished = 0.0
        self.output = ""
        self.code: int | None = None
        self._thread: threading.Thread | None = None

    def start(self, _res: dict[str, Any]) -> None:
        def go() -> None:
            self.started = time.time()
            out = subprocess.run([sys.executable, "-m", "service", "prune"], cwd=ROOT,
                                 env=self.env, capture_output=True, text=True)
            self.finished = time.time()
            self.output, self.code = out.stdout + out.stderr, out.returncode

        self._thread = threading.Thread(target=go, daemon=True)
        self._thread.start()

    def wait(self, timeout: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("prune did not finish")


async def completed_between(dsn: str, since: float, a: float, b: float) -> int:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(
            "SELECT count(*) FROM modifications WHERE status = 'COMPLETED'"
            " AND received_at >= to_timestamp($1)"
            " AND completed_at BETWEEN to_timestamp($2) AND to_timestamp($3)", since, a, b))
    finally:
        await conn.close()


async def last_completed(dsn: str, since: float) -> float:
    import asyncpg

    conn = await asyncpg.connect(dsn)
    try:
        return float(await conn.fetchval(
            "SELECT extract(epoch FROM max(completed_at)) FROM modifications"
            " WHERE status = 'COMPLETED' AND received_at >= to_timestamp($1)", since))
    finally:
        await conn.close()


def growth(env: tp.Env) -> list[dict[str, Any]]:
    dsn = tp.new_database(env, "growth")
    out: list[dict[str, Any]] = []
    have = 0
    for size in SIZES:
        point: dict[str, Any] = {"rows_before": size}
        if size > have:
            print(f"bench: filling to {size:,} rows ...", flush=True)
            point["fill_seconds"] = run(fill(dsn, have, size - have, 1, 20))
            have = size
        point["sizes"] = run(sizes(dsn))
        print(f"bench: claim + complete latency at {size:,} rows ...", flush=True)
        point["latency"] = run(store_latency(dsn, f"s{size}", BATCHES))
        print(f"bench: daemon drain at {size:,} rows ...", flush=True)
        d = tp.phase_daemon(env, N, env.ls.url, f"growth-{size}", dsn=dsn)
        point["daemon"] = {k: d[k] for k in ("rate", "cpu_us_per_msg", "postgres_cpu_us_per_msg",
                                             "exit_code")}
        lat = point["latency"]
        print(f"bench:   {size:>11,} rows: claim+complete p50 {lat['total_p50_ms']:.2f} ms, "
              f"p99 {lat['total_p99_ms']:.2f} ms; daemon {d['rate']:,.0f} msg/s", flush=True)
        out.append(point)
    return out


def pruning(env: tp.Env, pg: Any, pause: float, start: int) -> dict[str, Any]:
    dsn = tp.new_database(env, f"prune{start}")
    print(f"bench: filling {PRUNE_ROWS:,} expired rows ...", flush=True)
    fill_s = run(fill(dsn, start, PRUNE_ROWS, 40, 20))
    run(sql(dsn, "ALTER SYSTEM SET log_lock_waits = on"))
    run(sql(dsn, "ALTER SYSTEM SET deadlock_timeout = '10ms'"))
    run(sql(dsn, "SELECT pg_reload_conf()"))
    log_path = os.path.join(pg.datadir, "server.log")
    before = run(sizes(dsn))
    drains: list[dict[str, Any]] = []
    pruner: Pruner | None = None
    for label in ("baseline-1", "pruning", "baseline-2"):
        _, offset = lock_waits(log_path, 0)
        queue = tp.create_queue(env.ls.url, env.next("prune"))
        penv = {**os.environ, "INGEST_DATABASE_URL": dsn, "INGEST_QUEUE_URL": queue,
                "INGEST_SQS_ENDPOINT_URL": env.ls.url, "INGEST_LOG_FORMAT": "json",
                "INGEST_PRUNE_PAUSE": str(pause)}
        during = None
        if label == "pruning":
            pruner = Pruner(penv)
            during = pruner.start
        print(f"bench: prune phase, drain {label} ({PRUNE_N:,} messages) ...", flush=True)
        since = time.time() - 1
        d = tp.phase_daemon(env, PRUNE_N, env.ls.url, f"prune-{label}", dsn=dsn, during=during)
        waits, _ = lock_waits(log_path, offset)
        d.update({"label": label, "lock_waits_over_10ms": waits, "since": since})
        if pruner is not None and label == "pruning":
            pruner.wait(1800)
            assert pruner.code == 0, pruner.output
            d["prune_seconds"] = pruner.finished - pruner.started
            # The daemon's rate over the part of the drain the prune overlapped (a prune
            # that outlasts the drain is measured up to the drain's last commit).
            a = pruner.started
            b = min(pruner.finished, run(last_completed(dsn, since)))
            n_in = run(completed_between(dsn, since, a, b))
            d["overlap_seconds"] = b - a
            d["rate_while_pruning"] = n_in / (b - a) if b > a else None
            d["prune_output"] = pruner.output[-2000:]
            m = re.search(r"modifications\D+(\d+)", pruner.output)
            d["pruned_modifications"] = int(m.group(1)) if m else None
        print(f"bench:   {label}: {d['rate']:,.0f} msg/s"
              + (f", prune {d['prune_seconds']:.1f} s" if "prune_seconds" in d else ""), flush=True)
        drains.append(d)
    after = run(sizes(dsn))
    t0 = time.monotonic()
    run(sql(dsn, "VACUUM modifications"))
    vacuum_s = time.monotonic() - t0
    vacuumed = run(sizes(dsn))
    base = statistics.mean(d["rate"] for d in drains if d["label"] != "pruning")
    pr = next(d for d in drains if d["label"] == "pruning")
    rows = pr.get("pruned_modifications") or (before["rows"] - after["rows"] + 3 * PRUNE_N)
    return {
        "pause": pause, "fill_seconds": fill_s, "prune_rows": PRUNE_ROWS, "drain_n": PRUNE_N,
        "drains": [{k: v for k, v in d.items() if k in (
            "label", "rate", "seconds", "cpu_us_per_msg", "postgres_cpu_us_per_msg",
            "lock_waits_over_10ms", "prune_seconds", "rate_while_pruning",
            "pruned_modifications", "prune_output", "exit_code", "overlap_seconds")}
                   for d in drains],
        "baseline_rate": base,
        "ratio_while_pruning": (pr["rate_while_pruning"] or 0) / base,
        "ratio_whole_drain": pr["rate"] / base,
        "prune_rows_per_second": rows / pr["prune_seconds"],
        "prune_overlapped_drain": pr["prune_seconds"] <= pr["overlap_seconds"] + 0.5,
        "longest_lock_wait_ms": max((w for d in drains for w in d["lock_waits_over_10ms"]),
                                    default=None),
        "sizes": {"before_prune": before, "after_prune": after, "after_vacuum": vacuumed},
        "vacuum_seconds": vacuum_s,
    }


def report(r: dict[str, Any]) -> str:
    lines = [f"cost curve: N={r['n']} per drain, {r['batches']} batches of 10 per latency point"]
    lines.append(f"{'rows':>12}{'claim p50':>11}{'claim p99':>11}{'compl p50':>11}"
                 f"{'compl p99':>11}{'max':>8}{'msg/s':>9}{'CPU us':>8}{'PG us':>7}"
                 f"{'table MB':>10}{'index MB':>10}")
    for p in r["growth"]:
        lat, d, s = p["latency"], p["daemon"], p["sizes"]
        lines.append(f"{p['rows_before']:>12,}{lat['claim_p50_ms']:>11.2f}{lat['claim_p99_ms']:>11.2f}"
                     f"{lat['complete_p50_ms']:>11.2f}{lat['complete_p99_ms']:>11.2f}"
                     f"{lat['total_max_ms']:>8.1f}{d['rate']:>9,.0f}{d['cpu_us_per_msg']:>8.0f}"
                     f"{d['postgres_cpu_us_per_msg']:>7.0f}{s['heap_mb']:>10,.0f}"
                     f"{s['indexes_mb']:>10,.0f}")
    for p in r.get("pruning", []):
        lines.append(f"pruning {p['prune_rows']:,} expired rows (INGEST_PRUNE_PAUSE={p['pause']:g})"
                     f" while the daemon drains {p['drain_n']:,} messages:")
        for d in p["drains"]:
            lines.append(f"  {d['label']:<11} {d['rate']:>7,.0f} msg/s"
                         + (f", prune took {d['prune_seconds']:.1f} s, daemon "
                            f"{d['rate_while_pruning']:,.0f} msg/s over the "
                            f"{d['overlap_seconds']:.1f} s both ran"
                            if d.get("prune_seconds") else ""))
        lines.append(f"  daemon rate while pruning / baselines = {p['ratio_while_pruning']:.3f} "
                     f"(goal >= 0.9); whole drain {p['ratio_whole_drain']:.3f}; prune "
                     f"{p['prune_rows_per_second']:,.0f} rows/s"
                     + ("" if p["prune_overlapped_drain"] else
                        " (the prune outlasted the drain: measured while both ran)"))
        lw = p["longest_lock_wait_ms"]
        lines.append("  longest lock wait: " + (f"{lw:.1f} ms" if lw is not None
                                                else "none over 10 ms (log_lock_waits)"))
        for k in ("before_prune", "after_prune", "after_vacuum"):
            s = p["sizes"][k]
            lines.append(f"  {k:<13} rows {s['rows']:>10,}  heap {s['heap_mb']:>8,.0f} MB  "
                         f"indexes {s['indexes_mb']:>8,.0f} MB  total {s['total_mb']:>8,.0f} MB")
    return "\n".join(lines)


def main() -> int:
    # The daemons under measurement never prune on their own (the periodic pass would take
    # the expired rows from `sqs-ingest prune`, which would then find the lock taken).
    os.environ["INGEST_PRUNE_INTERVAL"] = "0"
    r: dict[str, Any] = {"machine": tp.machine(), "n": N, "batches": BATCHES, "sizes": SIZES,
                         "started": time.strftime("%FT%TZ", time.gmtime())}
    t0 = time.monotonic()
    tp.RESULTS.mkdir(parents=True, exist_ok=True)
    out = tp.RESULTS / f"cost-curve-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save() -> None:  # after each part: a long run that fails later keeps what it had
        r["wall_seconds"] = time.monotonic() - t0
        out.write_text(json.dumps(r, indent=2, default=str))

    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(tp.postgres_server())
        ls = stack.enter_context(tp.localstack_server())
        env = tp.Env(pg.dsn, pg.datadir, ls)
        r["growth"] = growth(env)
        save()
        r["pruning"] = []
        for i, pause in enumerate(PRUNE_PAUSES if PRUNE_ROWS else []):
            r["pruning"].append(pruning(env, pg, pause, (i + 1) * 100_000_000))
            save()
    save()
    print()
    print(report(r))
    print(f"\nfull results: {out.relative_to(ROOT)}  (wall {r['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

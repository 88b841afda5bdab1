"""The worker's own Python cost per message, old code against new, side by side.

    .venv/bin/python bench/worker_overhead.py BASELINE_REF [CANDIDATE_REF] [--rounds 6] [--n 30000]

Runs the real ``Worker`` (pollers, batches, plan, executor, handler invocation, metrics)
over an in-memory queue that costs nothing and a store that claims and completes
everything at once, so the figure is the daemon's per-message Python without aiobotocore,
asyncpg, the emulator or PostgreSQL — the part a restructuring can change, and far less
noisy than ``make bench`` on a shared machine. Each ref is exported with ``git archive``;
drains alternate between the two trees; medians and new/old are printed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DRAIN = r'''
import asyncio, collections, json, logging, sys, time, uuid
import structlog
from service.handlers import Registry
from service.handlers.entities import EntityUpsert
from service.core.messages import Received
from service.settings import Settings
from service.adapters.store import ApplyResult, ClaimResult
from service.runtime.worker import Worker

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
N = int(sys.argv[1])


class Queue:
    def __init__(self):
        self.q = collections.deque()
        self.left = 0

    def send(self, body):
        mid = uuid.uuid4().hex
        self.q.append(Received(mid, mid, body, 1, time.time(), None))
        self.left += 1

    async def receive(self, n=10, wait=0, vt=30):
        out = [self.q.popleft() for _ in range(min(n, len(self.q)))]
        if not out:
            await asyncio.sleep(0.001)
        return out

    async def delete_batch(self, ms):
        self.left -= len(ms)

    async def change_visibility_batch(self, changes):
        return []

    async def attributes(self):
        return {"ApproximateNumberOfMessages": "0", "VisibilityTimeout": "30"}


class Store:
    worker_id = "w"

    async def claim(self, ms):
        return {m.request_id: ClaimResult(m.request_id, True, None, None, None, None, 0)
                for m in ms}

    async def apply(self, ms, call, fifo=False, batch=None):
        res = ApplyResult(committed_at=time.time())
        for m in ms:
            res.completed.append((m, await call(m, None)))
        return res

    async def release(self, ms): pass
    async def dead_letter(self, letters): pass
    async def record_failures(self, failures, n): return {}
    async def gc(self, *a): return []
    async def gc_own_leaks(self, holding): return []
    async def heartbeat(self): return True
    async def stop_worker(self): return 0
    async def ping(self): pass
    async def check_schema(self): pass


async def main():
    registry = Registry()

    async def upsert(p, conn):
        return {"applied": True}

    registry.register("entity.upsert", EntityUpsert, upsert)
    q = Queue()
    for i in range(N):
        q.send(json.dumps({"request_id": f"r{i}", "type": "entity.upsert", "payload": {
            "entity_id": f"e{i}", "version": 1, "data": {"v": i}}}))
    s = Settings(queue_url="http://127.0.0.1:1/q", database_url="postgresql://u@127.0.0.1/d",
                 wait_time_seconds=0, pollers=8, queue_attributes_interval=3600,
                 gc_interval=3600, worker_lease=3600, http_port=0)
    w = Worker(s, q, Store(), registry, visibility_timeout=30)
    task = asyncio.create_task(w.run())
    cpu = time.process_time()
    while q.left:
        await asyncio.sleep(0.001)
    cpu = time.process_time() - cpu
    w.request_stop()
    await task
    print(cpu / N * 1e6)


asyncio.run(main())
'''


def export(ref: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref, "service"], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def drain(tree: Path, n: int) -> float:
    out = subprocess.run([sys.executable, "-c", DRAIN, str(n)], cwd=tree, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(tree)})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline")
    ap.add_argument("candidate", nargs="?", default=None, help="default: the working tree")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--n", type=int, default=30000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old = export(a.baseline, Path(tmp) / "old")
        new = export(a.candidate, Path(tmp) / "new") if a.candidate else ROOT
        runs: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(a.rounds):
            order = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
            for name, tree in order:
                runs[name].append(drain(tree, a.n))
        o, n = statistics.median(runs["old"]), statistics.median(runs["new"])
        print(f"worker CPU per message, {a.rounds} rounds of {a.n} (medians, µs):")
        print(f"  old {a.baseline}: {o:.1f}  {[round(x, 1) for x in runs['old']]}")
        print(f"  new {a.candidate or 'working tree'}: {n:.1f}  "
              f"{[round(x, 1) for x in runs['new']]}")
        print(f"  new/old {n / o:.2f}")


if __name__ == "__main__":
    main()

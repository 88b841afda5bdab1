"""The daemon's HTTP surface as its users see it: a real Prometheus server scraping the real
``sqs-ingest run`` process, the SPEC §1 metric names/types/labels, and the health probes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import textwrap
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.harness import (
    Daemon,
    completed_rows,
    daemon_env,
    send_all,
    upsert,
    wait_drained,
)
from tests.servers import free_port, wait_until
from tests.skips import unavailable

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
REPO = Path(__file__).resolve().parents[2]
POISON = ["not json at all {", json.dumps({"request_id": "p-1", "type": "no.such.type",
                                            "payload": {}})]


@pytest.fixture
def daemon(tmp_path: Path, database_url: str, queue_url: str,
           sqs_endpoint: str) -> Iterator[Daemon]:
    # The default pollers: the tests count processed messages exactly, which holds because
    # the tests' moto locks each queue's receive (tests/moto_fifo.py; plain moto_server can
    # hand a message to two concurrent receives: scripts/probes/moto_double_delivery.py).
    d = Daemon(daemon_env(database_url, queue_url, sqs_endpoint), tmp_path)
    try:
        yield d
    finally:
        if d.proc is not None and not d.exited():
            d.proc.kill()
            d.wait(10)


class Prometheus:
    def __init__(self, tmp: Path, target_port: int,
                 extra_jobs: dict[str, int] | None = None) -> None:
        """Scrapes 127.0.0.1:``target_port`` as job sqs-ingest, and each of ``extra_jobs``
        (job name → port) as its own job."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tmp.mkdir(parents=True, exist_ok=True)
        self.config = tmp / "prometheus.yml"
        self.config.write_text(textwrap.dedent(f"""\
            global:
              scrape_interval: 1s
              scrape_timeout: 1s
              evaluation_interval: 1s
            rule_files:
              - {REPO / "deploy/prometheus/alerts.yml"}
            scrape_configs:
              - job_name: sqs-ingest
                static_configs:
                  - targets: ["127.0.0.1:{target_port}"]
            """) + "".join(
                f"  - job_name: {job}\n    static_configs:\n"
                f"      - targets: [\"127.0.0.1:{port}\"]\n"
                for job, port in (extra_jobs or {}).items()))
        self.storage = tmp / "tsdb"
        self.log = tmp / "prometheus.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config}",
                 f"--storage.tsdb.path={self.storage}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self._ready() or self.proc.poll() is not None,
                   60, "prometheus ready")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        q = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{q}", timeout=5) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str, by: str = "") -> dict[str, float]:
        """Instant query through /api/v1/query → {value of label ``by`` (or ''): value}."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return {s["metric"].get(by, ""): float(s["value"][1]) for s in data["result"]}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@contextlib.contextmanager
def prometheus(tmp: Path, target_port: int,
               extra_jobs: dict[str, int] | None = None) -> Iterator[Prometheus]:
    p = Prometheus(tmp, target_port, extra_jobs)
    try:
        p.start()
        yield p
    finally:
        p.stop()


async def test_real_prometheus_scrapes_processed_messages(
    tmp_path: Path, daemon: Daemon, database_url: str, queue_url: str, sqs_client: Any,
) -> None:
    if not os.access(PROMETHEUS, os.X_OK):
        unavailable(f"prometheus binary at {PROMETHEUS}",
                    "apt-get install prometheus; scripts/install.sh does")
    valid = [upsert(f"prom-{i}", f"e{i % 5}", i + 1) for i in range(25)]
    daemon.start().wait_ready()
    send_all(sqs_client, queue_url, valid + POISON)
    wait_drained(sqs_client, queue_url, [daemon])
    # Drained means deleted; the counters move right after the delete — wait for them.
    wait_until(lambda: daemon.metric("sqs_ingest_messages_processed_total") == 27, 90,
               "daemon counted 27 processed messages")
    assert await completed_rows(database_url) == 25

    with prometheus(tmp_path / "prom", daemon.port) as prom:
        def scraped() -> dict[str, float] | None:
            by_outcome = prom.query(
                # > 0: every outcome's series exists from startup, at 0 (metrics.prime)
                "sum by (outcome) (sqs_ingest_messages_processed_total{job='sqs-ingest'}) > 0",
                "outcome")
            return by_outcome if sum(by_outcome.values()) == 27 else None

        by_outcome = wait_until(scraped, 60, "Prometheus to report 27 processed", interval=0.5)
        assert by_outcome == {"completed": 25.0, "dead_lettered": 2.0}, by_outcome
        total = prom.query("sum(sqs_ingest_messages_processed_total)")
        assert total == {"": 27.0}
        assert prom.query("sum(sqs_ingest_messages_received_total)") == {"": 27.0}
        assert prom.query("up{job='sqs-ingest'}", "job") == {"sqs-ingest": 1.0}
        print(f"prometheus query result: by outcome {by_outcome}, total {total}")

        # The shipped alert rules load and evaluate against the real series.
        def evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            return rules if rules and all(r["health"] != "unknown" for r in rules) else None

        rules = wait_until(evaluated, 30, "alert rules evaluated", interval=0.5)
        broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not broken, broken
    assert daemon.stop() == 0


SPEC_METRICS: dict[str, tuple[str, set[str]]] = {
    # family name (as the parser reports it) → (type, label names of its samples)
    "sqs_ingest_messages_received": ("counter", set()),
    "sqs_ingest_messages_processed": ("counter", {"type", "outcome"}),
    "sqs_ingest_ack_failures": ("counter", set()),
    "sqs_ingest_orphans_collected": ("counter", set()),
    "sqs_ingest_batch_duration_seconds": ("histogram", set()),
    "sqs_ingest_message_lag_seconds": ("histogram", set()),
    "sqs_ingest_in_flight_messages": ("gauge", set()),
    "sqs_ingest_queue_visible_messages": ("gauge", set()),
    "sqs_ingest_queue_oldest_message_age_seconds": ("gauge", set()),
}


async def test_metrics_exposition_matches_spec(
    daemon: Daemon, queue_url: str, sqs_client: Any,
) -> None:
    daemon.start().wait_ready()
    send_all(sqs_client, queue_url, [upsert(f"m-{i}", "e1", i + 1) for i in range(5)] + POISON)
    wait_drained(sqs_client, queue_url, [daemon])
    wait_until(lambda: daemon.metric("sqs_ingest_messages_processed_total") == 7, 90,
               "7 processed")
    status, text = daemon.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}

    for name, (kind, labels) in SPEC_METRICS.items():
        assert name in families, f"{name} missing from /metrics"
        fam = families[name]
        assert fam.type == kind, f"{name}: type {fam.type}, SPEC says {kind}"
        assert fam.samples, f"{name} has no samples"
        for s in fam.samples:
            own = set(s.labels) - {"le"}
            assert own == labels, f"{name}: labels {own}, SPEC says {labels}"
        suffixes = {s.name[len(name):] for s in fam.samples}
        if kind == "counter":
            assert "_total" in suffixes, f"{name}: no {name}_total sample"
        if kind == "histogram":
            assert {"_bucket", "_sum", "_count"} <= suffixes, f"{name}: {suffixes}"
            assert any(s.labels.get("le") == "+Inf" for s in fam.samples)

    def value(name: str, **labels: str) -> float:
        return sum(s.value for s in families[name].samples
                   if s.name.endswith(("_total", "_count")) or families[name].type == "gauge"
                   if all(s.labels.get(k) == v for k, v in labels.items()))

    processed = "sqs_ingest_messages_processed"
    assert value(processed, type="entity.upsert", outcome="completed") == 5
    assert value(processed, outcome="dead_lettered") == 2
    assert value("sqs_ingest_messages_received") == 7
    assert value("sqs_ingest_ack_failures") == 0
    assert value("sqs_ingest_message_lag_seconds") == 5  # one observation per completed request
    # One observation per received batch: the 7 messages came in 1 to 7 of them.
    assert 1 <= value("sqs_ingest_batch_duration_seconds") <= 7
    assert value("sqs_ingest_in_flight_messages") == 0
    # Probes: up and ready while running.
    assert daemon.get("/healthz")[0] == 200
    assert daemon.get("/readyz")[0] == 200
    assert daemon.stop() == 0


SLOW_HANDLER = '''
"""Test handler: blocks until the test creates the release file."""
import asyncio
import os
import pathlib

from pydantic import BaseModel

from service.handlers import handler

GATE = pathlib.Path(os.environ["TEST_GATE_DIR"])


class Slow(BaseModel):
    n: int


@handler("test.slow", Slow)
async def slow(payload, conn):
    (GATE / "started").touch()
    while not (GATE / "release").exists():
        await asyncio.sleep(0.05)
    return {"n": payload.n}
'''


async def test_readyz_503_while_draining_then_exit_0(
    tmp_path: Path, database_url: str, queue_url: str, sqs_endpoint: str, sqs_client: Any,
) -> None:
    """SIGTERM while a handler runs: /readyz turns 503 (draining), /healthz stays 200, the
    in-flight message still completes, and the process exits 0."""
    mod_dir, gate = tmp_path / "mods", tmp_path / "gate"
    mod_dir.mkdir()
    gate.mkdir()
    (mod_dir / "slow_test_handler.py").write_text(SLOW_HANDLER)
    env = daemon_env(database_url, queue_url, sqs_endpoint,
                     INGEST_HANDLERS="slow_test_handler", TEST_GATE_DIR=str(gate),
                     PYTHONPATH=os.pathsep.join([str(mod_dir), str(REPO)]))
    d = Daemon(env, tmp_path)
    try:
        d.start().wait_ready()
        send_all(sqs_client, queue_url, [json.dumps(
            {"request_id": "slow-1", "type": "test.slow", "payload": {"n": 1}})])
        wait_until(lambda: (gate / "started").exists() or d.exited(), 30, "handler started")
        assert not d.exited(), d.logs()
        d.signal(signal.SIGTERM)

        def draining() -> bool:
            status, body = d.get("/readyz")
            return status == 503 and json.loads(body).get("draining") is True

        wait_until(draining, 30, "/readyz 503 draining")
        assert d.get("/healthz")[0] == 200
        assert not d.exited()
        (gate / "release").touch()
        assert d.wait(30) == 0, d.logs()
    finally:
        (gate / "release").touch()
        if d.proc is not None and not d.exited():
            d.proc.kill()
            d.wait(10)
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT status, result FROM modifications WHERE request_id = 'slow-1'")
    finally:
        await conn.close()
    assert row is not None and row["status"] == "COMPLETED"

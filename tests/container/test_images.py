"""The images ``make image`` builds, run the way deploy/ runs them: host network, read-only
root filesystem with a /tmp tmpfs, every capability dropped, as uid 10001.

Against the session's real PostgreSQL and moto server on loopback: migrate as the one-shot
step, messages land exactly once, the image's HEALTHCHECK turns healthy, ``docker stop``
(SIGTERM, deploy/k8s's grace period) drains and exits 0, kill -9 then a restart heals
through orphan GC, and the reconcile image finds a planted discrepancy.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
import yaml

from tests.acceptance.harness import (
    CHAOS_HANDLERS,
    Workload,
    check_invariants,
    create_ledger,
    daemon_env,
    queue_depth,
    send_all,
)
from tests.conftest import fresh_database
from tests.container.conftest import DAEMON_IMAGE, RECONCILE_IMAGE, ROOT, Container, docker
from tests.servers import Postgres, free_port, wait_until

pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

#: The pod's grace period in deploy/k8s: what `docker stop -t` gives the daemon here.
GRACE = int(yaml.safe_load((ROOT / "deploy/k8s/deployment.yaml").read_text())
            ["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
SLOW = "chaos.slow"


class SlowWorkload(Workload):
    """The harness workload plus ``chaos.slow`` requests, which keep a batch in flight
    long enough to stop or kill the container under it."""

    def slow(self, n: int, seconds: float, prefix: str) -> list[str]:
        out = []
        for i in range(n):
            rid = f"{prefix}-{i}"
            self.valid[rid] = (SLOW, "", 0)
            out.append(json.dumps({"request_id": rid, "type": SLOW,
                                   "payload": {"seconds": seconds}}))
        return out

    def expected_entities(self) -> dict[str, tuple[int, bool]]:
        entity_valid = {r: v for r, v in self.valid.items() if v[0] != SLOW}
        saved, self.valid = self.valid, entity_valid
        try:
            return super().expected_entities()
        finally:
            self.valid = saved


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    """Rows of one statement on its own connection (also for DDL: no rows)."""
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


def daemon(dsn: str, queue_url: str, endpoint: str, port: int, chaos_dir: Path) -> Container:
    """The daemon image with the chaos handlers mounted read-only from the checkout."""
    env = daemon_env(dsn, queue_url, endpoint, INGEST_HTTP_PORT=str(port),
                     INGEST_HTTP_HOST="127.0.0.1", INGEST_HANDLERS=CHAOS_HANDLERS,
                     PYTHONPATH="/ext", CHAOS_DIR="/chaos", INGEST_LOG_FORMAT="json")
    chaos_dir.chmod(0o777)  # the container's uid 10001 appends the invocation log
    return Container(DAEMON_IMAGE, env, mounts=[(ROOT / "tests", "/ext/tests", "ro"),
                                                (chaos_dir, "/chaos", "rw")],
                     # The image's own HEALTHCHECK command, probed every second here.
                     extra=["--health-interval", "1s"])


def slow_started(chaos_dir: Path, prefix: str) -> bool:
    log = chaos_dir / "invocations.log"
    return log.exists() and any(line.startswith(prefix) for line in log.read_text().split())


async def create_handler_tables(dsn: str) -> None:
    """The tables the chaos handlers write: the ledger, and chaos.slow's effect rows (no
    unique key, so an effect applied twice shows as two rows)."""
    await create_ledger(dsn)
    await fetch(dsn, "CREATE TABLE chaos_effects (id bigserial PRIMARY KEY, request_id text)")


@pytest.fixture
async def empty_database(pg_server: Postgres) -> str:
    name = "c_" + uuid.uuid4().hex[:12]
    await fetch(pg_server.dsn(), f"CREATE DATABASE {name}")
    return pg_server.dsn(name)


async def test_daemon_image_migrates_lands_turns_healthy_and_stops_clean(
    images: dict[str, float], empty_database: str, sqs_client: Any, sqs_endpoint: str,
    containers: list[Container], tmp_path: Path,
) -> None:
    dsn = empty_database
    migrate = Container(DAEMON_IMAGE, {"INGEST_DATABASE_URL": dsn}, ["migrate"])
    containers.append(migrate)
    assert migrate.run().wait(120) == 0, migrate.logs()
    assert "applied" in migrate.logs()
    assert await fetch(dsn, "SELECT 1 FROM modifications LIMIT 1") == []
    await create_handler_tables(dsn)

    queue_url = sqs_client.create_queue(QueueName="c-" + uuid.uuid4().hex[:10],
                                        Attributes={"VisibilityTimeout": "30"})["QueueUrl"]
    w = SlowWorkload(seed=13)
    send_all(sqs_client, queue_url, w.bodies(300, prefix="c"))
    port, chaos_dir = free_port(), tmp_path / "chaos"
    chaos_dir.mkdir()
    d = daemon(dsn, queue_url, sqs_endpoint, port, chaos_dir)
    containers.append(d)

    started = time.monotonic()
    d.run()
    wait_until(lambda: http_status(port, "/readyz") == 200 or not d.running(), 60, "/readyz 200")
    assert d.running(), d.logs()
    ready_after = time.monotonic() - started
    print(f"container start -> /readyz 200: {ready_after:.2f} s")
    assert ready_after < 15, "README promises a start in seconds; see 'Container figures'"
    wait_until(lambda: d.state()["Health"]["Status"] == "healthy", 60, "HEALTHCHECK healthy")
    assert d.state()["Health"]["Status"] == "healthy"

    # A slow batch in flight when the orchestrator sends SIGTERM: it must finish (or be
    # handed back), the process exit 0 within the grace period, nothing left IN_PROGRESS.
    send_all(sqs_client, queue_url, w.slow(3, seconds=3, prefix="slow"))
    wait_until(lambda: slow_started(chaos_dir, "slow-"), 60, "a slow batch in flight")
    stop_started = time.monotonic()
    assert d.stop(GRACE) == 0, d.logs()
    assert time.monotonic() - stop_started < GRACE, "drain ran into SIGKILL"
    assert await fetch(dsn, "SELECT request_id FROM modifications"
                            " WHERE status = 'IN_PROGRESS'") == []

    d.start()  # whatever the drain handed back lands now, once
    wait_until(lambda: http_status(port, "/readyz") == 200, 60, "/readyz 200 after restart")
    await wait_all_completed(dsn, w)
    # Copies the killed or stopped incarnation held come back after their visibility and
    # resolve as duplicates: wait for the queue itself to be empty.
    wait_until(lambda: queue_depth(sqs_client, queue_url) == 0, 60, "queue drained")
    await check_invariants(dsn, w, sqs_client, queue_url)
    await check_slow_effects_once(dsn, w)
    assert d.stop(GRACE) == 0, d.logs()


async def test_daemon_image_heals_after_kill_9(
    images: dict[str, float], database_url: str, sqs_client: Any, sqs_endpoint: str,
    containers: list[Container], tmp_path: Path,
) -> None:
    await create_handler_tables(database_url)
    queue_url = sqs_client.create_queue(QueueName="k-" + uuid.uuid4().hex[:10],
                                        Attributes={"VisibilityTimeout": "4"})["QueueUrl"]
    w = SlowWorkload(seed=17)
    send_all(sqs_client, queue_url, w.slow(3, seconds=4, prefix="k9") + w.bodies(60, prefix="k"))
    port, chaos_dir = free_port(), tmp_path / "chaos"
    chaos_dir.mkdir()
    d = daemon(database_url, queue_url, sqs_endpoint, port, chaos_dir)
    containers.append(d)
    d.run()

    async def claimed() -> bool:
        return bool(await fetch(database_url, "SELECT 1 FROM modifications"
                                " WHERE status = 'IN_PROGRESS' AND request_id LIKE 'k9-%'"))

    deadline = time.monotonic() + 60
    while not await claimed():
        assert time.monotonic() < deadline and d.running(), d.logs()
        time.sleep(0.05)
    d.kill9()
    assert d.state()["ExitCode"] == 137
    assert await claimed(), "the kill must leave an orphaned claim behind"

    d.start()  # same worker name (host network: the host's name): GC at start-up
    exits: list[int] = []

    def restart_on_exit_3() -> None:
        """What ECS and Kubernetes do with an exit 3 (an ack SQS refused): start it again.
        moto can hand one message to two concurrent receives (README known issues); the
        copy acked first makes the other's DeleteMessage ReceiptHandleIsInvalid, exit 3 by
        design. Any other exit, or a fourth, fails the test."""
        if not d.running():
            code = int(d.state()["ExitCode"])
            assert code == 3 and len(exits) < 3, (code, exits, d.logs())
            exits.append(code)
            d.start()

    await wait_all_completed(database_url, w, timeout=120, tick=restart_on_exit_3)
    # Copies the killed or stopped incarnation held come back after their visibility and
    # resolve as duplicates: wait for the queue itself to be empty.
    def drained() -> bool:
        restart_on_exit_3()
        return queue_depth(sqs_client, queue_url) == 0

    wait_until(drained, 60, "queue drained")
    await check_invariants(database_url, w, sqs_client, queue_url)
    await check_slow_effects_once(database_url, w)
    assert metric(port, "sqs_ingest_orphans_collected_total") >= 1
    assert d.stop(GRACE) == 0, d.logs()


async def wait_all_completed(dsn: str, w: Workload, timeout: float = 90,
                             tick: Callable[[], None] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        rows = await fetch(dsn, "SELECT count(*) AS n FROM modifications"
                                " WHERE status = 'COMPLETED'")
        if rows[0]["n"] >= len(w.valid):
            return
        assert time.monotonic() < deadline, f"{rows[0]['n']} of {len(w.valid)} completed"
        if tick is not None:
            tick()
        time.sleep(0.2)


async def check_slow_effects_once(dsn: str, w: SlowWorkload) -> None:
    slow = sorted(r for r, v in w.valid.items() if v[0] == SLOW)
    rows = await fetch(dsn, "SELECT request_id FROM chaos_effects ORDER BY request_id")
    assert [r["request_id"] for r in rows if r["request_id"] in slow] == slow


def test_daemon_image_without_configuration_exits_2(
    images: dict[str, float], containers: list[Container]
) -> None:
    c = Container(DAEMON_IMAGE, {})
    containers.append(c)
    assert c.run().wait(60) == 2
    assert "INGEST_QUEUE_URL" in c.logs()
    assert docker("run", "--rm", "--entrypoint", "id", DAEMON_IMAGE, "-u").strip() == "10001"


async def test_reconcile_image_finds_the_planted_discrepancy(
    images: dict[str, float], database_url: str, pg_server: Postgres,
    containers: list[Container],
) -> None:
    from tests.reconcile.test_job import RUN_DATE, seed

    async with fresh_database(pg_server) as peer:
        await seed(database_url)
        await seed(peer)
        await fetch(peer, "DELETE FROM modifications WHERE request_id = 'inv-3'")
        c = Container(RECONCILE_IMAGE, {"INGEST_DATABASE_URL": database_url},
                      # Two JDBC partitions: the test data is a few rows, the machine 2 cores.
                      ["reconcile", "--date", RUN_DATE, "--peer-url", peer, "--partitions", "2",
                       "--retention-days", "0"])
        containers.append(c)
        started = time.monotonic()
        code = c.run().wait(600)
        print(f"reconcile container run: {time.monotonic() - started:.1f} s")
        out = c.logs()
        assert code == 1, out
        summary = next(json.loads(line) for line in reversed(out.splitlines())
                       if line.startswith("{") and '"counts"' in line)
        assert summary["status"] == "discrepancies"
        assert {k: v for k, v in summary["counts"].items() if v} == {"missing_in_peer": 1}
        rows = await fetch(database_url, "SELECT kind, request_id FROM"
                                         " reconciliation_discrepancies")
        assert [(r["kind"], r["request_id"]) for r in rows] == [("missing_in_peer", "inv-3")]


def test_image_sizes(images: dict[str, float]) -> None:
    """The figures in README 'Container figures': what the Dockerfile adds over its base."""

    def size(image: str) -> int:
        return int(docker("image", "inspect", "--format", "{{.Size}}", image))

    base = subprocess.run([str(ROOT / "scripts" / "image.sh"), "base"], capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()
    added = size(DAEMON_IMAGE) - size(base)
    layers = docker("history", "--format", "{{.Size}}\t{{.CreatedBy}}", RECONCILE_IMAGE)
    print(f"daemon adds {added / 1e6:.0f} MB over {base} ({size(base) / 1e6:.0f} MB); "
          f"reconcile {size(RECONCILE_IMAGE) / 1e6:.0f} MB; build {images['build_seconds']:.0f} s"
          f"\n{layers}")
    assert added <= 120e6, f"the daemon image adds {added / 1e6:.0f} MB over its base"


def test_images_record_the_lock_they_were_built_from(images: dict[str, float]) -> None:
    """Both images carry the sha256 of the lock files their venvs were installed from."""
    import hashlib

    lock = hashlib.sha256(b"".join((ROOT / "requirements" / name).read_bytes()
                                   for name in ("runtime.txt", "otel.txt", "reconcile.txt")))
    for image in (DAEMON_IMAGE, RECONCILE_IMAGE):
        label = docker("image", "inspect", "--format",
                       '{{index .Config.Labels "io.sqs-ingest.lock-sha256"}}', image).strip()
        assert label == lock.hexdigest(), image

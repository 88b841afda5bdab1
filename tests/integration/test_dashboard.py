"""The Grafana dashboard (deploy/grafana/sqs-ingest.json) proven against real data.

A real ``sqs-ingest run`` process works through a workload with every outcome (completed,
duplicate, dead_lettered, retried); a real Prometheus scrapes it, and the reconcile metrics
(the sidecar's own ``RunMetrics`` registry after a clean run) as their own job. Then every
query of every panel is evaluated through Prometheus's HTTP API: it must parse, it must name
only metrics and labels that Prometheus really scraped, and — unless it is on the short
list of series this workload cannot produce — it must return data. The panels are drawn to
a PNG from the same queries (``DASHBOARD_PNG=docs/img/dashboard.png`` keeps it).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.acceptance.harness import Daemon, daemon_env, send_all, upsert, wait_drained
from tests.integration.dashboard_png import render
from tests.integration.test_prometheus import PROMETHEUS, REPO, Prometheus, prometheus
from tests.servers import free_port, wait_until
from tests.skips import unavailable

DASHBOARD = REPO / "deploy/grafana/sqs-ingest.json"

# Series this workload cannot produce, each with the reason. A query naming one may return
# nothing; every other query must return data.
# (None since issue 24: every labelled series exists at 0 from start-up, metrics.prime, so
# sqs_errors_total and results_published_total answer 0 where nothing failed or went out.)
MAY_BE_EMPTY: dict[str, str] = {}
FLAKY_HANDLER = '''
"""Test handler: fails the first attempt of each request, succeeds on the retry."""
import os
import pathlib

from pydantic import BaseModel

from service.handlers import current_request_id, handler

SEEN = pathlib.Path(os.environ["TEST_FLAKY_DIR"])


class Flaky(BaseModel):
    n: int


@handler("test.flaky", Flaky)
async def flaky(payload, conn):
    marker = SEEN / current_request_id()
    if not marker.exists():
        marker.touch()
        raise RuntimeError("first attempt fails on purpose")
    return {"n": payload.n}
'''

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
            "unless", "offset", "inf", "nan"}


def substitute(expr: str, rate_interval: str, range_: str) -> str:
    """Grafana's template variables as a user with 'All' selected would send them."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
            .replace("$job", ".*").replace("$instance", ".*"))


def names_in(expr: str) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """(metric names, label names in grouping clauses, labels matched per metric) of a
    PromQL expression; enough PromQL for the dashboard's own queries."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\[[^\]]*\]", "", e)
    matched: dict[str, set[str]] = {}
    for name, body in re.findall(r"([A-Za-z_:][\w:]*)?\s*\{([^}]*)\}", e):
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", body))
        matched.setdefault(name, set()).update(labels)
    grouping: set[str] = set()
    for _, body in re.findall(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)",
                              e):
        grouping.update(x.strip() for x in body.split(",") if x.strip())
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    metrics = {t for t in re.findall(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()", e)
               if t.lower() not in KEYWORDS}
    matched.pop("", None)
    return metrics, grouping, matched


def test_names_in_reads_metrics_and_labels() -> None:
    metrics, grouping, matched = names_in(
        'histogram_quantile(0.99, sum by (le, job) (rate(a_bucket{job=~"x{1}", le!="1"}[5m])))'
        ' > bool max(b_total) and on (instance) c')
    assert metrics == {"a_bucket", "b_total", "c"}
    assert grouping == {"le", "job", "instance"}
    assert matched == {"a_bucket": {"job", "le"}}


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard["panels"] if p["type"] != "row"
            for t in p["targets"]]


class Api:
    def __init__(self, prom: Prometheus) -> None:
        self.prom = prom

    def query(self, expr: str, **extra: str) -> tuple[str | None, Any]:
        """(error, data) — the error Prometheus reports for a query that does not parse."""
        path = "query_range" if "step" in extra else "query"
        url = f"{self.prom.url}/api/v1/{path}?" + urllib.parse.urlencode({"query": expr, **extra})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as e:
            doc = json.loads(e.read())
        if doc["status"] != "success":
            return f"{doc.get('errorType')}: {doc.get('error')}", None
        return None, doc["data"]


def declared_labels() -> dict[str, set[str]]:
    """Label names the daemon declares per sample name, for families that have no series
    in this run (a labelled counter with no child yet)."""
    from prometheus_client.metrics import MetricWrapperBase

    import service.observe.metrics as metrics

    out: dict[str, set[str]] = {}
    for obj in vars(metrics).values():
        if isinstance(obj, MetricWrapperBase):
            suffix = "_total" if obj._type == "counter" else ""
            out[obj._name + suffix] = set(obj._labelnames)
    return out


def reconcile_registry() -> Any:
    try:
        from service.reconcile.metrics import RunMetrics
    except ImportError:
        from service.reconcile.cli import RunMetrics  # type: ignore[attr-defined]  # older layout
    run = RunMetrics()
    # What the sidecar holds after a clean night: observe() reads counts and modifications.
    result = SimpleNamespace(counts={}, modifications={"primary": 90, "peer": 90})
    run.observe("clean", 12.5, result)  # type: ignore[arg-type]  # the fields observe() reads
    return run.registry


@pytest.mark.timeout(240)
def test_every_panel_query_returns_real_data(
    tmp_path: Path, database_url: str, queue_url: str, sqs_endpoint: str, sqs_client: Any,
) -> None:
    from prometheus_client import start_http_server

    if not os.access(PROMETHEUS, os.X_OK):
        unavailable(f"prometheus binary at {PROMETHEUS}",
                    "apt-get install prometheus; scripts/install.sh does")
    dashboard = json.loads(DASHBOARD.read_text())
    mods, flaky_dir = tmp_path / "mods", tmp_path / "flaky"
    mods.mkdir()
    flaky_dir.mkdir()
    (mods / "dashboard_flaky_handler.py").write_text(FLAKY_HANDLER)
    # The default pollers, counted exactly: the tests' moto guards each queue's receive
    # with a lock (tests/moto_fifo.py; plain moto_server could hand one message to two
    # concurrent receives and this test failed 12 vs 11 that way).
    env = daemon_env(database_url, queue_url, sqs_endpoint,
                     INGEST_HANDLERS="dashboard_flaky_handler", TEST_FLAKY_DIR=str(flaky_dir),
                     PYTHONPATH=os.pathsep.join([str(mods), str(REPO)]))
    daemon = Daemon(env, tmp_path)
    reconcile_port = free_port()
    server, thread = start_http_server(reconcile_port, addr="127.0.0.1",
                                       registry=reconcile_registry())
    try:
        daemon.start().wait_ready()
        with prometheus(tmp_path / "prom", daemon.port,
                        {"sqs-ingest-reconcile": reconcile_port}) as prom:
            api = Api(prom)

            def scrapes() -> float:
                got = prom.query('count_over_time(up{job="sqs-ingest"}[10m])')
                return sum(got.values())

            def wait_scrapes(n: int) -> None:
                """Let Prometheus take n more scrapes, so rates have points on both sides."""
                target = scrapes() + n
                wait_until(lambda: scrapes() >= target, 30 + 2 * n, f"{n} more scrapes",
                           interval=0.5)

            started = time.time()
            wait_scrapes(5)  # the graphs start with an idle daemon
            # A freshly started daemon that has seen no message: every panel already finds
            # its series (metrics.prime), so no panel is empty after a restart (issue 24).
            empty = [f"{title}: {expr}" for title, raw in panel_queries(dashboard)
                     for expr in [substitute(raw, "1m", "10m")]
                     for error, data in [api.query(expr)] if error or not data["result"]]
            assert not empty, "empty on a fresh daemon:\n" + "\n".join(empty)
            def flaky(rid: str) -> str:
                return json.dumps({"request_id": rid, "type": "test.flaky", "payload": {"n": 1}})

            def poison(i: int) -> list[str]:
                return [f"not json {i} {{", json.dumps(
                    {"request_id": f"p-{i}", "type": "no.such.type", "payload": {}})]

            def wave(bodies: list[str], idle_scrapes: int = 6) -> None:
                send_all(sqs_client, queue_url, bodies)
                wait_drained(sqs_client, queue_url, [daemon])
                wait_scrapes(idle_scrapes)

            # Warm-up, one of each outcome: Prometheus's increase()/rate() cannot see the
            # first increment of a series born during the window, so every labelled series
            # exists before the waves that draw the graphs.
            wave([upsert("w-0", "w", 1), flaky("f-w"), *poison(0)], 2)
            wave([upsert("w-0", "w", 1), upsert("w-0", "w", 2, note="reused")])
            wave1 = [upsert(f"d-{i}", f"e{i % 7}", i + 1) for i in range(40)]
            sns = json.dumps({"Type": "Notification", "MessageId": "sns-1",
                              "TopicArn": "arn:aws:sns:us-east-1:1:t",
                              "Message": upsert("d-sns", "e-sns", 1)})
            wave([*wave1, sns, *(flaky(f"f-{i}") for i in range(3)), *poison(1)], 8)
            # Redeliveries of completed requests (duplicate), a reused key, new work.
            reused = upsert("d-0", "e0", 10**6, note="same key, other payload")
            wave2 = [upsert(f"d2-{i}", f"e{i % 7}", 100 + i) for i in range(30)]
            wave([*wave1[:10], reused, *wave2, *poison(2)], 0)

            expected = {"completed": 1 + 1 + 40 + 1 + 3 + 30, "duplicate": 1 + 10,
                        "dead_lettered": 2 + 1 + 2 + 1 + 2, "retried": 1 + 3}

            seen: dict[str, float] = {}

            def outcomes() -> bool:
                seen.update(prom.query("sum by (outcome) (sqs_ingest_messages_processed_total)",
                                       "outcome"))
                return seen == expected

            try:
                wait_until(outcomes, 60, "Prometheus to scrape every outcome", interval=0.5)
            except TimeoutError:
                pytest.fail(f"outcomes {seen}, expected {expected}\n{daemon.logs()}")
            wait_scrapes(8)
            wait_until(lambda: prom.query("sqs_ingest_reconcile_last_success_timestamp_seconds"),
                       30, "reconcile metrics scraped", interval=0.5)

            scraped = set(prom.api("label/__name__/values"))
            metadata = set(prom.api("metadata"))
            declared = declared_labels()
            failures: list[str] = []

            def labels_of(metric: str) -> set[str]:
                series = prom.api("series", **{"match[]": metric})
                found = {k for s in series for k in s} - {"__name__"}
                return found or declared.get(metric, set()) | {"job", "instance"}

            checked = 0
            for title, raw in panel_queries(dashboard):
                expr = substitute(raw, "1m", "10m")
                metrics, grouping, matched = names_in(expr)
                unknown = {n for n in metrics
                           if n not in scraped and n not in metadata}
                if unknown:
                    failures.append(f"{title}: {expr}\n    names no scraped metric: {unknown}")
                    continue
                known = {n: labels_of(n) for n in metrics if n in scraped or n in metadata}
                for name, labels in matched.items():
                    if name in known and not labels <= known[name]:
                        failures.append(f"{title}: {name} has no label {labels - known[name]}")
                everywhere = set().union(*known.values()) if known else set()
                if known and not grouping <= everywhere:
                    failures.append(f"{title}: no series carries {grouping - everywhere}: {expr}")
                error, data = api.query(expr)
                if error:
                    failures.append(f"{title}: does not parse/evaluate: {error}\n    {expr}")
                elif not data["result"] and not metrics & set(MAY_BE_EMPTY):
                    failures.append(f"{title}: returned no data\n    {expr}")
                checked += 1
            # The template variables' own queries.
            for var in dashboard["templating"]["list"]:
                lv = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", str(var.get("definition")))
                if lv:
                    selector = substitute(lv.group(1), "1m", "10m")
                    got = prom.query(f"group by ({lv.group(2)}) ({selector})", lv.group(2))
                    if not any(got):
                        failures.append(f"variable {var['name']}: no values from {selector}")
            assert not failures, "\n".join(failures)
            assert checked == len(panel_queries(dashboard)) >= 25

            def series(raw: str) -> list[tuple[dict[str, str], list[float], list[float]]]:
                now = time.time()
                _, data = api.query(substitute(raw, "10s", "10m"), start=str(started),
                                    end=str(now), step="1")
                return [(s["metric"], [float(t) - started for t, _ in s["values"]],
                         [float(v) for _, v in s["values"]]) for s in data["result"]]

            def instant(raw: str) -> list[dict[str, Any]]:
                _, data = api.query(substitute(raw, "1m", f"{int(time.time() - started) + 5}s"))
                return list(data["result"])

            png = Path(os.environ.get("DASHBOARD_PNG") or tmp_path / "dashboard.png")
            render(dashboard, instant, series, png,
                   f"— test run: {sum(expected.values())} outcomes, real daemon + Prometheus")
            assert png.stat().st_size > 20_000
            print(f"dashboard: {checked} queries evaluated; picture {png}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        if daemon.proc is not None and not daemon.exited():
            daemon.stop()

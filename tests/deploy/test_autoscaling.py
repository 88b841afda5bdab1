"""Autoscaling on the backlog (issue 24), checked offline: the KEDA overlay, the HPA alternative
and the ECS target-tracking policy render/validate, their numbers are derived from the inputs in
deploy/autoscaling.json (docs/operations/sizing.md), the replicas' connections fit PostgreSQL's
max_connections, and scale-in drains (SIGKILL comes after the drain)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.observe import metrics
from service.settings import ENV_PREFIX, load_settings
from tests.deploy.test_static import (
    DEPLOY,
    ECS,
    K8S_VERSIONS,
    LONG_POLL_SECONDS,
    _k8s_validate,
    _run,
    _tool,
    _validate_botocore,
)

SIZING = json.loads((DEPLOY / "autoscaling.json").read_text())
QUEUE_LENGTH = SIZING["per_replica_msgs_per_second"] * SIZING["target_backlog_seconds"]
BUDGET = SIZING["postgres_max_connections"] - SIZING["reserved_connections"]


def settings_from(env: dict[str, str]) -> Any:
    """The daemon's settings for a manifest's INGEST_* environment (URLs as placeholders)."""
    fields = {k[len(ENV_PREFIX):].lower(): v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    fields |= {"queue_url": "https://sqs.us-east-1.amazonaws.com/1/q",
               "database_url": "postgresql://u@h/db?sslmode=verify-full"}
    return load_settings(**fields)


def render(overlay: str) -> list[dict[str, Any]]:
    if shutil.which("kustomize"):
        cmd = [shutil.which("kustomize") or "", "build", str(DEPLOY / overlay)]
    else:
        cmd = [_tool("kubectl", "install kubectl (kustomize built in) or kustomize"),
               "kustomize", str(DEPLOY / overlay)]
    return [d for d in yaml.safe_load_all(_run(cmd)) if d]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found


def check_deployment(objs: list[dict[str, Any]], max_replicas: int) -> None:
    """Shared by both overlays: the budget, no fixed replica count, a draining scale-in."""
    dep, config = one(objs, "Deployment"), one(objs, "ConfigMap")["data"]
    s = settings_from(config)
    assert max_replicas * s.db_connections <= BUDGET, (
        f"{max_replicas} replicas x {s.db_connections} connections > max_connections "
        f"{SIZING['postgres_max_connections']} - {SIZING['reserved_connections']} reserved")
    assert max_replicas >= 2
    assert "replicas" not in dep["spec"], "a fixed replica count fights the autoscaler"
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > s.shutdown_timeout + LONG_POLL_SECONDS, "scale-in would SIGKILL a drain"


def test_keda_overlay_scales_on_the_queue_within_the_connection_budget() -> None:
    objs = render("k8s-keda")
    so = one(objs, "ScaledObject")
    spec = so["spec"]
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "aws-sqs-queue"
    assert int(trigger["metadata"]["queueLength"]) == QUEUE_LENGTH
    assert trigger["metadata"]["queueURL"] == one(objs, "ConfigMap")["data"]["INGEST_QUEUE_URL"]
    auth = one(objs, "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert auth["spec"]["podIdentity"]["provider"] == "aws"  # no access keys in the cluster
    assert spec["scaleTargetRef"]["name"] == one(objs, "Deployment")["metadata"]["name"]
    assert spec["minReplicaCount"] >= 1  # zero is a choice (docs/operations/sizing.md), not the default
    check_deployment(objs, spec["maxReplicaCount"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_hpa_alternative_on_the_daemons_queue_metric(version: str) -> None:
    objs = render("k8s-hpa")
    hpa = one(objs, "HorizontalPodAutoscaler")
    _k8s_validate(hpa, version)
    (m,) = hpa["spec"]["metrics"]
    assert m["type"] == "External" and m["external"]["target"]["type"] == "AverageValue"
    assert int(m["external"]["target"]["averageValue"]) == QUEUE_LENGTH
    # The adapter rule serves that metric from series the daemon really exports.
    rules = yaml.safe_load((DEPLOY / "k8s-hpa/prometheus-adapter-rules.yaml").read_text())
    (rule,) = rules["rules"]["external"]
    assert rule["name"]["as"] == m["external"]["metric"]["name"]
    exported = {metrics.queue_visible._name, metrics.queue_not_visible._name}
    assert all(name in rule["metricsQuery"] for name in exported), exported
    assert rule["seriesQuery"].split("{")[0] in exported
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(objs, "Deployment")["metadata"]["name"]
    check_deployment(objs, hpa["spec"]["maxReplicas"])


def test_ecs_target_tracking_on_backlog_per_task() -> None:
    target = json.loads((ECS / "autoscaling-target.json").read_text())
    policy = json.loads((ECS / "autoscaling-policy.json").read_text())
    _validate_botocore(target, "application-autoscaling", "RegisterScalableTarget")
    _validate_botocore(policy, "application-autoscaling", "PutScalingPolicy")
    assert policy["ResourceId"] == target["ResourceId"]
    _, cluster, service = target["ResourceId"].split("/")
    tt = policy["TargetTrackingScalingPolicyConfiguration"]
    assert tt["TargetValue"] == QUEUE_LENGTH
    queries = {q["Id"]: q for q in tt["CustomizedMetricSpecification"]["Metrics"]}
    (out,) = [q for q in queries.values() if q.get("ReturnData")]
    num, den = (x.strip() for x in out["Expression"].split("/"))
    visible, tasks = queries[num]["MetricStat"]["Metric"], queries[den]["MetricStat"]["Metric"]
    td = json.loads((ECS / "task-definition.json").read_text())
    (daemon,) = [c for c in td["containerDefinitions"] if c["command"][0] == "run"]
    env = {e["name"]: e["value"] for e in daemon["environment"]}
    assert visible["MetricName"] == "ApproximateNumberOfMessagesVisible"
    assert visible["Dimensions"] == [{"Name": "QueueName",
                                      "Value": env["INGEST_QUEUE_URL"].rsplit("/", 1)[1]}]
    assert tasks["MetricName"] == "RunningTaskCount"
    assert {d["Name"]: d["Value"] for d in tasks["Dimensions"]} == {
        "ClusterName": cluster, "ServiceName": service}
    s = settings_from(env)
    assert target["MaxCapacity"] * s.db_connections <= BUDGET
    assert target["MinCapacity"] >= 1  # backlog / 0 tasks has no value: no scale-out from 0
    # Scale-in drains: ECS sends SIGKILL stopTimeout after SIGTERM.
    assert daemon["stopTimeout"] > s.shutdown_timeout + LONG_POLL_SECONDS


def test_connections_per_replica_counts_every_pool() -> None:
    """Settings.db_connections is what the budget checks rest on: the batch pool, the control
    pool, and the results publishers' pool when results are on (service.app opens them)."""
    base = settings_from({"INGEST_DB_POOL_SIZE": "10"})
    results = settings_from({"INGEST_DB_POOL_SIZE": "10", "INGEST_RESULTS_PUBLISHERS": "3",
                             "INGEST_RESULTS_QUEUE_URL": "https://sqs.us-east-1.amazonaws.com/1/r"})
    assert base.db_connections == 12 and results.db_connections == 16


def test_sizing_inputs_are_what_the_readme_states() -> None:
    """docs/operations/sizing.md shows the formula with these very inputs and results."""
    page = (Path(__file__).resolve().parents[2] / "docs/operations/sizing.md").read_text()
    sizing = page.split("## Sizing", 1)[1].split("\n## ", 1)[0]
    per_replica = settings_from({}).db_connections
    most = BUDGET // per_replica
    for line in (
        f"R x T             = {SIZING['per_replica_msgs_per_second']:,} msg/s x "
        f"{SIZING['target_backlog_seconds']} s = {QUEUE_LENGTH:,}",
        f"= floor(({SIZING['postgres_max_connections']} - {SIZING['reserved_connections']}) / "
        f"{per_replica}) = {most}",
    ):
        assert line in sizing, line

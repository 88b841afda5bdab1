"""Deploy files a platform engineer can apply: the values set once (deploy/platform/platform.env)
reach every manifest that needs them and stand nowhere else; the HPA's adapter rule selects
labels the shipped ServiceMonitor really puts on the series; KEDA reads the queue with an
identity of its own.

Every kustomization is rendered by kustomize itself (the kustomize binary, or the one built
into kubectl), from a copy of deploy/ whose platform.env holds other values than the shipped
ones: a value a replacement misses shows up as a shipped value (or a placeholder) left in
the output.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_static import DEPLOY, _k8s_validate, _run, _tool, _validate_botocore

PLATFORM_ENV = DEPLOY / "platform" / "platform.env"
#: Every kustomization a platform engineer applies (`kubectl apply -k deploy/<name>`).
KUSTOMIZATIONS = ["k8s", "k8s-keda", "k8s-hpa", "k8s-secret-from-file", "k8s-external-secret"]
#: Other values for every key of platform.env: what a platform engineer would write there.
OTHER = {
    "IMAGE": "images.test.invalid/team/orders-ingest:2.3.4",
    "RECONCILE_IMAGE": "images.test.invalid/team/orders-reconcile:2.3.4",
    "AWS_ACCOUNT_ID": "210987654321",
    "AWS_REGION": "eu-north-1",
    "QUEUE_URL": "https://sqs.eu-north-1.amazonaws.com/210987654321/orders",
    "DATABASE_SECRET": "orders-db",
    "HANDLERS": "orders.handlers",
}


def env_file(path: Path) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    return {k.strip(): v.strip() for k, v in pairs}


def kustomize(path: Path) -> list[dict[str, Any]]:
    found = shutil.which("kustomize")
    cmd = ([found, "build", str(path)] if found else
           [_tool("kubectl", "install kubectl (kustomize built in) or kustomize"),
            "kustomize", str(path)])
    return [d for d in yaml.safe_load_all(_run(cmd)) if d]


@pytest.fixture(scope="module")
def other_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ with OTHER in platform.env, and the gitignored inputs of k8s-secret-from-file."""
    tree = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(DEPLOY, tree)
    (tree / "platform/platform.env").write_text("".join(f"{k}={v}\n" for k, v in OTHER.items()))
    secret_dir = tree / "k8s-secret-from-file"
    shutil.copy(secret_dir / "database.env.example", secret_dir / "database.env")
    (secret_dir / "db-ca.pem").write_text("not a certificate: rendering only\n")
    return tree


def _pod_specs(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for o in objs:
        if o["kind"] in ("Deployment", "Job"):
            out[o["kind"]] = o["spec"]["template"]["spec"]
        elif o["kind"] == "CronJob":
            out[o["kind"]] = o["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return out


def _named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def test_platform_env_names_the_values() -> None:
    assert set(env_file(PLATFORM_ENV)) == set(OTHER), "OTHER must give each key another value"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomization_takes_the_values_from_platform_env(
    other_tree: Path, name: str
) -> None:
    objs = kustomize(other_tree / name)
    text = yaml.safe_dump_all(objs)
    shipped = env_file(PLATFORM_ENV)
    # Neither a shipped value nor a placeholder (the key itself) is left anywhere.
    for key, value in shipped.items():
        assert not re.search(rf"(?<![\w-]){key}(?![\w-])", text), f"placeholder {key} left"
        if value:
            # (sqs-ingest-db-ca, the CA's ConfigMap, is another name.)
            assert not re.search(re.escape(value) + r"(?![\w-])", text), (
                f"shipped {key}={value} left in deploy/{name}")
    assert not [o for o in objs if o["metadata"]["name"] == "sqs-ingest-platform"], (
        "the values' ConfigMap is for kustomize only (local-config), never applied")
    for doc in objs:
        group = doc["apiVersion"].rpartition("/")[0]
        if "." not in group or group.endswith(".k8s.io"):  # not the CRDs (KEDA, ESO)
            _k8s_validate(doc, "latest")

    pods = _pod_specs(objs)
    assert set(pods) == {"Deployment", "Job", "CronJob"}
    images = {kind: {c["image"] for c in spec.get("initContainers", []) + spec["containers"]}
              for kind, spec in pods.items()}
    assert images == {"Deployment": {OTHER["IMAGE"]}, "Job": {OTHER["IMAGE"]},
                      "CronJob": {OTHER["RECONCILE_IMAGE"]}}
    config = _named(objs, "ConfigMap", "sqs-ingest-config")["data"]
    assert {k: config[k] for k in ("INGEST_QUEUE_URL", "INGEST_AWS_REGION",
                                   "INGEST_S3_EXPECTED_OWNER", "INGEST_HANDLERS")} == {
        "INGEST_QUEUE_URL": OTHER["QUEUE_URL"], "INGEST_AWS_REGION": OTHER["AWS_REGION"],
        "INGEST_S3_EXPECTED_OWNER": OTHER["AWS_ACCOUNT_ID"],
        "INGEST_HANDLERS": OTHER["HANDLERS"]}
    daemon_sa = _named(objs, "ServiceAccount", "sqs-ingest")
    assert daemon_sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == (
        f"arn:aws:iam::{OTHER['AWS_ACCOUNT_ID']}:role/sqs-ingest")

    # The Secret every pod mounts is the one DATABASE_SECRET names (generated: with its hash).
    secret = OTHER["DATABASE_SECRET"]
    generated = [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"]
    if generated:
        (secret,) = generated
        assert secret.startswith(OTHER["DATABASE_SECRET"] + "-")
    for kind, spec in pods.items():
        (db,) = [v for v in spec["volumes"] if v["name"] == "db"]
        names = {s["secret"]["name"] for s in db["projected"]["sources"] if "secret" in s}
        assert names == {secret}, kind
    for ext in (o for o in objs if o["kind"] == "ExternalSecret"):
        assert ext["spec"]["target"]["name"] == secret

    for scaled in (o for o in objs if o["kind"] == "ScaledObject"):
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["metadata"]["queueURL"] == OTHER["QUEUE_URL"]
        assert trigger["metadata"]["awsRegion"] == OTHER["AWS_REGION"]
    for auth in (o for o in objs if o["kind"] == "TriggerAuthentication"):
        assert auth["spec"]["podIdentity"]["roleArn"] == (
            f"arn:aws:iam::{OTHER['AWS_ACCOUNT_ID']}:role/sqs-ingest-keda")


def test_the_shipped_values_stand_in_platform_env_only() -> None:
    """No manifest of a kustomization holds a platform value: platform.env is the one place.
    (The IAM policies and ECS files are JSON for the AWS CLI, not kustomize: deploy/ecs/README.md
    says which values to set there.)"""
    shipped = {k: v for k, v in env_file(PLATFORM_ENV).items() if v}
    dirs = [DEPLOY / "platform", *(DEPLOY / name for name in KUSTOMIZATIONS)]
    holders: dict[str, list[str]] = {}
    for path in sorted(p for d in dirs for p in d.rglob("*") if p.is_file()):
        if path.suffix == ".json":
            continue
        text = path.read_text()
        for key, value in shipped.items():
            if re.search(re.escape(value) + r"(?![\w-])", text):
                holders.setdefault(key, []).append(str(path.relative_to(DEPLOY)))
    # The account and region are parts of the queue URL there too.
    assert holders == {key: ["platform/platform.env"] for key in shipped}, holders


# ------------------------------------------------------------ HPA and ServiceMonitor


def _prom_name(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def _relabel(labels: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str]:
    """Prometheus relabelling, the two actions a ServiceMonitor here may use (others fail)."""
    labels = dict(labels)
    for rule in rules:
        action = rule.get("action", "replace").lower()
        regex = re.compile(rule.get("regex", "(.*)"))
        replacement = re.sub(r"\$\{?(\d+)\}?", r"\\\1", rule.get("replacement", "$1"))
        if action == "replace":
            joined = rule.get("separator", ";").join(
                labels.get(s, "") for s in rule.get("sourceLabels", []))
            m = regex.fullmatch(joined)
            if m:
                value = m.expand(replacement)
                if value:
                    labels[rule["targetLabel"]] = value
                else:
                    labels.pop(rule["targetLabel"], None)
        elif action == "labelmap":
            for name, value in list(labels.items()):
                m = regex.fullmatch(name)
                if m:
                    labels[m.expand(replacement)] = value
        else:
            pytest.fail(f"relabel action {action} is not modelled here")
    return {k: v for k, v in labels.items() if not k.startswith("__")}


def _scraped_labels(monitor: dict[str, Any], svc: dict[str, Any], pod: dict[str, Any],
                    namespace: str) -> dict[str, str]:
    """The target labels the Prometheus Operator gives a pod behind `svc` scraped through
    `monitor` (its endpoints role): its own labels, then the endpoint's relabelings."""
    pod_labels = pod["metadata"]["labels"]
    (endpoint,) = monitor["spec"]["endpoints"]
    meta = {"__meta_kubernetes_namespace": namespace,
            **{f"__meta_kubernetes_pod_label_{_prom_name(k)}": v for k, v in pod_labels.items()},
            **{f"__meta_kubernetes_service_label_{_prom_name(k)}": v
               for k, v in svc["metadata"].get("labels", {}).items()}}
    labels = {**meta, "namespace": namespace, "service": svc["metadata"]["name"],
              "pod": "sqs-ingest-0", "container": "sqs-ingest", "endpoint": endpoint["port"],
              "job": svc["metadata"]["name"], "instance": "10.0.0.1:9102"}
    for key in monitor["spec"].get("podTargetLabels", []):
        if key in pod_labels:
            labels[_prom_name(key)] = pod_labels[key]
    for key in monitor["spec"].get("targetLabels", []):
        if key in svc["metadata"].get("labels", {}):
            labels[_prom_name(key)] = svc["metadata"]["labels"][key]
    return _relabel(labels, endpoint.get("relabelings", []))


def test_hpa_adapter_rule_selects_labels_the_shipped_servicemonitor_adds() -> None:
    objs = kustomize(DEPLOY / "k8s-hpa")
    (monitor,) = yaml.safe_load_all((DEPLOY / "k8s/optional/servicemonitor.yaml").read_text())
    svc = _named(objs, "Service", "sqs-ingest")
    dep = _named(objs, "Deployment", "sqs-ingest")
    pod = dep["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    series = _scraped_labels(monitor, svc, pod, "ingest")

    rules = yaml.safe_load((DEPLOY / "k8s-hpa/prometheus-adapter-rules.yaml").read_text())
    (rule,) = rules["rules"]["external"]
    # seriesQuery: the adapter lists only series whose matchers hold.
    for label, op, value in re.findall(r'(\w+)\s*(!=|=~|!~|=)\s*"([^"]*)"', rule["seriesQuery"]):
        have = series.get(label, "")
        ok = {"=": have == value, "!=": have != value,
              "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        assert ok, f"seriesQuery needs {label}{op}{value!r}; the scrape gives {series}"
    for group in re.findall(r"by \(([^)]*)\)", rule["metricsQuery"]):
        for label in (g.strip() for g in group.split(",")):
            assert label in series, f"metricsQuery groups by {label}, never scraped"
    assert set(rule["resources"]["overrides"]) <= set(series)
    # The HPA's selector becomes <<.LabelMatchers>>: each label must be on the series as is.
    hpa = _named(objs, "HorizontalPodAutoscaler", "sqs-ingest")
    (metric,) = hpa["spec"]["metrics"]
    wanted = metric["external"]["metric"]["selector"]["matchLabels"]
    assert wanted.items() <= series.items(), (wanted, series)


# ---------------------------------------------------------------------------- KEDA


def test_keda_reads_the_queue_with_its_own_identity(other_tree: Path) -> None:
    """KEDA's operator assumes a role of its own (identityOwner keda), never the daemon's
    (identityOwner workload would take the scaled Deployment's IRSA role), and that role's
    policy allows GetQueueAttributes on the daemon's queue, nothing more."""
    objs = kustomize(other_tree / "k8s-keda")
    scaled = _named(objs, "ScaledObject", "sqs-ingest")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "aws-sqs-queue"
    assert "identityOwner" not in trigger["metadata"] and "awsRoleArn" not in trigger["metadata"]
    auth = _named(objs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    assert set(auth["spec"]) == {"podIdentity"}, "no access keys or secrets in the cluster"
    identity = auth["spec"]["podIdentity"]
    assert identity["provider"] == "aws" and identity["identityOwner"] == "keda"
    daemon_role = _named(objs, "ServiceAccount", "sqs-ingest")["metadata"]["annotations"][
        "eks.amazonaws.com/role-arn"]
    assert identity["roleArn"].startswith("arn:aws:iam::")
    assert identity["roleArn"] != daemon_role
    policy = json.loads((DEPLOY / "k8s-keda/iam-policy-keda.json").read_text())
    (statement,) = policy["Statement"]
    assert statement["Effect"] == "Allow"
    assert statement["Action"] in ("sqs:GetQueueAttributes", ["sqs:GetQueueAttributes"])
    queue_url = env_file(PLATFORM_ENV)["QUEUE_URL"]
    region = env_file(PLATFORM_ENV)["AWS_REGION"]
    account, queue = queue_url.rstrip("/").split("/")[-2:]
    assert statement["Resource"] == f"arn:aws:sqs:{region}:{account}:{queue}"


# ----------------------------------------------------------- ECS and the IAM policies

RENDER = DEPLOY / "ecs" / "render.py"


def render_aws(out: Path, values: Path) -> dict[str, Any]:
    """deploy/ecs/render.py run as its docstring says; the rendered documents by file name."""
    _run([sys.executable, str(RENDER), str(out), "--values", str(values)])
    return {p.name: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}


def _aws_sources() -> dict[str, Path]:
    return {p.name: p for p in [*sorted((DEPLOY / "ecs").glob("*.json")),
                                DEPLOY / "k8s-keda" / "iam-policy-keda.json"]}


def test_aws_render_with_the_shipped_values_gives_the_shipped_files(tmp_path: Path) -> None:
    """The files hold exactly the values platform.env ships with: rendering changes nothing."""
    rendered = render_aws(tmp_path / "out", PLATFORM_ENV)
    sources = _aws_sources()
    assert set(rendered) == set(sources)
    for name, doc in rendered.items():
        assert doc == json.loads(sources[name].read_text()), name


def test_aws_render_carries_other_values_everywhere(tmp_path: Path) -> None:
    values = tmp_path / "platform.env"
    values.write_text("".join(f"{k}={v}\n" for k, v in OTHER.items()))
    rendered = render_aws(tmp_path / "out", values)
    shipped = env_file(PLATFORM_ENV)
    for name, doc in rendered.items():
        text = json.dumps(doc)
        for key in ("IMAGE", "RECONCILE_IMAGE", "AWS_ACCOUNT_ID", "AWS_REGION", "QUEUE_URL"):
            assert shipped[key] not in text, f"{name}: shipped {key} left"
    for name in (n for n in rendered if n.startswith("task-definition")):
        _validate_botocore(rendered[name], "ecs", "RegisterTaskDefinition")
        for c in rendered[name]["containerDefinitions"]:
            env = {e["name"]: e["value"] for e in c.get("environment", [])}
            assert c["image"] == OTHER["RECONCILE_IMAGE" if c["command"][0] == "reconcile"
                                       else "IMAGE"], name
            assert env.get("INGEST_QUEUE_URL", OTHER["QUEUE_URL"]) == OTHER["QUEUE_URL"], name
            assert env.get("INGEST_AWS_REGION", OTHER["AWS_REGION"]) == OTHER["AWS_REGION"], name
            if c["command"][0] == "run":
                assert env["INGEST_QUEUE_URL"] == OTHER["QUEUE_URL"], name
                assert env["INGEST_HANDLERS"] == OTHER["HANDLERS"], name
                assert env["INGEST_S3_EXPECTED_OWNER"] == OTHER["AWS_ACCOUNT_ID"], name
    queue = "arn:aws:sqs:eu-north-1:210987654321:orders"
    for name in ("iam-policy.json", "iam-policy-operator.json", "iam-policy-keda.json"):
        resources = {r for st in rendered[name]["Statement"]
                     for r in (st["Resource"] if isinstance(st["Resource"], list)
                               else [st["Resource"]])}
        assert queue in resources, name
    dims = [d for q in rendered["autoscaling-policy.json"]["TargetTrackingScalingPolicyConfiguration"]
            ["CustomizedMetricSpecification"]["Metrics"] if "MetricStat" in q
            for d in q["MetricStat"]["Metric"]["Dimensions"] if d["Name"] == "QueueName"]
    assert dims == [{"Name": "QueueName", "Value": "orders"}]

"""Least privilege in deploy/, kept true statically (issue 21): each IAM policy holds exactly
its actions on its resources, and each Kubernetes workload only what it needs. Widening a
policy (an action, a resource, a wildcard, a DLQ action back in the daemon's role) or a
manifest turns a test here red."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ECS = ROOT / "deploy" / "ecs"

ACCOUNT_REGION = r"arn:aws[a-z-]*:{svc}:[a-z0-9-]+:\d{{12}}:"
QUEUE = re.compile(ACCOUNT_REGION.format(svc="sqs") + r"[A-Za-z0-9_-]{1,80}(\.fifo)?$")
TOPIC = re.compile(ACCOUNT_REGION.format(svc="sns") + r"[A-Za-z0-9_-]{1,256}(\.fifo)?$")
KEY = re.compile(ACCOUNT_REGION.format(svc="kms") + r"key/[0-9a-f-]{36}$")

# Per role, exactly these actions (a new AWS call gets its statement, and a line here).
DAEMON_ACTIONS = {
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",  # also authorizes DeleteMessageBatch
    "sqs:ChangeMessageVisibility",  # also authorizes ChangeMessageVisibilityBatch
    "sqs:GetQueueAttributes",  # depth gauges, visibility, RedrivePolicy, retention check
    "sqs:SendMessage",  # fresh copies of deferred messages; results to a queue
    "sns:Publish",  # results to a topic (also authorizes PublishBatch)
    "s3:GetObject",  # payloads offloaded by the AWS extended clients
    "s3:ListBucket",  # so that S3 answers 404 (payload_object_missing), not 403
    "kms:Decrypt",  # an encrypted queue (receive) or payload bucket
    "kms:GenerateDataKey",  # an encrypted queue (fresh copies) or results destination
}
OPERATOR_ACTIONS = {
    "sqs:SendMessage",  # dlq replay
    "sqs:GetQueueAttributes",  # redrive: the queue's RedrivePolicy, the DLQ's depth
    "sqs:StartMessageMoveTask", "sqs:ListMessageMoveTasks",  # redrive, on the DLQ
    "sqs:GetQueueUrl",  # redrive: the DLQ's URL from its ARN
    "sqs:ReceiveMessage", "sqs:DeleteMessage",  # the move task, on the DLQ
    "kms:Decrypt", "kms:GenerateDataKey",  # the move between encrypted queues
}
# Only an operator (or the move task it starts) touches the SQS dead-letter queue.
OPERATOR_ONLY = {"sqs:StartMessageMoveTask", "sqs:ListMessageMoveTasks", "sqs:GetQueueUrl"}


def policy(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((ECS / name).read_text())
    assert doc["Version"] == "2012-10-17"
    return doc


def listed(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def task_definition(name: str) -> dict[str, Any]:
    td: dict[str, Any] = json.loads((ECS / name).read_text())
    return td


def daemon_env() -> dict[str, str]:
    (c,) = [c for c in task_definition("task-definition.json")["containerDefinitions"]
            if c["command"][0] == "run"]
    return {e["name"]: e["value"] for e in c["environment"]}


def check_allow_statements(doc: dict[str, Any]) -> set[str]:
    """Every statement: Allow, one service, no wildcard action, resources of that service
    that name one queue/topic/key/bucket; returns the actions."""
    actions: set[str] = set()
    for st in doc["Statement"]:
        assert st["Effect"] == "Allow", st
        assert not {"NotAction", "NotResource", "Principal"} & st.keys(), st
        acts, res = listed(st["Action"]), listed(st["Resource"])
        services = {a.split(":")[0] for a in acts}
        assert len(services) == 1, f"one service per statement: {acts}"
        assert all("*" not in a for a in acts), acts
        service = services.pop()
        for r in res:
            if service == "sqs":
                assert QUEUE.match(r), r
            elif service == "sns":
                assert TOPIC.match(r), r
            elif service == "kms":
                assert KEY.match(r), r
                # A key is used only through the service that encrypts with it.
                assert "kms:ViaService" in st["Condition"]["StringEquals"], st
            elif service == "s3":
                assert r.startswith("arn:aws:s3:::") and r != "arn:aws:s3:::*", r
            else:
                raise AssertionError(f"unexpected service {service}")
        actions |= set(acts)
    return actions


def test_daemon_policy_has_no_operator_actions() -> None:
    doc = policy("iam-policy.json")
    assert check_allow_statements(doc) == DAEMON_ACTIONS
    assert not OPERATOR_ONLY & DAEMON_ACTIONS
    resources = {r for st in doc["Statement"] for r in listed(st["Resource"])}
    assert not [r for r in resources if r.endswith("-dlq")], "the DLQ is the operator's"


def test_daemon_s3_read_is_the_configured_bucket_and_prefix() -> None:
    entries = daemon_env()["INGEST_S3_BUCKETS"].split(",")
    allowed = {b: p for b, _, p in (e.partition("/") for e in entries)}  # bucket -> prefix
    for st in policy("iam-policy.json")["Statement"]:
        acts = listed(st["Action"])
        for r in listed(st["Resource"]):
            if acts == ["s3:GetObject"]:
                bucket, _, key = r.removeprefix("arn:aws:s3:::").partition("/")
                # Objects under exactly a configured bucket/prefix: never the whole bucket
                # when a prefix is configured, never another bucket.
                assert bucket in allowed and key == (
                    f"{allowed[bucket].rstrip('/')}/*" if allowed[bucket] else "*"), r
            elif acts == ["s3:ListBucket"]:
                bucket = r.removeprefix("arn:aws:s3:::")
                assert bucket in allowed and "/" not in bucket, r
                if allowed[bucket]:
                    prefixes = listed(st["Condition"]["StringLike"]["s3:prefix"])
                    assert prefixes == [f"{allowed[bucket].rstrip('/')}/*"], st


def test_operator_policy_is_separate_and_exact() -> None:
    doc = policy("iam-policy-operator.json")
    assert check_allow_statements(doc) == OPERATOR_ACTIONS
    for st in doc["Statement"]:
        if OPERATOR_ONLY & set(listed(st["Action"])):
            assert all(r.endswith("-dlq") for r in listed(st["Resource"])), st


def test_reconcile_task_has_its_own_role_without_aws_permissions() -> None:
    doc = policy("iam-policy-reconcile.json")
    assert doc["Statement"] == [{"Sid": "NoAwsApiAtAll", "Effect": "Deny", "Action": "*",
                                 "Resource": "*"}]
    daemon = task_definition("task-definition.json")
    rec = task_definition("task-definition-reconcile.json")
    assert rec["taskRoleArn"] != daemon["taskRoleArn"]
    assert rec["taskRoleArn"].endswith("/sqs-ingest-reconcile-task")
    for name in ("task-definition-reconcile.json", "task-definition-with-reconcile-sidecar.json"):
        for c in task_definition(name)["containerDefinitions"]:
            secret = {s["name"]: s["valueFrom"] for s in c["secrets"]}["INGEST_DATABASE_URL"]
            # The reconcile job logs in as its own database role (deploy/sql/roles.sql).
            want = "reconcile-database-url" if c["command"][0] == "reconcile" else "app-database-url"
            assert secret.endswith(f":secret:sqs-ingest/{want}"), (name, c["name"], secret)


def test_log_group_is_created_beforehand_not_by_the_execution_role() -> None:
    doc = policy("iam-policy-execution.json")
    actions = {a for st in doc["Statement"] for a in listed(st["Action"])}
    assert "logs:CreateLogGroup" not in actions
    assert not [a for a in actions if "*" in a]
    for path in sorted(ECS.glob("task-definition*.json")):
        for c in json.loads(path.read_text())["containerDefinitions"]:
            opts = c["logConfiguration"]["options"]
            assert "awslogs-create-group" not in opts, f"{path.name}: {c['name']}"
    # The execution role may read exactly the secrets the task definitions inject.
    granted = [r for st in doc["Statement"] if "secretsmanager:GetSecretValue" in
               listed(st["Action"]) for r in listed(st["Resource"])]
    injected = {s["valueFrom"] for p in ECS.glob("task-definition*.json")
                for c in json.loads(p.read_text())["containerDefinitions"] for s in c["secrets"]}
    assert sorted(granted) == sorted(f"{arn}-*" for arn in injected)


# -- Kubernetes -----------------------------------------------------------------------------

K8S = ROOT / "deploy" / "k8s"


def k8s_objects() -> list[dict[str, Any]]:
    import yaml

    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in yaml.safe_load_all((K8S / f).read_text()) if d]


def pods(objs: list[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """component -> (pod labels, pod spec) of each workload."""
    out = {}
    for o in objs:
        tpl = {"Deployment": lambda o: o["spec"]["template"], "Job": lambda o: o["spec"]["template"],
               "CronJob": lambda o: o["spec"]["jobTemplate"]["spec"]["template"]}.get(o["kind"])
        if tpl:
            t = tpl(o)
            out[t["metadata"]["labels"]["app.kubernetes.io/component"]] = (
                t["metadata"]["labels"], t["spec"])
    return out


def selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    sel = policy["spec"]["podSelector"]
    if any(labels.get(k) != v for k, v in sel.get("matchLabels", {}).items()):
        return False
    for e in sel.get("matchExpressions", []):
        assert e["operator"] == "In", e
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def port_set(rules: list[dict[str, Any]]) -> set[tuple[str, int]]:
    return {(p.get("protocol", "TCP"), p["port"]) for r in rules for p in r.get("ports", [])}


def test_one_serviceaccount_per_workload_only_the_daemon_with_an_iam_role() -> None:
    objs = k8s_objects()
    accounts = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceAccount"}
    used = {c: spec["serviceAccountName"] for c, (_, spec) in pods(objs).items()}
    assert set(used) == {"daemon", "migrate", "reconcile"}
    assert len(set(used.values())) == 3, f"a ServiceAccount shared: {used}"
    assert set(used.values()) == set(accounts)
    for component, name in used.items():
        annotations = accounts[name]["metadata"].get("annotations", {})
        has_role = "eks.amazonaws.com/role-arn" in annotations
        assert has_role == (component == "daemon"), (component, annotations)
        assert accounts[name]["automountServiceAccountToken"] is False
        assert pods(objs)[component][1]["automountServiceAccountToken"] is False


def test_network_policies_cover_every_workload_narrowly() -> None:
    objs = k8s_objects()
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    for component, (labels, _) in pods(objs).items():
        (pol,) = [p for p in policies if selects(p, labels)]  # exactly one applies
        spec = pol["spec"]
        assert set(spec["policyTypes"]) == {"Ingress", "Egress"}, component
        ingress = spec.get("ingress", [])
        if component == "daemon":
            # Metrics only, only from the monitoring namespace.
            assert port_set(ingress) == {("TCP", 9102)}
            for rule in ingress:
                assert rule["from"] == [{"namespaceSelector": {"matchLabels": {
                    "kubernetes.io/metadata.name": "monitoring"}}}], rule
        else:
            assert ingress == [], component
        egress = spec["egress"]
        want = {("TCP", 5432), ("UDP", 53), ("TCP", 53)}
        if component == "daemon":
            want |= {("TCP", 443)}
        assert port_set(egress) == want, component
        for rule in egress:
            assert rule.get("ports"), f"{component}: an egress rule without ports: {rule}"
            if {p["port"] for p in rule["ports"]} == {53}:
                (to,) = rule["to"]
                assert to["namespaceSelector"]["matchLabels"] == {
                    "kubernetes.io/metadata.name": "kube-system"}
            if {p["port"] for p in rule["ports"]} == {5432}:
                assert all("ipBlock" in t and t["ipBlock"]["cidr"] != "0.0.0.0/0"
                           for t in rule["to"]), rule


def test_no_secret_in_the_base() -> None:
    objs = k8s_objects()
    assert not [o for o in objs if o["kind"] == "Secret"], "apply -k would overwrite it"
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert "deploy/k8s-secret-from-file/database.env" in gitignore
    import yaml

    gen = yaml.safe_load((ROOT / "deploy/k8s-secret-from-file/kustomization.yaml").read_text())
    assert gen["resources"] == ["../k8s"]
    (sg,) = gen["secretGenerator"]
    # Both named by platform.env's DATABASE_SECRET (tests/deploy/test_platform_values.py).
    assert sg["name"] == "DATABASE_SECRET" and sg["envs"] == ["database.env"]
    ext_file = ROOT / "deploy/k8s-external-secret/external-secret.yaml"
    (ext,) = yaml.safe_load_all(ext_file.read_text())
    assert ext["kind"] == "ExternalSecret" and ext["spec"]["target"]["name"] == "DATABASE_SECRET"
    keys = {d["secretKey"] for d in ext["spec"]["data"]}
    example = (ROOT / "deploy/k8s-secret-from-file/database.env.example").read_text()
    assert keys == {line.split("=", 1)[0] for line in example.splitlines() if "=" in line}

"""Narrow identities in the shipped manifests: no pod gets its DSN from an environment variable;
S3 reads are pinned to the bucket owner's account; the NetworkPolicies' egress goes only to
address blocks the user names (placeholders from the documentation ranges), never anywhere.
(KEDA's own role: tests/deploy/test_platform_values.py, on the rendered overlay.)"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S, ECS = ROOT / "deploy/k8s", ROOT / "deploy/ecs"


def _listed(v: Any) -> list[Any]:
    return v if isinstance(v, list) else [v]


def _yaml(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_specs() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in _yaml(path):
            if doc["kind"] == "CronJob":
                out[doc["kind"]] = doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
            elif doc["kind"] in ("Deployment", "Job"):
                out[doc["kind"]] = doc["spec"]["template"]["spec"]
    return out


def test_no_dsn_in_the_environment_of_any_pod() -> None:
    pods = _pod_specs()
    assert set(pods) == {"Deployment", "Job", "CronJob"}
    for kind, spec in pods.items():
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            env = {e["name"]: e for e in c.get("env", [])}
            assert not [n for n in env if n in ("INGEST_DATABASE_URL", "INGEST_DATABASE_PASSWORD",
                                                "INGEST_RECONCILE_PEER_URLS")], kind
            assert not [e for e in env.values() if "secretKeyRef" in e.get("valueFrom", {})], kind
            path = env["INGEST_DATABASE_URL_FILE"]["value"]
            mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
            assert path == f"{mounts['db']}/database-url", kind
        (vol,) = [v for v in spec["volumes"] if v["name"] == "db"]
        assert vol["projected"]["defaultMode"] == 0o440, kind
        assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsUser"], kind


def test_s3_reads_are_pinned_to_the_bucket_owner() -> None:
    (cm,) = _yaml(K8S / "configmap.yaml")
    # The kustomize build writes platform.env's AWS_ACCOUNT_ID there (test_platform_values).
    assert cm["data"]["INGEST_S3_EXPECTED_OWNER"] == "AWS_ACCOUNT_ID"
    env = dict(line.split("=", 1) for line in (ROOT / "deploy/platform/platform.env")
               .read_text().splitlines() if line and not line.startswith("#"))
    owner = env["AWS_ACCOUNT_ID"]
    assert len(owner) == 12 and owner.isdigit()
    for path in sorted(ECS.glob("task-definition*.json")):
        for c in json.loads(path.read_text())["containerDefinitions"]:
            env = {e["name"]: e["value"] for e in c.get("environment", [])}
            if "INGEST_S3_BUCKETS" in env:
                assert env.get("INGEST_S3_EXPECTED_OWNER") == owner, path.name
    s3 = [st for st in json.loads((ECS / "iam-policy.json").read_text())["Statement"]
          if any(a.startswith("s3:") for a in _listed(st["Action"]))]
    assert s3
    for st in s3:
        assert st["Condition"]["StringEquals"]["s3:ResourceAccount"] == owner, st["Sid"]


def test_egress_only_to_address_blocks_the_user_names() -> None:
    policies = [d for d in _yaml(K8S / "networkpolicy.yaml") if d["kind"] == "NetworkPolicy"]
    assert policies
    for pol in policies:
        for rule in pol["spec"]["egress"]:
            ports = {p["port"] for p in rule["ports"]}
            assert rule.get("to"), f"{pol['metadata']['name']}: egress {ports} to anywhere"
            if ports == {53}:
                continue  # kube-dns, by selector
            for peer in rule["to"]:
                net = ipaddress.IPv4Network(peer["ipBlock"]["cidr"])
                # A documentation range: nothing is reached until the user names theirs.
                assert any(net.subnet_of(ipaddress.IPv4Network(doc)) for doc in
                           ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")), net

"""The deploy examples read S3 pointers only where their IAM policy lets them: every
example that runs the daemon sets ``INGEST_S3_BUCKETS``, and the policy's S3 read
statement covers exactly those buckets (prefixes), nothing wider (issue 20)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from service.s3access import AllowList

ROOT = Path(__file__).resolve().parents[2]
ECS = ROOT / "deploy" / "ecs"


def _allow_lists() -> dict[str, str]:
    out = {}
    cm = yaml.safe_load((ROOT / "deploy/k8s/configmap.yaml").read_text())
    out["k8s configmap"] = cm["data"].get("INGEST_S3_BUCKETS", "")
    for path in sorted(ECS.glob("task-definition*.json")):
        task = json.loads(path.read_text())
        for c in task["containerDefinitions"]:
            if "run" in c.get("command", ["run"]):
                env = {e["name"]: e["value"] for e in c.get("environment", [])}
                out[f"{path.name}:{c['name']}"] = env.get("INGEST_S3_BUCKETS", "")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    out["docker-compose ingest"] = compose["services"]["ingest"]["environment"].get(
        "INGEST_S3_BUCKETS", "")
    return out


def _s3_reads() -> set[str]:
    """Resources of every statement that allows s3:GetObject, over the ECS policy files."""
    found: set[str] = set()
    for path in sorted(ECS.glob("*policy*.json")):
        doc = json.loads(path.read_text())
        for st in doc.get("Statement", []):
            actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
            if st.get("Effect") == "Allow" and any(a in ("s3:GetObject", "s3:*", "*")
                                                   for a in actions):
                res: Any = st["Resource"]
                found.update(res if isinstance(res, list) else [res])
    return found


def test_every_example_names_its_buckets_and_the_policy_reads_only_those() -> None:
    lists = _allow_lists()
    assert lists and all(lists.values()), lists  # unset: no pointer would ever be read
    wanted = {f"arn:aws:s3:::{b}/{prefix}*" for text in lists.values()
              for b, prefix in AllowList.parse(text).entries}
    assert _s3_reads() == wanted

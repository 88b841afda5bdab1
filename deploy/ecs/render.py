#!/usr/bin/env python3
"""Write the AWS-side JSON files with the values of deploy/platform/platform.env:

    python3 deploy/ecs/render.py OUT_DIR [--values deploy/platform/platform.env]

then hand OUT_DIR's files to the AWS CLI (`--cli-input-json file://OUT_DIR/...`, the IAM
policies to `aws iam put-role-policy`). Rendered: every JSON file of deploy/ecs and KEDA's
policy, deploy/k8s-keda/iam-policy-keda.json.

The shipped files hold the example values platform.env ships with (EXAMPLE below); each is
replaced by the value set there:
  - the images (IMAGE, RECONCILE_IMAGE) and the queue URL (INGEST_QUEUE_URL), whole;
  - the queue's ARN, and its name in the CloudWatch QueueName dimension, from QUEUE_URL;
  - the account and the region wherever else they stand (role, secret, log group, cluster and
    KMS key ARNs, INGEST_S3_EXPECTED_OWNER, awslogs-region, kms:ViaService);
  - INGEST_HANDLERS in the daemon's environment when HANDLERS is set.
The names that are choices per file (cluster, subnets, security group, KMS key ids, the
dead-letter queue, the results destination) stay as they are: deploy/ecs/README.md.

Standard library only, so it runs wherever the AWS CLI does. Kustomize does the same for
Kubernetes (deploy/platform); the ECS files are JSON for the AWS CLI, which has no templating.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

DEPLOY = Path(__file__).resolve().parents[1]
FILES = [*sorted((DEPLOY / "ecs").glob("*.json")), DEPLOY / "k8s-keda" / "iam-policy-keda.json"]

#: The values the shipped JSON files hold: platform.env's as shipped (a test keeps them equal).
EXAMPLE = {
    "IMAGE": "123456789012.dkr.ecr.us-east-1.amazonaws.com/sqs-ingest:0.1.0",
    "RECONCILE_IMAGE": "123456789012.dkr.ecr.us-east-1.amazonaws.com/sqs-ingest-reconcile:0.1.0",
    "AWS_ACCOUNT_ID": "123456789012",
    "AWS_REGION": "us-east-1",
    "QUEUE_URL": "https://sqs.us-east-1.amazonaws.com/123456789012/sqs-ingest",
}

_QUEUE_HOST = re.compile(
    r"^(?:sqs\.([a-z0-9-]+)\.amazonaws\.com|([a-z0-9-]+)\.queue\.amazonaws\.com)$")


def read_values(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, # comments: the format kustomize reads platform.env in."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    missing = [k for k in EXAMPLE if not values.get(k)]
    if missing:
        raise SystemExit(f"render.py: {path} sets no {', '.join(missing)}")
    return values


def queue_arn(url: str, region: str) -> tuple[str, str]:
    """(ARN, name) of the queue a URL names: https://sqs.REGION.amazonaws.com/ACCOUNT/NAME."""
    host, _, path = url.partition("://")[2].partition("/")
    parts = path.strip("/").split("/")
    if len(parts) != 2:
        raise SystemExit(f"render.py: QUEUE_URL {url} is not "
                         "https://sqs.REGION.amazonaws.com/ACCOUNT/NAME")
    match = _QUEUE_HOST.match(host)
    queue_region = (match.group(1) or match.group(2)) if match else region
    account, name = parts
    return f"arn:aws:sqs:{queue_region}:{account}:{name}", name


def render(doc: Any, values: dict[str, str]) -> Any:
    example_arn, example_name = queue_arn(EXAMPLE["QUEUE_URL"], EXAMPLE["AWS_REGION"])
    arn, name = queue_arn(values["QUEUE_URL"], values["AWS_REGION"])
    whole = {EXAMPLE[k]: values[k] for k in ("IMAGE", "RECONCILE_IMAGE", "QUEUE_URL")}
    whole[example_arn] = arn

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("Name") == "QueueName" and node.get("Value") == example_name:
                return {**node, "Value": name}
            out = {k: walk(v) for k, v in node.items()}
            if values.get("HANDLERS") and (out.get("command") or [None])[0] == "run":
                env = [e for e in out.get("environment", []) if e["name"] != "INGEST_HANDLERS"]
                out["environment"] = [*env, {"name": "INGEST_HANDLERS",
                                             "value": values["HANDLERS"]}]
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str):
            if node in whole:
                return whole[node]
            return (node.replace(EXAMPLE["AWS_ACCOUNT_ID"], values["AWS_ACCOUNT_ID"])
                    .replace(EXAMPLE["AWS_REGION"], values["AWS_REGION"]))
        return node

    return walk(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the rendered files to")
    parser.add_argument("--values", type=Path, default=DEPLOY / "platform" / "platform.env",
                        help="the platform values (default: deploy/platform/platform.env)")
    args = parser.parse_args(argv)
    values = read_values(args.values)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in FILES:
        doc = render(json.loads(path.read_text()), values)
        (args.out / path.name).write_text(json.dumps(doc, indent=2) + "\n")
        print(args.out / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

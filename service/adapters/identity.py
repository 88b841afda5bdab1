"""A stable, unique name for this replica when ``INGEST_WORKER_NAME`` is not set.

The name decides what the startup orphan GC may release at once: the claims of earlier
incarnations *with the same name* (SPEC §2 item 6). So a default must be unique among live
replicas and stable across a restart of the same one. A hostname is neither in general (host
networking shares it; two local processes share it), so none is taken from it. On ECS the
task metadata endpoint (``ECS_CONTAINER_METADATA_URI_V4``, set by the agent in every
container) names the task and the container: ``<task ARN>/<container name>`` is unique
among live containers and kept when ECS restarts the container in place (a container
``restartPolicy``). Kubernetes: set the variable from the pod name (deploy/k8s does).
"""

from __future__ import annotations

import json
import os
import urllib.request

METADATA_ENV = "ECS_CONTAINER_METADATA_URI_V4"


def ecs_worker_name(timeout: float = 2.0) -> str | None:
    """``<task ARN>/<container name>`` from the ECS container metadata, or None (not on ECS,
    or the endpoint did not answer with both)."""
    base = os.environ.get(METADATA_ENV)
    if not base:
        return None
    try:
        with urllib.request.urlopen(base, timeout=timeout) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    labels = doc.get("Labels") if isinstance(doc, dict) else None
    if not isinstance(labels, dict):
        return None
    task = labels.get("com.amazonaws.ecs.task-arn")
    container = labels.get("com.amazonaws.ecs.container-name") or doc.get("Name")
    if not isinstance(task, str) or not isinstance(container, str) or not task or not container:
        return None
    return f"{task}/{container}"

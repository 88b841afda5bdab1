"""Static checks of the Grafana dashboard: the committed JSON (what users import) and the k8s
ConfigMap are exactly what deploy/grafana/generate.py builds, the layout is sound, and the
compose provisioning points at them. tests/integration/test_dashboard.py runs the queries."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from tests.deploy.test_static import K8S_VERSIONS, _k8s_validate

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy/grafana"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_generate", GRAFANA / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _dashboard() -> dict[str, Any]:
    return json.loads((GRAFANA / "sqs-ingest.json").read_text())


def test_committed_files_equal_the_generator_output() -> None:
    gen = _generator()
    assert (GRAFANA / "sqs-ingest.json").read_text() == gen.dashboard_json(), (
        "deploy/grafana/sqs-ingest.json is stale: run python deploy/grafana/generate.py")
    assert gen.CONFIGMAP_YAML.read_text() == gen.configmap_yaml(), (
        "the dashboard ConfigMap is stale: run python deploy/grafana/generate.py")
    assert gen.main(["--check"]) == 0


def test_configmap_carries_the_dashboard_for_the_sidecar() -> None:
    (cm,) = [d for d in yaml.safe_load_all(
        (ROOT / "deploy/k8s/optional/grafana-dashboard.yaml").read_text()) if d]
    assert cm["kind"] == "ConfigMap"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["sqs-ingest.json"]) == _dashboard()
    # Same schema check as the kustomize base (K8S_VERSIONS: oldest supported and latest).
    for version in K8S_VERSIONS:
        _k8s_validate(cm, version)
    # kubectl apply keeps a copy in an annotation, limited to 256 KiB.
    assert len(cm["data"]["sqs-ingest.json"]) < 256 * 1024


def test_layout_and_datasource() -> None:
    d = _dashboard()
    assert d["uid"] == "sqs-ingest"
    panels = d["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{p['title']} overlaps another panel"
        taken |= cells
        if p["type"] == "row":
            continue
        # Import anywhere: the data source is the dashboard's own variable, never a uid
        # that exists only on the machine it was exported from.
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            assert t["expr"].strip()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert {"job", "instance"} <= set(variables)


def test_compose_provisions_the_dashboard() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    dash_mount = mounts["./deploy/grafana/sqs-ingest.json"]
    provider = yaml.safe_load(
        (GRAFANA / "provisioning/dashboards/sqs-ingest.yml").read_text())["providers"][0]
    assert dash_mount.startswith(provider["options"]["path"] + "/")
    (ds,) = yaml.safe_load(
        (GRAFANA / "provisioning/datasources/prometheus.yml").read_text())["datasources"]
    host = ds["url"].split("//")[1].split(":")[0]
    assert host in compose["services"] and ds["type"] == "prometheus"

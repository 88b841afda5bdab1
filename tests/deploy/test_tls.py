"""Every example DSN in deploy/, docs/ and the README verifies the database's certificate
(sslmode=verify-full with sslrootcert), and the Kubernetes pods mount the CA bundle it names;
the local compose stack, whose PostgreSQL serves no TLS, opts out explicitly."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from service import secrets
from service.settings import _loopback

ROOT = Path(__file__).resolve().parents[2]
DSN = re.compile(r"postgres(?:ql)?://[^\s\"'`|)]+")
MOUNT = "/etc/sqs-ingest/db"


def _texts() -> list[Path]:
    files = [p for p in (ROOT / "deploy").rglob("*") if p.is_file()
             and p.suffix not in (".png", ".pem")]
    return [*files, *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]


def _remote_dsns() -> list[tuple[Path, str]]:
    out = []
    for path in _texts():
        for url in DSN.findall(path.read_text(errors="replace")):
            try:
                dsn = secrets.parse_dsn(url)
            except secrets.DsnError:
                continue  # a form description (`postgresql://user:pass@host:port/db?…`)
            if dsn.hosts() and not all(_loopback(h) for h in dsn.hosts()):
                out.append((path.relative_to(ROOT), url))
    return out


def test_example_dsns_verify_the_server() -> None:
    found = _remote_dsns()
    assert any("database.env.example" in str(p) for p, _ in found)
    for path, url in found:
        if path.name == "README.md" and "?" not in url:
            continue  # a printed, redacted DSN (no query string) in an output example
        query = dict(secrets.parse_dsn(url).query)
        assert query.get("sslmode") == "verify-full", (path, url)
        assert query.get("sslrootcert", "").startswith(MOUNT + "/"), (path, url)


def test_compose_opts_out_explicitly() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        if "INGEST_DATABASE_URL" in env:
            assert env.get("INGEST_DATABASE_TLS") == "disable-verification", name


def _pods() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted((ROOT / "deploy/k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "Job", "CronJob"):
                continue
            spec = doc["spec"]["template"]["spec"] if doc["kind"] != "CronJob" else \
                doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
            out.append((f"{doc['kind']}/{doc['metadata']['name']}", spec))
    return out


def test_pods_that_reach_the_database_mount_its_ca() -> None:
    pods = _pods()
    assert len(pods) == 3
    for name, spec in pods:
        (vol,) = [v for v in spec["volumes"] if v["name"] == "db"]
        sources = vol["projected"]["sources"]
        cms = [s["configMap"] for s in sources if "configMap" in s]
        assert cms == [{"name": "sqs-ingest-db-ca",
                        "items": [{"key": "ca.pem", "path": "ca.pem"}]}], name
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            assert mounts["db"]["mountPath"] == MOUNT and mounts["db"]["readOnly"], name

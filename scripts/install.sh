#!/usr/bin/env bash
# Installs everything sqs-ingest needs on a fresh Debian 12 machine (run as root), idempotently:
# Debian packages (PostgreSQL, Java + JDBC driver for reconcile, Prometheus/promtool for the
# metrics tests), the virtualenv and the project with its extras.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
have_pg() { ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null; }
have_pg || need_apt+=(postgresql postgresql-contrib)
command -v java >/dev/null || need_apt+=(openjdk-17-jre-headless)
[ -f /usr/share/java/postgresql.jar ] || need_apt+=(libpostgresql-jdbc-java)
if [ "${INSTALL_OPS_TOOLS:-1}" = 1 ]; then
  command -v promtool >/dev/null || need_apt+=(prometheus)
  # `kubectl kustomize` renders deploy/k8s in tests/deploy (required in `make test`).
  command -v kubectl >/dev/null || command -v kustomize >/dev/null || need_apt+=(kubectl)
fi
command -v python3 >/dev/null || need_apt+=(python3 python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  scripts/apt-install.sh "${need_apt[@]}"
  # The Debian prometheus package starts a server where an init system runs; we start our own.
  (command -v systemctl >/dev/null && systemctl disable --now prometheus prometheus-node-exporter) \
    >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv || { apt-get install -y -qq python3-venv >/dev/null && "$PY" -m venv .venv; }
fi
stamp=.venv/.installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # One resolver run: aiobotocore pins botocore, boto3/moto must agree with it.
  .venv/bin/python -m pip install -q -e '.[dev,reconcile]'
  touch "$stamp"
fi

# LocalStack in host mode for the tests that need realistic SQS/SNS/S3 and for `make bench`.
if [ "${INSTALL_LOCALSTACK:-1}" = 1 ]; then
  scripts/localstack-venv.sh
fi

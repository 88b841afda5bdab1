#!/usr/bin/env bash
# Installs what sqs-ingest needs on a fresh Debian 12 machine (run as root), idempotently.
#
#   scripts/install.sh run   # `make run`: PostgreSQL, the venv with the daemon's runtime
#                            # dependencies and the SQS emulator (moto server) — nothing else
#   scripts/install.sh       # `make install` / `make test`: the above, plus Java + the JDBC
#                            # driver (reconcile), promtool, kubectl, the Spark extra, the dev
#                            # tools and LocalStack's venv
#
# INSTALL_PLAN=1 prints what would be installed (the Debian packages and pip's extras) and
# changes nothing; with INSTALL_PRETEND_BARE=1 it plans as if the machine had none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-all}
STEP=${2:-both}  # debian | python | both: `make run` starts PostgreSQL between the two
case "$PROFILE/$STEP" in run/* | all/*) ;; *) echo "usage: $0 [run|all] [debian|python]" >&2; exit 64 ;; esac
bare=${INSTALL_PRETEND_BARE:-0}
has() { [ "$bare" != 1 ] && command -v "$1" >/dev/null; }
has_file() { [ "$bare" != 1 ] && [ -e "$1" ]; }
have_pg() { [ "$bare" != 1 ] && { ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null; }; }

need_apt=()
has python3 || need_apt+=(python3)
# Debian's python3 makes no venv without python3-venv (ensurepip).
{ has python3 && python3 -c 'import ensurepip' 2>/dev/null; } || need_apt+=(python3-venv)
have_pg || need_apt+=(postgresql postgresql-contrib)
if [ "$PROFILE" = all ]; then
  has java || need_apt+=(openjdk-17-jre-headless)
  has_file /usr/share/java/postgresql.jar || need_apt+=(libpostgresql-jdbc-java)
  if [ "${INSTALL_OPS_TOOLS:-1}" = 1 ]; then
    has promtool || need_apt+=(prometheus)
    # `kubectl kustomize` renders deploy/k8s in tests/deploy (required in `make test`).
    has kubectl || has kustomize || need_apt+=(kubectl)
  fi
fi
# Locked sets (requirements/, `make lock`): dev.txt for all, run.txt for run (runtime +
# emulator = moto server, + boto3, which scripts/services.sh uses to create the queue).
extras=emulator
[ "$PROFILE" = all ] && extras=dev,reconcile,emulator
localstack=$([ "$PROFILE" = all ] && [ "${INSTALL_LOCALSTACK:-1}" = 1 ] && echo yes || echo no)
if [ "${INSTALL_PLAN:-0}" = 1 ]; then
  echo "debian: ${need_apt[*]}"
  echo "pip: .[$extras]"
  echo "localstack: $localstack"
  exit 0
fi

if [ ${#need_apt[@]} -gt 0 ] && [ "$STEP" != python ]; then
  scripts/apt-install.sh "${need_apt[@]}"
  # The Debian prometheus package starts a server where an init system runs; we start our own.
  (command -v systemctl >/dev/null && systemctl disable --now prometheus prometheus-node-exporter) \
    >/dev/null 2>&1 || true
fi

[ "$STEP" != debian ] || exit 0
PY=${PYTHON:-python3}
full=.venv/.installed  # the whole set (profile all) is a superset of run's
# Exactly the locked versions, checked against their hashes (requirements/*.txt, written by
# `make lock`); then the project itself, without dependencies. A lock newer than the venv's
# stamp rebuilds the venv, so nothing a previous lock brought lingers
# (tests/unit/test_lock.py compares the venv with the lock).
if [ "$PROFILE" = all ] && [ -d .venv ] && { [ ! -f "$full" ] || [ requirements/dev.txt -nt "$full" ]; } \
   && [ -f .venv/.installed-any ]; then
  rm -rf .venv
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ "$PROFILE" = all ]; then
  if [ ! -f "$full" ] || [ requirements/dev.txt -nt "$full" ] || [ requirements/build.txt -nt "$full" ] \
     || [ pyproject.toml -nt "$full" ]; then
    touch .venv/.installed-any
    .venv/bin/python -m pip install -q --require-hashes -r requirements/dev.txt
    # The build backend from its lock, then the project built by it (no isolated build
    # environment fetching an unhashed backend).
    .venv/bin/python -m pip install -q --require-hashes -r requirements/build.txt
    .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
    touch "$full"
  fi
else
  stamp=.venv/.installed-run
  if { [ ! -f "$full" ] || [ requirements/dev.txt -nt "$full" ]; } \
     && { [ ! -f "$stamp" ] || [ requirements/run.txt -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; }; then
    touch .venv/.installed-any
    # uv, not pip, on the first-run path: pip spent ~2 of its ~2.3 minutes here fetching and
    # parsing index pages one project at a time (botocore's alone ~11 s); uv resolves and
    # downloads the same set in ~10 s (README "First run"). pip remains the fallback.
    uv=$(command -v uv || true)
    if [ -z "$uv" ] && .venv/bin/python -m pip install -q --require-hashes -r requirements/uv.txt \
       && .venv/bin/uv --version >/dev/null 2>&1; then
      uv=.venv/bin/uv
    fi
    if [ -n "$uv" ]; then
      "$uv" pip install -q --python .venv/bin/python --require-hashes -r requirements/run.txt
      "$uv" pip install -q --python .venv/bin/python --require-hashes -r requirements/build.txt
      "$uv" pip install -q --python .venv/bin/python --no-deps --no-build-isolation -e .
    else
      .venv/bin/python -m pip install -q --require-hashes -r requirements/run.txt
      .venv/bin/python -m pip install -q --require-hashes -r requirements/build.txt
      .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
    fi
    touch "$stamp"
  fi
fi

# LocalStack in host mode for the tests that need realistic SQS/SNS/S3 and for `make bench`.
if [ "$localstack" = yes ]; then
  scripts/localstack-venv.sh
fi

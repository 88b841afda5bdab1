#!/usr/bin/env bash
# LocalStack in host mode (no Docker), in its own venv (LocalStack pins its own botocore):
#
#   scripts/localstack-venv.sh [VENV [VERSION [PYTHON]]]
#
# Defaults — what `make install` builds for the tests: .venv-localstack, localstack-core
# 4.13.1, the system python3. 4.13.1 is the newest release that runs on Debian 12's Python
# 3.11 (later ones use 3.12 syntax despite declaring >= 3.10); the LocalStack-backed tests
# pass on it. `make bench` builds bench/.venv-localstack with 2026.3.0 on Python 3.13 (what
# BENCHMARKS.md measured), if this machine has one. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-localstack}
VERSION=${2:-4.13.1}
py=${3:-${LOCALSTACK_PYTHON:-python3}}

if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.localstack-version" 2>/dev/null)" = "$VERSION" ] \
   && "$VENV/bin/python" -c 'import localstack.runtime.main, localstack.aws.components' 2>/dev/null; then
  exit 0
fi
echo "localstack-venv: creating $VENV (localstack-core $VERSION) with $("$py" --version 2>&1)"
rm -rf "$VENV"
"$py" -m venv "$VENV" || { apt-get install -y -qq python3-venv >/dev/null && "$py" -m venv "$VENV"; }
# The tests' LocalStack or make bench's, each from its hashed lock (make lock): the same
# every time. Another release needs its own lock (scripts/lock.sh) first.
LOCK=
for name in localstack localstack-bench; do
  if [ "$VERSION" = "$(sed -n 's/^localstack-core\[runtime\]==//p' "requirements/$name.in")" ]; then
    LOCK=requirements/$name.txt
  fi
done
[ -n "$LOCK" ] || { echo "localstack-venv: no lock for localstack-core $VERSION (add one: scripts/lock.sh)" >&2; exit 2; }
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --require-hashes -r "$LOCK"
# Importing the components is what fails on an interpreter too old for this release.
"$VENV/bin/python" -c 'import localstack.runtime.main, localstack.aws.components'
echo "$VERSION" > "$VENV/.localstack-version"

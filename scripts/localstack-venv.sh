#!/usr/bin/env bash
# LocalStack (host mode, no Docker) for the tests that need realistic SQS, SNS or S3 and for
# `make bench`: its own venv at .venv-localstack, apart from the project's (LocalStack pins its
# own botocore). Interpreter: $LOCALSTACK_PYTHON, else pyenv's 3.13 (measured here), else
# python3 (localstack-core requires >= 3.10). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-localstack
PACKAGES=('localstack-core[runtime]==2026.3.0' 'cbor2<6' 'pyopenssl<25' 'cryptography<45' service-identity)

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import localstack.runtime.main' 2>/dev/null; then
  exit 0
fi
py=${LOCALSTACK_PYTHON:-}
if [ -z "$py" ]; then
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for cand in "$root"/versions/3.13*/bin/python3; do
    [ -x "$cand" ] && py=$cand && break
  done
fi
py=${py:-python3}
echo "localstack-venv: creating $VENV with $("$py" --version 2>&1)"
rm -rf "$VENV"
"$py" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PACKAGES[@]}"
"$VENV/bin/python" -c 'import localstack.runtime.main'

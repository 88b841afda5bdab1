#!/usr/bin/env bash
# `make lock`: refresh the hashed lock files in requirements/ from pyproject.toml.
#
# uv (pinned below, in its own venv .venv-lock, never in the project's) resolves and writes
# `--generate-hashes` locks in seconds from the index's published hashes; pip-compile needed
# more than 15 minutes here for the same resolution (it downloads distributions, pyspark's
# ~300 MB included, to hash them). The installs themselves stay plain pip with
# `--require-hashes` (scripts/install.sh, the Dockerfile).
#
# One resolution for everything: dev.txt (all extras: what make install / CI install),
# then each narrower lock constrained to it (runtime: the daemon image; run: `make run`,
# runtime + the emulator extra; otel and reconcile: the image's extras), so a package has the same version in every
# file (aiobotocore pins botocore; boto3 and moto must agree with it).
# Target: CPython 3.11 on Debian 12 (glibc 2.36), as CI, make install and the image.
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=$(sed -n 's/^uv==//p' requirements/uv.in)
if [ ! -x .venv-lock/bin/uv ] || [ "$(.venv-lock/bin/uv --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  rm -rf .venv-lock
  python3 -m venv .venv-lock
  # uv itself by hash (requirements/uv.txt, written below from uv.in).
  .venv-lock/bin/pip install -q --require-hashes -r requirements/uv.txt
fi
compile() {  # compile OUT [uv args...]
  local out=$1; shift
  .venv-lock/bin/uv pip compile -q --generate-hashes --python-version 3.11 \
    --python-platform x86_64-manylinux_2_36 --no-header --custom-compile-command "make lock" \
    "$@" -o "requirements/${out}" pyproject.toml
}
mkdir -p requirements
# LOCK_UPGRADE=1 make lock: newest allowed versions; plain make lock keeps the current pins.
compile dev.txt --extra dev --extra reconcile --extra otel --extra emulator \
  ${LOCK_UPGRADE:+--upgrade}
compile runtime.txt -c requirements/dev.txt
compile run.txt --extra emulator -c requirements/dev.txt
compile otel.txt --extra otel -c requirements/dev.txt
compile reconcile.txt --extra reconcile -c requirements/dev.txt
# Sets of their own, each from its .in file: the build backend (pyproject.toml's
# [build-system], agreeing with dev.txt), uv, the tests' LocalStack venv and make bench's
# (scripts/localstack-venv.sh: their own resolutions, their own botocore).
compile_in() {  # compile_in NAME PYTHON [uv args...]: requirements/NAME.in -> NAME.txt
  local name=$1 python=$2; shift 2
  .venv-lock/bin/uv pip compile -q --generate-hashes --python-version "$python" \
    --python-platform x86_64-manylinux_2_36 --no-header --custom-compile-command "make lock" \
    ${LOCK_UPGRADE:+--upgrade} "$@" "requirements/${name}.in" -o "requirements/${name}.txt"
}
compile_in build 3.11 -c requirements/dev.txt
compile_in uv 3.11
compile_in localstack 3.11
compile_in localstack-bench 3.13
echo "requirements/*.txt locked ($(grep -c '^[a-z0-9]' requirements/dev.txt) packages in dev.txt)"

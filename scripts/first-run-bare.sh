#!/usr/bin/env bash
# scripts/first-run.sh inside a bare Debian 12 container: debootstrap's minbase of bookworm
# plus only what a newcomer needs to type the two commands (git, make, ca-certificates) —
# no Python, no PostgreSQL, no pip cache. `make run` installs the rest from Debian's and
# PyPI's package servers. Prints "first completed message after N s" (clone -> message).
#
#   scripts/first-run-bare.sh [REF]    # REF: a commit of this checkout (default HEAD)
#
# Needs root (debootstrap) and a running engine (scripts/engine.sh start). The image is made
# once and reused. The host's CA bundle goes in (a proxy in front of the package servers
# may present its own CA), and apt/pip/uv are pointed at it as on the host.
set -euo pipefail
cd "$(dirname "$0")/.."
CA=/etc/ssl/certs/ca-certificates.crt
RECIPE="minbase bookworm git,make,ca-certificates"  # change it, and the image is made anew
name=sqs-ingest-bare:bookworm-$({ echo "$RECIPE"; cat "$CA"; } | sha256sum | cut -c1-12)
if ! docker image inspect "$name" >/dev/null 2>&1; then
  mirror=$(scripts/image.sh mirror)
  rootfs=$(mktemp -d /var/tmp/sqs-ingest-bare.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "building $name: debootstrap minbase bookworm + git make ca-certificates" >&2
  debootstrap --variant=minbase --include=git,make,ca-certificates bookworm "$rootfs" \
    "$mirror" >"$rootfs.log" 2>&1 || { tail -n 20 "$rootfs.log" >&2; exit 1; }
  rm -f "$rootfs.log"
  cp "$CA" "$rootfs$CA"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | docker import \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" --change "ENV PIP_CERT=$CA" --change "ENV SSL_CERT_FILE=$CA" \
    - "$name" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Host networking (as scripts/image.sh builds): loopback ports picked free on the host.
# The repository itself (a worktree's .git is only a pointer to it), cloned at REF.
git_dir=$(cd "$(git rev-parse --git-common-dir)" && pwd)
docker run --rm --network host -v "$git_dir:/src.git:ro" \
  -e PG_PORT="$(free_port)" -e SQS_PORT="$(free_port)" -e INGEST_HTTP_PORT="$(free_port)" \
  -e FIRST_RUN_REF="${1:-$(git rev-parse HEAD)}" "$name" \
  bash -c 'git config --global --add safe.directory "*" && git clone -q /src.git /tmp/s \
    && git -C /tmp/s checkout -q "$FIRST_RUN_REF" && exec /tmp/s/scripts/first-run.sh /src.git'

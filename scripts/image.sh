#!/usr/bin/env bash
# `make image`: builds sqs-ingest:latest (the daemon) and sqs-ingest-reconcile:latest from
# the project's Dockerfile on a machine that reaches Debian's and PyPI's package servers
# but no container registry.
#
# The Dockerfile's base (PYTHON_IMAGE, python:3.11-slim-bookworm for users with a registry)
# is replaced by one made here from Debian packages: debootstrap of bookworm with python3,
# imported into the engine once and reused while its recipe is unchanged. Set PYTHON_IMAGE
# to build on an image you already have instead.
#
#   scripts/image.sh            # base (if missing) + both images
#   scripts/image.sh daemon     # base (if missing) + the daemon's image only
#   scripts/image.sh base       # print the base image's name, building it if missing
#
# IMAGE_TAG (default latest) tags the images; HANDLER_AWS_SERVICES (e.g. "dynamodb kms"):
# the AWS services your handlers call, whose botocore models the daemon's image keeps.
#
# Needs a running engine (scripts/engine.sh start) and root for debootstrap.
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$0")/.."
TAG=${IMAGE_TAG:-latest}
HANDLER_AWS_SERVICES=${HANDLER_AWS_SERVICES:-}
SUITE=bookworm
PACKAGES=python3,python3-venv,python-is-python3,ca-certificates
# The proxy in front of package servers may present its own CA: pip inside the build
# must trust what the host trusts.
HOST_CA=/etc/ssl/certs/ca-certificates.crt

# The base is rebuilt when its recipe changes (this file's base section) or the host's CA
# bundle changes; otherwise the engine's copy is reused.
recipe_hash() {
  { sed -n '/^base_image()/,/^}/p' "$SELF"; echo "$SUITE $PACKAGES"; cat "$HOST_CA" 2>/dev/null; } \
    | sha256sum | cut -c1-12
}

# The Debian mirror apt on this machine already uses, for the suite (deb822 or one-line).
debian_mirror() {
  python3 - "$SUITE" <<'PY'
import glob, sys
suite = sys.argv[1]
files = glob.glob("/etc/apt/sources.list") + sorted(glob.glob("/etc/apt/sources.list.d/*.list")) \
    + sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))
for path in files:
    text = open(path, encoding="utf-8", errors="replace").read()
    if path.endswith(".sources"):
        for stanza in text.split("\n\n"):
            f = {}
            for line in stanza.splitlines():
                if line.strip() and not line.startswith(("#", " ", "\t")) and ":" in line:
                    k, v = line.split(":", 1)
                    f[k.strip().lower()] = v.split()
            if "deb" in f.get("types", []) and suite in f.get("suites", []) and f.get("uris"):
                if f.get("enabled", ["yes"])[0] != "no":
                    print(f["uris"][0]); sys.exit(0)
    else:
        for line in text.splitlines():
            words = [w for w in line.split("#", 1)[0].split() if not w.startswith("[")]
            if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
                print(words[1]); sys.exit(0)
sys.exit(f"no '{suite}' Debian mirror found in /etc/apt/sources.list*")
PY
}

base_image() {
  local name="sqs-ingest-base:$SUITE-$(recipe_hash)"
  if docker image inspect "$name" >/dev/null 2>&1; then
    echo "$name"
    return
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "image.sh: building the base image needs root (debootstrap); or set PYTHON_IMAGE" >&2
    exit 1
  fi
  local mirror rootfs
  mirror=$(debian_mirror)
  rootfs=$(mktemp -d /var/tmp/sqs-ingest-rootfs.XXXXXX)
  trap 'rm -rf "$rootfs"' EXIT
  echo "building $name: debootstrap $SUITE from $mirror" >&2
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$mirror" \
    >"$rootfs.log" 2>&1 || { tail -n 20 "$rootfs.log" >&2; exit 1; }
  rm -f "$rootfs.log"
  cp "$HOST_CA" "$rootfs$HOST_CA"
  # Nothing at run time reads these; the package cache is debootstrap's download.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
  tar -C "$rootfs" -c . | docker import \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LANG=C.UTF-8" \
    --change "ENV PIP_CERT=$HOST_CA" \
    --change 'CMD ["python3"]' \
    - "$name" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  echo "$name"
}

build() {
  local base=$1 target=$2 image=$3
  echo "building $image (target $target, base $base)"
  # Legacy builder: BuildKit would fetch the `# syntax` frontend from a registry. Reconcile
  # first: the legacy builder walks every stage before its target, so the daemon build
  # afterwards reuses all of them from the cache.
  local log
  log=$(mktemp /tmp/sqs-ingest-build.XXXXXX)
  local lock
  lock=$(cat requirements/runtime.txt requirements/otel.txt requirements/reconcile.txt \
         | sha256sum | cut -d' ' -f1)
  if ! DOCKER_BUILDKIT=0 docker build --network host --build-arg "PYTHON_IMAGE=$base" \
      --build-arg "LOCK_SHA256=$lock" --build-arg "HANDLER_AWS_SERVICES=$HANDLER_AWS_SERVICES" \
      --target "$target" -t "$image" . >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "image.sh: building $image failed (full log: $log)" >&2
    exit 1
  fi
  rm -f "$log"
}

case "${1:-all}" in
base) base_image ;;
mirror) debian_mirror ;;  # the Debian mirror this machine's apt uses (scripts/first-run-bare.sh)
all)
  base=${PYTHON_IMAGE:-$(base_image)}
  build "$base" reconcile "sqs-ingest-reconcile:$TAG"
  build "$base" runtime "sqs-ingest:$TAG"
  docker image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' \
    | grep -E "^(sqs-ingest|sqs-ingest-reconcile):$TAG |^${base} " || true
  ;;
daemon)
  build "${PYTHON_IMAGE:-$(base_image)}" runtime "sqs-ingest:$TAG"
  ;;
*) echo "usage: $0 [all|daemon|base|mirror]" >&2; exit 64 ;;
esac

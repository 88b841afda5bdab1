#!/usr/bin/env bash
# Installs the named Debian packages (as root, without recommends, quietly): the one way the
# scripts here add what a fresh Debian 12 machine lacks.
set -euo pipefail
[ $# -gt 0 ] || exit 0
if [ "$(id -u)" != 0 ]; then
  echo "missing Debian packages ($*): run as root or apt-get install them" >&2
  exit 1
fi
echo "installing Debian packages: $*"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "$@" >/dev/null

#!/usr/bin/env bash
# A container engine for `make image` and the container tests, on a machine that has no
# init system running one: installs Debian's docker.io (and debootstrap, for the base
# image) when missing, starts dockerd in the background and waits until it answers.
#
#   scripts/engine.sh start    # no-op when `docker info` already works
#   scripts/engine.sh stop     # stops only a dockerd this script started
#   scripts/engine.sh status   # exit 0 when an engine answers
#
# dockerd runs with --iptables=false --bridge=none: no NAT rules are touched on the host,
# so containers (and `docker build`) use --network host.
set -euo pipefail
STATE=${ENGINE_STATE_DIR:-/run/sqs-ingest-engine}
START_TIMEOUT=${ENGINE_START_TIMEOUT:-60}

up() { docker info >/dev/null 2>&1; }

ensure_packages() {
  local need=()
  command -v dockerd >/dev/null || need+=(docker.io)
  command -v docker >/dev/null || need+=(docker.io)
  command -v debootstrap >/dev/null || need+=(debootstrap)
  [ ${#need[@]} -eq 0 ] || "$(dirname "$0")/apt-install.sh" "${need[@]}"
}

case "${1:-start}" in
start)
  ensure_packages
  if up; then
    echo "container engine already up"
    exit 0
  fi
  mkdir -p "$STATE"
  # setsid: a Ctrl-C in the terminal that started it must not stop the engine.
  setsid dockerd --iptables=false --bridge=none >"$STATE/dockerd.log" 2>&1 </dev/null &
  echo $! >"$STATE/dockerd.pid"
  deadline=$((SECONDS + START_TIMEOUT))
  until up; do
    if ! kill -0 "$(cat "$STATE/dockerd.pid")" 2>/dev/null || [ $SECONDS -ge $deadline ]; then
      echo "engine.sh: dockerd exited or did not answer within ${START_TIMEOUT}s; its log:" >&2
      tail -n 20 "$STATE/dockerd.log" >&2
      exit 1
    fi
    sleep 0.2
  done
  echo "container engine started (dockerd pid $(cat "$STATE/dockerd.pid"), log $STATE/dockerd.log)"
  ;;
stop)
  [ -f "$STATE/dockerd.pid" ] || { echo "no engine started by engine.sh"; exit 0; }
  pid=$(cat "$STATE/dockerd.pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  rm -f "$STATE/dockerd.pid"
  echo "container engine stopped"
  ;;
status) up ;;
*) echo "usage: $0 start|stop|status" >&2; exit 64 ;;
esac

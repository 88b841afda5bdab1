#!/usr/bin/env bash
# Times a newcomer's first command: `git clone` -> `make run` -> the first completed message
# (sqs_ingest_messages_processed_total{outcome="completed"} > 0 on /metrics), then stops the
# daemon and the services it started and removes the clone (README "Sizing" is not this;
# README "First run" quotes its figures).
#
#   scripts/first-run.sh [REPO]     # REPO: what to clone (default: this checkout)
#
# FIRST_RUN_REF=<commit> runs that commit of REPO. FIRST_RUN_KEEP=DIR keeps the clone at DIR/sqs-ingest (tests inspect it). Ports are picked
# free, so it runs beside another `make run`. Prints "first completed message after N s".
set -euo pipefail
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
TIMEOUT=${FIRST_RUN_TIMEOUT:-900}
work=${FIRST_RUN_KEEP:-$(mktemp -d /var/tmp/sqs-ingest-first-run.XXXXXX)}
mkdir -p "$work"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
export PG_PORT=${PG_PORT:-$(free_port)} SQS_PORT=${SQS_PORT:-$(free_port)}
export INGEST_HTTP_PORT=${INGEST_HTTP_PORT:-$(free_port)}

t0=$EPOCHREALTIME
git clone -q "$SRC" "$work/sqs-ingest"
cd "$work/sqs-ingest"
# FIRST_RUN_REF: a commit of SRC to run instead of its HEAD (the test passes `git stash create`).
[ -z "${FIRST_RUN_REF:-}" ] || git checkout -q "$FIRST_RUN_REF"
# make-run.log: each line prefixed with the seconds since the clone started (where time goes).
stamp() { local us; while IFS= read -r line; do
  us=$(( ${EPOCHREALTIME/./} - ${t0/./} )); printf '%4d.%d %s\n' $((us / 1000000)) $((us % 1000000 / 100000)) "$line"; done; }
setsid bash -c 'exec make run 2>&1' </dev/null > >(stamp >"$work/make-run.log") &
run_pid=$!
cleanup() {
  kill -TERM -- "-$run_pid" 2>/dev/null || true
  wait "$run_pid" 2>/dev/null || true
  scripts/services.sh stop >/dev/null 2>&1 || true
  # services.sh keeps a root's cluster outside the checkout, one directory per checkout.
  rm -rf "/var/tmp/sqs-ingest-$(printf %s "$PWD" | sha256sum | cut -c1-12)"
  [ -n "${FIRST_RUN_KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT

completed() {
  # Quiet: in a bare machine python3 appears (half-unpacked at first) while make run runs.
  python3 - "$INGEST_HTTP_PORT" 2>/dev/null <<'PY'
import sys, urllib.request
try:
    text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=1).read().decode()
except OSError:
    sys.exit(1)
done = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
           if line.startswith("sqs_ingest_messages_processed_total{") and 'outcome="completed"' in line)
sys.exit(0 if done > 0 else 1)
PY
}
while ! completed; do
  if ! kill -0 "$run_pid" 2>/dev/null; then
    echo "first-run: make run exited before a message completed; its log:" >&2
    tail -n 30 "$work/make-run.log" >&2
    exit 1
  fi
  if (( (${EPOCHREALTIME/./} - ${t0/./}) / 1000000 > TIMEOUT )); then
    echo "first-run: no completed message after ${TIMEOUT}s; make run's log:" >&2
    tail -n 30 "$work/make-run.log" >&2
    exit 1
  fi
  sleep 0.2
done
t1=$EPOCHREALTIME
us=$(( ${t1/./} - ${t0/./} ))
printf 'first completed message after %d.%d s\n' $((us / 1000000)) $((us % 1000000 / 100000))

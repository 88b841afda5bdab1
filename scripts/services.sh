#!/usr/bin/env bash
# Starts (or reuses) a throwaway PostgreSQL and the SQS emulator (moto server) on loopback
# for `make run`, creates the queue, and writes the connection settings to .run/env.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=$PWD/.run
PG_PORT=${PG_PORT:-55432}
SQS_PORT=${SQS_PORT:-4566}
QUEUE=${QUEUE:-sqs-ingest-dev}
mkdir -p "$RUN"
# As root, PostgreSQL runs as user postgres, who may not be able to enter the checkout (a
# clone under /root, a `mktemp -d`): its data then lives in a directory of its own outside,
# one per checkout. A cluster already made in .run/pg by an earlier version is kept.
PG_DIR=${PG_DIR:-$RUN/pg}
if [ "$(id -u)" = 0 ] && [ ! -d "$RUN/pg/data" ]; then
  PG_DIR=/var/tmp/sqs-ingest-$(printf %s "$PWD" | sha256sum | cut -c1-12)/pg
fi

pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1; }
BIN=$(pg_bin)
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
DB_USER=$([ "$(id -u)" = 0 ] && echo postgres || id -un)

start_postgres() {
  if ! pg_isready -q -h 127.0.0.1 -p "$PG_PORT" 2>/dev/null; then
    if [ ! -d "$PG_DIR/data" ]; then
      mkdir -p "$PG_DIR/sock"
      [ "$(id -u)" = 0 ] && chown -R postgres:postgres "$PG_DIR"
      as_pg "$BIN/initdb" -A trust -U "$DB_USER" -D "$PG_DIR/data" >/dev/null
    fi
    as_pg "$BIN/pg_ctl" -w -D "$PG_DIR/data" -l "$PG_DIR/server.log" start \
      -o "-p $PG_PORT -k $PG_DIR/sock -c listen_addresses=127.0.0.1" >/dev/null
    echo "postgresql started on 127.0.0.1:$PG_PORT (data in $PG_DIR)"
  else
    echo "postgresql already up on 127.0.0.1:$PG_PORT"
  fi
  psql -q -h 127.0.0.1 -p "$PG_PORT" -U "$DB_USER" -d postgres -tc \
    "SELECT 1 FROM pg_database WHERE datname = 'ingest'" | grep -q 1 \
    || psql -q -h 127.0.0.1 -p "$PG_PORT" -U "$DB_USER" -d postgres -c "CREATE DATABASE ingest"
}

case "${1:-start}" in
postgres)  # PostgreSQL alone: needs no venv, so `make run` starts it while the venv is built
  start_postgres
  ;;
start)
  start_postgres
  # The system python3, not the venv's: nothing here needs more than the standard library.
  http_ok() { python3 -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=1)" "$1" >/dev/null 2>&1; }
  if ! http_ok "http://127.0.0.1:$SQS_PORT/moto-api/"; then
    # Its own session: Ctrl-C on `make run` (SIGINT to the terminal's process group) stops
    # the daemon, not the emulator that stays up for next time.
    setsid .venv/bin/moto_server -H 127.0.0.1 -p "$SQS_PORT" >"$RUN/moto.log" 2>&1 </dev/null &
    echo $! >"$RUN/moto.pid"
    for _ in $(seq 1 100); do
      http_ok "http://127.0.0.1:$SQS_PORT/moto-api/" && break
      sleep 0.1
    done
    echo "moto server started on 127.0.0.1:$SQS_PORT"
  else
    echo "SQS emulator already up on 127.0.0.1:$SQS_PORT"
  fi
  export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID:-testing} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY:-testing}
  # SQS's query protocol over urllib: importing boto3 here cost ~6 s of the first run. moto
  # picks the service from the credential scope and checks no signature.
  url=$(python3 - "$SQS_PORT" "$QUEUE" <<'PY'
import re, sys, urllib.parse, urllib.request
form = {"Action": "CreateQueue", "QueueName": sys.argv[2], "Version": "2012-11-05",
        "Attribute.1.Name": "VisibilityTimeout", "Attribute.1.Value": "30"}
req = urllib.request.Request(
    f"http://127.0.0.1:{sys.argv[1]}/", data=urllib.parse.urlencode(form).encode(),
    headers={"Content-Type": "application/x-www-form-urlencoded",
             "Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/sqs/"
                              "aws4_request, SignedHeaders=host, Signature=0"})
body = urllib.request.urlopen(req, timeout=30).read().decode()
print(re.search(r"<QueueUrl>([^<]+)</QueueUrl>", body).group(1))
PY
)
  cat >"$RUN/env" <<ENV
export INGEST_DATABASE_URL=postgresql://$DB_USER@127.0.0.1:$PG_PORT/ingest
export INGEST_QUEUE_URL=$url
export INGEST_SQS_ENDPOINT_URL=http://127.0.0.1:$SQS_PORT
export AWS_ACCESS_KEY_ID=${AWS_ACCESS_KEY_ID} AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY}
ENV
  echo "queue: $url (settings in .run/env)"
  ;;
stop)
  [ -f "$RUN/moto.pid" ] && kill "$(cat "$RUN/moto.pid")" 2>/dev/null || true
  rm -f "$RUN/moto.pid"
  [ -d "$PG_DIR/data" ] && as_pg "$BIN/pg_ctl" -w -D "$PG_DIR/data" stop -m fast >/dev/null || true
  echo "stopped"
  ;;
*) echo "usage: $0 start|postgres|stop" >&2; exit 64 ;;
esac

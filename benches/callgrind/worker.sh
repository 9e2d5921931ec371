#!/usr/bin/env bash
# Counts the instructions a worker binary spends on N requests (two per recipient: half
# dispatched, half denied with a row), after start-up, under callgrind: an A/B figure of CPU
# work that repeats under any load, where seconds do not (docs/performance.md).
#
#   benches/callgrind/worker.sh BIN OUT [N]     e.g. target/release/sendquota /tmp/cg.out 6000
#
# Uses the local services (deploy/local/services.sh), a namespace and database of its own
# (dropped first), admin port 9191, and `sendquota tail` as the dispatch exchange's queue.
# Prints the program total; `callgrind_annotate OUT` shows where it went.
set -euo pipefail
BIN=$(realpath "$1"); OUT=$2; N=${3:-6000}
NS=cg$RANDOM
export SENDQUOTA_NAMESPACE=$NS SENDQUOTA_ADMIN_LISTEN=127.0.0.1:9191 SENDQUOTA_LOG=warn,lapin=off
admin=postgres://postgres@127.0.0.1:5432/postgres
psql "$admin" -qc "DROP DATABASE IF EXISTS callgrind_worker" > /dev/null 2>&1
psql "$admin" -qc "CREATE DATABASE callgrind_worker" >/dev/null
export SENDQUOTA_DATABASE_URL=postgres://postgres@127.0.0.1:5432/callgrind_worker
"$BIN" migrate >/dev/null
requests=$(mktemp /tmp/callgrind-requests.XXXXXX)
trap 'rm -f "$requests"; kill -INT ${TAIL:-} ${WORKER:-} 2>/dev/null || true' EXIT
for ((i = 0; i < N; i++)); do
  printf '{"id":"m%d","recipient":"r%d","channel":"sms","timezone":"UTC"}\n' "$i" $((i / 2))
done > "$requests"
"$BIN" tail > /dev/null 2>&1 &
TAIL=$!
valgrind --tool=callgrind --callgrind-out-file="$OUT" "$BIN" worker --now 2026-04-01T09:00:00Z \
  2> "$OUT.log" &
WORKER=$!
until curl -sf http://127.0.0.1:9191/readyz > /dev/null; do sleep 0.5; done
callgrind_control -z "$WORKER" > /dev/null 2>&1   # forget start-up
"$BIN" publish "$requests" > /dev/null
decided() {
  curl -s http://127.0.0.1:9191/metrics | awk '/^sendquota_decisions_total/ {s += $2} END {print s + 0}'
}
until [ "$(decided)" -ge "$N" ]; do sleep 1; done
kill -INT "$WORKER"; wait "$WORKER" || true
kill -INT "$TAIL"; wait "$TAIL" || true
echo "$(callgrind_annotate "$OUT" 2> /dev/null | grep 'PROGRAM TOTALS') over $N requests," \
  "load average $(cut -d' ' -f1 /proc/loadavg)"

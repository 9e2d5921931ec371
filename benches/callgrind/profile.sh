#!/usr/bin/env bash
# Profiles a worker binary on N requests (two per recipient: half dispatched, half denied with
# a row), after start-up: its instructions, which repeat under any load (callgrind, worker.sh
# runs this), or with the kernel in view, which instruction counts cannot see: the system
# calls and wake-ups between threads (perf, strace). docs/performance.md.
#
#   benches/callgrind/profile.sh callgrind BIN OUT [N]   instructions of every thread; prints
#                                                     the total; callgrind_annotate OUT
#   benches/callgrind/profile.sh perf   BIN OUT [N]   perf record -e cpu-clock of every thread;
#                                                     read: perf report -i OUT --sort comm,dso
#   benches/callgrind/profile.sh strace BIN OUT [N]   every system call by thread and fd, counted
#                                                     into OUT (strace's log is OUT.strace)
#
# Uses the local services, a namespace and database of its own (dropped first), admin port
# 9191, and `sendquota tail` as the dispatch exchange's queue; deletes its Redis keys and
# database at the end. The worker's log is OUT.log.
set -euo pipefail
TOOL=$1; BIN=$(realpath "$2"); OUT=$3; N=${4:-40000}
case $TOOL in
  callgrind) ;;
  perf) command -v perf > /dev/null || apt-get install -y linux-perf > /dev/null ;;
  strace) command -v strace > /dev/null || apt-get install -y strace > /dev/null ;;
  *) echo "usage: $0 callgrind|perf|strace BIN OUT [N]" >&2; exit 2 ;;
esac
NS=prof$RANDOM
export SENDQUOTA_NAMESPACE=$NS SENDQUOTA_ADMIN_LISTEN=127.0.0.1:9191 SENDQUOTA_LOG=warn,lapin=off
admin=postgres://postgres@127.0.0.1:5432/postgres
psql "$admin" -qc "DROP DATABASE IF EXISTS profile_worker" > /dev/null 2>&1
psql "$admin" -qc "CREATE DATABASE profile_worker" >/dev/null
export SENDQUOTA_DATABASE_URL=postgres://postgres@127.0.0.1:5432/profile_worker
"$BIN" migrate >/dev/null
requests=$(mktemp /tmp/profile-requests.XXXXXX)
trap 'rm -f "$requests"; kill -INT ${TAIL:-} ${WORKER:-} 2>/dev/null || true' EXIT
for ((i = 0; i < N; i++)); do
  printf '{"id":"m%d","recipient":"r%d","channel":"sms","timezone":"UTC"}\n' "$i" $((i / 2))
done > "$requests"
"$BIN" tail > /dev/null 2>&1 &
TAIL=$!
under=()
[ "$TOOL" = callgrind ] && under=(valgrind --tool=callgrind --callgrind-out-file="$OUT")
"${under[@]}" "$BIN" worker --now 2026-04-01T09:00:00Z 2> "$OUT.log" &
WORKER=$!
until curl -sf http://127.0.0.1:9191/readyz > /dev/null; do sleep 0.5; done
PROFILER=
case $TOOL in
  callgrind) callgrind_control -z "$WORKER" > /dev/null 2>&1 ;;  # forget start-up
  perf) perf record -e cpu-clock -F 2000 -g -o "$OUT" -p "$WORKER" 2> /dev/null &
    PROFILER=$! ;;
  strace) strace -f -o "$OUT.strace" -p "$WORKER" \
    -e trace=read,write,writev,sendto,recvfrom,futex,epoll_wait 2> /dev/null &
    PROFILER=$! ;;
esac
sleep 1
"$BIN" publish "$requests" > /dev/null
decided() {
  curl -s http://127.0.0.1:9191/metrics | awk '/^sendquota_decisions_total/ {s += $2} END {print s + 0}'
}
until [ "$(decided)" -ge "$N" ]; do sleep 0.2; done
if [ -n "$PROFILER" ]; then kill -INT "$PROFILER"; wait "$PROFILER" || true; fi
kill -INT "$WORKER"; wait "$WORKER" || true
kill -INT "$TAIL"; wait "$TAIL" || true
# The namespace's keys go (N requests leave about 2N); its queues stay on the broker, empty.
redis-cli --scan --pattern "$NS*" | xargs -r -n 1000 redis-cli unlink > /dev/null
psql "$admin" -qc "DROP DATABASE IF EXISTS profile_worker" > /dev/null 2>&1 || true
if [ "$TOOL" = strace ]; then
  # Per thread, system call and (for socket calls) file descriptor; lines strace split in two
  # ("<... resumed>") are counted once, at their start.
  grep -v 'resumed>' "$OUT.strace" | awk '{ split($2, call, "("); fd = "";
      if (call[1] != "futex" && call[1] != "epoll_wait") { split(call[2], arg, ","); fd = "fd " arg[1] }
      print "thread " $1, call[1], fd }' | sort | uniq -c | sort -rn > "$OUT"
  echo "$(grep -vc 'resumed>' "$OUT.strace") system calls over $N requests; by thread, call and fd in $OUT"
  head -n 12 "$OUT"
elif [ "$TOOL" = callgrind ]; then
  echo "$(callgrind_annotate "$OUT" 2> /dev/null | grep 'PROGRAM TOTALS') over $N requests," \
    "load average $(cut -d' ' -f1 /proc/loadavg)"
else
  perf report -i "$OUT" --no-children --sort comm,dso -g none 2> /dev/null | grep -v '^#' | grep -v '^$' | head -n 8
fi

#!/usr/bin/env bash
# Where a message's publish-to-dispatch latency goes, hop by hop, without touching the worker.
#
# The latency bench only sees end to end (publish instant to the sink's arrival); this captures
# the loopback traffic to RabbitMQ (5672) and Redis while COMMAND runs, then
# benches/latency/hops.py rebuilds each message's path from the packet timestamps:
#   t1 bench publishes -> t2 broker delivers to the worker -> EVALSHA sent -> Redis replies
#   -> t3 worker republishes -> t4 broker delivers to the sink consumer.
#
# Usage: benches/latency/trace.sh OUT.pcap [--redis-port P] -- COMMAND ARGS...
#   e.g. benches/latency/trace.sh /tmp/g.pcap -- target/release/deps/perf-HASH --bench \
#          --latency-rate 5000 --latency-seconds 5     ((g) alone; cargo bench --bench perf --no-run)
#   HOPS_ARGS="--skip-first-seconds 0" passes options on to hops.py; run hops.py on OUT.pcap
#   again to read it differently.
#
# Reading the output: one block per run (an id published again after it reached the sink starts
# the next run: a relay run has no Redis rows, the worker run does). Each hop's p50/p90/p99/max in
# ms: "broker: ..." rows are RabbitMQ's share, "worker: ..." rows the worker's own time around
# its Redis call, "Redis round trip" the wire-to-wire EVALSHA time. The "slowest 1%" block gives
# each hop's mean over the messages that make the end-to-end tail against its mean over all: the
# hop whose mean grows most is the one making the tail. Timestamps are taken by the kernel on lo,
# so a hop includes the receiving/sending process's scheduling and socket time. tcpdump itself
# costs CPU on a small machine: compare runs traced the same way, and check that it dropped no
# packets (printed below).
set -euo pipefail

usage() { echo "usage: $0 OUT.pcap [--redis-port P] -- COMMAND ARGS..." >&2; exit 2; }

[[ $# -ge 1 ]] || usage
out=$1; shift
redis_port=6379
while [[ $# -gt 0 ]]; do
  case $1 in
    --redis-port) [[ $# -ge 2 ]] || usage; redis_port=$2; shift 2 ;;
    --) shift; break ;;
    *) usage ;;
  esac
done
[[ $# -ge 1 ]] || usage
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

sudo_=""
[[ $(id -u) -eq 0 ]] || sudo_="sudo"
if ! command -v tcpdump >/dev/null 2>&1; then
  if ! $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y tcpdump >/dev/null; then
    $sudo_ apt-get update >/dev/null
    $sudo_ env DEBIAN_FRONTEND=noninteractive apt-get install -y tcpdump >/dev/null
  fi
fi
tcpdump_bin=$(command -v tcpdump)

errlog=$(mktemp)
tcpdump_pid=""
cleanup() {
  if [[ -n $tcpdump_pid ]] && kill -0 "$tcpdump_pid" 2>/dev/null; then
    $sudo_ kill -INT "$tcpdump_pid" 2>/dev/null || true
    wait "$tcpdump_pid" 2>/dev/null || true
  fi
  rm -f "$errlog"
}
trap cleanup EXIT

$sudo_ "$tcpdump_bin" -i lo -s 0 -B 16384 -w "$out" "tcp port 5672 or tcp port $redis_port" 2>"$errlog" &
tcpdump_pid=$!
for _ in $(seq 50); do  # until it says it is listening (at most ~5 s)
  grep -q "listening on" "$errlog" && break
  kill -0 "$tcpdump_pid" 2>/dev/null || { cat "$errlog" >&2; echo "tcpdump failed" >&2; exit 1; }
  sleep 0.1
done
grep -q "listening on" "$errlog" || { cat "$errlog" >&2; echo "tcpdump did not start" >&2; exit 1; }
sleep 0.2

status=0
"$@" || status=$?

$sudo_ kill -INT "$tcpdump_pid"
wait "$tcpdump_pid" || true
tcpdump_pid=""
echo "tcpdump: $(grep -E 'packets (captured|received by filter|dropped by kernel)' "$errlog" | paste -sd ';' -)"
dropped=$(sed -n 's/^\([0-9]*\) packets dropped by kernel.*/\1/p' "$errlog")
if [[ ${dropped:-0} -ne 0 ]]; then
  echo "WARNING: tcpdump dropped $dropped packets: hops may be incomplete" >&2
fi
[[ $status -eq 0 ]] || echo "WARNING: the command exited with status $status" >&2

# shellcheck disable=SC2086  # HOPS_ARGS is a list of options
python3 "$here/hops.py" "$out" --redis-port "$redis_port" ${HOPS_ARGS:-}
exit "$status"

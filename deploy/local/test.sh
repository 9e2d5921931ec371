#!/usr/bin/env bash
# Runs the whole test suite against local RabbitMQ and PostgreSQL, starting them first when they
# do not answer (and installing the tools the tests run: deploy/local/tools.sh), against a
# private Redis plus a private 3-master Redis Cluster on free ports
# (SENDQUOTA_TEST_REDIS_CLUSTER_URLS), and against TLS-only servers of all three kinds started
# once for the run (deploy/local/tls-servers.sh, SENDQUOTA_TEST_TLS_*). Runs the tests with
# cargo-nextest when installed (and prints the slowest), else with cargo test; extra arguments go
# to that command (`deploy/local/test.sh tls::`, a filter on the module).
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/services.sh
deploy/local/tools.sh
redis_dir=$(mktemp -d /tmp/sendquota-redis.XXXXXX)
tls_dir=$(mktemp -d /tmp/sendquota-tls.XXXXXX)
# The run's status is the tests' own: a hiccup while stopping the private servers (under set -e
# the first failing command of the trap would become the exit status) must not turn it.
trap 'rc=$?; set +e; deploy/local/redis-private.sh stop "$redis_dir"; deploy/local/tls-servers.sh stop "$tls_dir"; exit $rc' EXIT
# The TLS servers take about 10 s to start (RabbitMQ's boot): they start while the tests build.
deploy/local/tls-servers.sh start "$tls_dir" > "$tls_dir.env" &
tls_started=$!
# The suite's own Redis, empty at the start: tests scan their namespaces, and a shared server
# holding a million keys some interrupted program left (a bench, say) made each scan take
# seconds and CI run out of time. SENDQUOTA_TEST_SHARED_REDIS=1 uses SENDQUOTA_REDIS_URL instead.
if [ "${SENDQUOTA_TEST_SHARED_REDIS:-0}" != 1 ]; then
  SENDQUOTA_REDIS_URL=$(deploy/local/redis-private.sh single "$redis_dir")
  export SENDQUOTA_REDIS_URL
fi
SENDQUOTA_TEST_REDIS_CLUSTER_URLS=$(deploy/local/redis-private.sh cluster "$redis_dir")
export SENDQUOTA_TEST_REDIS_CLUSTER_URLS
echo "test.sh: redis at ${SENDQUOTA_REDIS_URL:-redis://127.0.0.1:6379}, cluster at $SENDQUOTA_TEST_REDIS_CLUSTER_URLS" >&2
# What else is using the machine: the suite's timings (and its Redis timeouts) depend on it.
echo "test.sh: $(uptime)" >&2
ps -eo pcpu,rss,etime,comm --sort=-pcpu 2>/dev/null | head -n 6 >&2 || true
cargo test --locked --features failpoints --no-run "$@"
wait "$tls_started" || { echo "test.sh: the TLS servers did not start (above)" >&2; exit 1; }
# shellcheck disable=SC1090
source "$tls_dir.env"
rm -f "$tls_dir.env"
# A hang must fail CI with a message, not use up its whole budget: the suite takes a few minutes.
status=0
log=$(mktemp /tmp/sendquota-test-log.XXXXXX)
if cargo nextest --version >/dev/null 2>&1; then
  # One process per test, each test's duration reported (.config/nextest.toml kills a test
  # that runs over 5 minutes).
  timeout --kill-after=30 "${SENDQUOTA_TEST_TIMEOUT_S:-1800}" \
    cargo nextest run --locked --features failpoints "$@" 2>&1 | tee "$log" || status=${PIPESTATUS[0]}
  echo "test.sh: the slowest tests (seconds):" >&2
  sed -nE 's/^ *(PASS|FAIL|SIGKILL|TIMEOUT|SIGSEGV|SIGABRT) \[ *([0-9.]+)s\] (\([ 0-9/]+\) )?(.*)$/\2 \1 \4/p' "$log" \
    | sort -rnu | head -n 12 >&2 || true  # head closing the pipe early is not a failure
else
  echo "test.sh: cargo-nextest is not installed; running cargo test (no per-test durations)" >&2
  timeout --kill-after=30 "${SENDQUOTA_TEST_TIMEOUT_S:-1800}" cargo test --locked --features failpoints "$@" || status=$?
fi
rm -f "$log"
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
  echo "test.sh: the tests did not finish within ${SENDQUOTA_TEST_TIMEOUT_S:-1800} s; the tests" \
    "reported as SLOW above are the ones that hung" >&2
fi
exit "$status"

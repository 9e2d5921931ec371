#!/usr/bin/env bash
# Runs the whole test suite against local Redis, RabbitMQ and PostgreSQL, starting them first
# when they do not answer, plus a private 3-master Redis Cluster on free ports for the cluster
# tests (SENDQUOTA_TEST_REDIS_CLUSTER_URLS). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/services.sh
cluster_dir=$(mktemp -d /tmp/sendquota-cluster.XXXXXX)
trap 'deploy/local/redis-cluster.sh stop "$cluster_dir"' EXIT
SENDQUOTA_TEST_REDIS_CLUSTER_URLS=$(deploy/local/redis-cluster.sh start "$cluster_dir")
export SENDQUOTA_TEST_REDIS_CLUSTER_URLS
echo "test.sh: redis cluster at $SENDQUOTA_TEST_REDIS_CLUSTER_URLS" >&2
# What else is using the machine: the suite's timings (and its Redis timeouts) depend on it.
echo "test.sh: $(uptime)" >&2
ps -eo pcpu,rss,etime,comm --sort=-pcpu | head -n 6 >&2
cargo test --locked --no-run "$@"
# A hang must fail CI with a message, not use up its whole budget: the suite takes a few minutes.
status=0
timeout --kill-after=30 "${SENDQUOTA_TEST_TIMEOUT_S:-1800}" cargo test --locked "$@" || status=$?
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
  echo "test.sh: the tests did not finish within ${SENDQUOTA_TEST_TIMEOUT_S:-1800} s; the tests" \
    "reported 'running for over 60 seconds' above are the ones that hung" >&2
fi
exit "$status"

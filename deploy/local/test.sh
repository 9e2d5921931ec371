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
cargo test --locked "$@"

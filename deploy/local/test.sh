#!/usr/bin/env bash
# Runs the whole test suite against local Redis, RabbitMQ and PostgreSQL, starting them first
# when they do not answer. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/services.sh
cargo test --locked "$@"

#!/usr/bin/env bash
# Runs the worker against local Redis, RabbitMQ and PostgreSQL, starting them first when they
# do not answer, creating the database and applying migrations. Extra arguments go to
# `sendquota worker` (for example --now 2026-03-08T12:00:00Z).
set -euo pipefail
cd "$(dirname "$0")/../.."
deploy/local/services.sh
DATABASE_URL=${SENDQUOTA_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/sendquota}
db=${DATABASE_URL##*/}; db=${db%%\?*}
admin_url=${DATABASE_URL%/*}/postgres
if ! psql "$admin_url" -Atc "SELECT 1 FROM pg_database WHERE datname = '$db'" | grep -q 1; then
  psql "$admin_url" -qc "CREATE DATABASE \"$db\""
fi
cargo build --release --locked
target/release/sendquota migrate
exec target/release/sendquota worker "$@"

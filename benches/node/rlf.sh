#!/usr/bin/env bash
# Why this exists: sendquota's headline decision path is compared with
# rate-limiter-flexible (Node.js, RateLimiterRedis over ioredis) on the same
# Redis, in alternating runs. This script runs the Node side of that
# comparison (rlf.js): N "all allowed" consumes, each on a new key, with C in
# flight, printing decisions per second; it deletes its keys when done.
#
# Usage:
#   benches/node/rlf.sh REDIS_URL [rlf.js args...]
#   e.g. benches/node/rlf.sh redis://127.0.0.1:6399 --decisions 60000 --concurrency 50 --slices 4
#        benches/node/rlf.sh redis://127.0.0.1:6399 --auto-pipelining 1
# rlf.js args: [--decisions N] [--concurrency C] [--slices S] [--auto-pipelining 0|1]
# (defaults N=60000, C=50, S=1, auto-pipelining 0 = ioredis's default).
# Installs the pinned packages from package-lock.json (npm ci) the first time.
# Use a private Redis: the run writes N+1000 keys under a random prefix.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  sed -n '2,15p' "$0" >&2
  exit 2
fi
url="$1"
shift

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
if [[ ! -d node_modules ]]; then
  npm ci --no-audit --no-fund --loglevel=error >/dev/null
fi
exec node rlf.js --url "$url" "$@"

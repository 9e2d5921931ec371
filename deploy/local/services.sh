#!/usr/bin/env bash
# Makes sure Redis, RabbitMQ and PostgreSQL answer at the configured URLs.
# Reuses whatever already answers; otherwise starts the locally installed servers; installs the
# Debian packages first when a server is not installed and apt-get is available.
# Exits non-zero, naming the service, if one cannot be brought up.
set -euo pipefail

REDIS_URL=${SENDQUOTA_REDIS_URL:-redis://127.0.0.1:6379}
AMQP_URL=${SENDQUOTA_AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}
DATABASE_URL=${SENDQUOTA_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/sendquota}

# host and port of a URL such as scheme://user:pass@host:port/path
host_of() { local a=${1#*://}; a=${a%%/*}; a=${a##*@}; echo "${a%%:*}"; }
port_of() { local a=${1#*://}; a=${a%%/*}; a=${a##*@}; [[ $a == *:* ]] && echo "${a##*:}" || echo "$2"; }

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

wait_for() { # name host port seconds
  local i
  for ((i = 0; i < $4 * 4; i++)); do
    answers "$2" "$3" && return 0
    sleep 0.25
  done
  echo "services.sh: $1 did not come up at $2:$3 within $4 s" >&2
  return 1
}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else "$@"; fi; }

install_pkg() { # command package
  command -v "$1" >/dev/null && return 0
  [ -x "/usr/sbin/$1" ] && return 0
  if command -v apt-get >/dev/null; then
    echo "services.sh: installing $2" >&2
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
  fi
}

ensure_redis() {
  local h p; h=$(host_of "$REDIS_URL"); p=$(port_of "$REDIS_URL" 6379)
  answers "$h" "$p" && return 0
  install_pkg redis-server redis-server
  echo "services.sh: starting redis-server on port $p" >&2
  mkdir -p /tmp/sendquota-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port "$p" --save "" --appendonly no \
    --dir /tmp/sendquota-redis --logfile /tmp/sendquota-redis/redis.log
  wait_for redis "$h" "$p" 20
}

ensure_postgres() {
  local h p; h=$(host_of "$DATABASE_URL"); p=$(port_of "$DATABASE_URL" 5432)
  answers "$h" "$p" && return 0
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then install_pkg psql postgresql; fi
  echo "services.sh: starting postgresql" >&2
  local v; v=$(ls /etc/postgresql | sort -V | tail -n 1)
  as_root pg_ctlcluster --skip-systemctl-redirect "$v" main start || true
  wait_for postgres "$h" "$p" 60
}

ensure_rabbitmq() {
  local h p; h=$(host_of "$AMQP_URL"); p=$(port_of "$AMQP_URL" 5672)
  if ! answers "$h" "$p"; then
    install_pkg rabbitmq-server rabbitmq-server
    echo "services.sh: starting rabbitmq-server" >&2
    as_root rabbitmq-server -detached || true
    wait_for rabbitmq "$h" "$p" 90
  fi
  enable_hash_exchange "$h"
}

# `intake.shards` > 1 needs the consistent-hash exchange type (shipped with RabbitMQ, off by
# default). Enabled online on a local broker; a remote one is its operator's to enable.
enable_hash_exchange() {
  case "$1" in 127.0.0.1 | localhost) ;; *) return 0 ;; esac
  command -v rabbitmq-plugins >/dev/null || [ -x /usr/sbin/rabbitmq-plugins ] || return 0
  as_root rabbitmq-plugins list -e 2>/dev/null | grep -q rabbitmq_consistent_hash_exchange && return 0
  echo "services.sh: enabling rabbitmq_consistent_hash_exchange" >&2
  as_root rabbitmq-plugins enable rabbitmq_consistent_hash_exchange >/dev/null \
    || echo "services.sh: could not enable rabbitmq_consistent_hash_exchange (intake.shards > 1 needs it)" >&2
}

ensure_redis
ensure_postgres
ensure_rabbitmq
echo "services.sh: redis, postgres and rabbitmq answer" >&2

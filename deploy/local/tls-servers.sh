#!/usr/bin/env bash
# Starts TLS-only servers on free ports for the TLS tests, everything kept in one directory:
# a throwaway CA and certificates, one Redis, a 3-master Redis Cluster, a private RabbitMQ node
# and a private PostgreSQL 15 cluster. None of them has a plaintext listener.
#   deploy/local/tls-servers.sh start DIR   generates the certificates, starts the servers and
#                                           prints `export NAME=value` lines (also written to
#                                           DIR/env): eval "$(deploy/local/tls-servers.sh start DIR)"
#   deploy/local/tls-servers.sh stop DIR    stops every server started in DIR and removes DIR
#                                           (safe to repeat, and after a failed or interrupted start)
# Runs as root: the RabbitMQ node runs as user rabbitmq and PostgreSQL as user postgres, so DIR
# must be reachable by both (it is made 0755; its parent directories must allow traversal).
# Progress and errors go to stderr; stdout carries only the export lines.
set -euo pipefail
me=tls-servers.sh
usage="usage: $me start|stop DIR"
cmd=${1:?$usage}
dir=${2:?$usage}
PG_BIN=/usr/lib/postgresql/15/bin

say() { echo "$me: $*" >&2; }
die() { say "$*"; exit 1; }

case "$dir" in /*) ;; *) dir="$PWD/$dir" ;; esac
while [[ $dir == */ && $dir != / ]]; do dir=${dir%/}; done
# The paths go unquoted into config files and into the printed export lines.
[[ $dir =~ ^/[A-Za-z0-9._/+-]+$ ]] || die "DIR must be a path of letters, digits and ._/+- only: $dir"
[ "$dir" != / ] || die "DIR must not be /"
# PostgreSQL's socket, DIR/pg/.s.PGSQL.PORT, must fit in a unix socket path (107 bytes).
((${#dir} <= 85)) || die "DIR is too long for PostgreSQL's unix socket path (85 characters at most): $dir"

# Ports below the kernel's ephemeral range (and port+10000 too, for the cluster bus): a port in
# that range can be the local end of some outgoing connection, which refuses connects (so it
# looks free) but makes a bind fail.
ephemeral_low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
taken=" "
pick_port() { # VAR: sets VAR to a free port not picked before in this run
  local _pp
  for _ in $(seq 1 200); do
    _pp=$((10000 + RANDOM % (ephemeral_low - 20000)))
    [[ $taken == *" $_pp "* || $taken == *" $((_pp + 10000)) "* || $taken == *" $((_pp - 10000)) "* ]] && continue
    if ! (exec 3<>/dev/tcp/127.0.0.1/$_pp) 2>/dev/null && ! (exec 3<>/dev/tcp/127.0.0.1/$((_pp + 10000))) 2>/dev/null; then
      taken+="$_pp "
      printf -v "$1" '%s' "$_pp"
      return 0
    fi
  done
  die "no free port found"
}

# PIDs of the beam.smp process(es) of RabbitMQ node $1 (its name is only in their environment).
node_pids() {
  local f pid comm
  for f in /proc/[0-9]*/comm; do
    comm=
    read -r comm 2>/dev/null <"$f" || continue
    [ "$comm" = beam.smp ] || continue
    pid=${f#/proc/}; pid=${pid%/comm}
    # grep -z reads the NUL-separated environment itself: `tr | grep -q` under pipefail failed
    # with SIGPIPE whenever grep stopped reading before tr had written everything.
    grep -qxz "RABBITMQ_NODENAME=$1" "/proc/$pid/environ" 2>/dev/null && echo "$pid"
  done
  return 0
}

# Is $1 (a pid) alive and its command name $2?
alive_as() {
  local comm=
  [ -n "$1" ] && read -r comm 2>/dev/null <"/proc/$1/comm" && [ "$comm" = "$2" ]
}

kill_and_wait() { # comm pid...
  local comm=$1 p; shift
  for p in "$@"; do alive_as "$p" "$comm" && kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 1 100); do
    local any=0
    for p in "$@"; do alive_as "$p" "$comm" && any=1; done
    [ "$any" = 0 ] && return 0
    sleep 0.1
  done
  for p in "$@"; do alive_as "$p" "$comm" && kill -KILL "$p" 2>/dev/null; done
  return 0
}

rabbit_env() { # the environment of the private node, for rabbitmq-server, -ctl and -plugins
  local r=$dir/rabbitmq
  env RABBITMQ_NODENAME="$node" RABBITMQ_DIST_PORT="$dist_port" \
    RABBITMQ_CONFIG_FILE="$r/rabbitmq.conf" RABBITMQ_ADVANCED_CONFIG_FILE="$r/advanced.config" \
    RABBITMQ_MNESIA_BASE="$r/mnesia" RABBITMQ_LOG_BASE="$r/log" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$r/enabled_plugins" RABBITMQ_PID_FILE="$r/pid" "$@"
}

stop_redis() { # port
  timeout 5 redis-cli --tls --cacert "$dir/ca.pem" -h 127.0.0.1 -p "$1" shutdown nosave </dev/null >/dev/null 2>&1 || true
  kill_and_wait redis-server $(cat "$dir/redis/redis-$1.pid" 2>/dev/null || true)
}

stop_rabbit() { # node dist_port
  local node=$1 dist_port=$2
  [ -n "$(node_pids "$node")" ] || return 0
  say "stopping rabbitmq $node"
  rabbit_env timeout 60 rabbitmqctl -q -n "$node" stop </dev/null >/dev/null 2>&1 || true
  kill_and_wait beam.smp $(node_pids "$node")
}

stop_postgres() { # data dir
  [ -f "$1/postmaster.pid" ] || return 0
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$1" -m fast -w -t 30 stop </dev/null >/dev/null 2>&1 || true
  kill_and_wait postgres $(head -n 1 "$1/postmaster.pid" 2>/dev/null || true)
}

# Stops whatever DIR/state says was started, all at once; leaves DIR itself.
stop_servers() {
  [ -f "$dir/state" ] || return 0
  local kind a b line job lines=() jobs=()
  mapfile -t lines <"$dir/state"
  for line in "${lines[@]}"; do
    read -r kind a b <<<"$line" || continue
    case "$kind" in
      redis) stop_redis "$a" & jobs+=($!) ;;
      rabbitmq) stop_rabbit "$a" "$b" & jobs+=($!) ;;
      postgres) stop_postgres "$a" & jobs+=($!) ;;
    esac
  done
  for job in "${jobs[@]}"; do wait "$job" || true; done
}

# Prints why $1 failed and the end of each existing log given, and exits (the EXIT trap stops
# what was started).
fail() {
  local what=$1 log; shift
  say "FAILED: $what"
  for log in "$@"; do
    if [[ $log == head:* ]]; then
      log=${log#head:}
      [ -s "$log" ] || continue
      say "first lines of $log:"
      head -n 12 "$log" | sed 's/^/    /' >&2
    else
      [ -s "$log" ] || continue
      say "last lines of $log:"
      tail -n 25 "$log" | sed 's/^/    /' >&2
    fi
  done
  exit 1
}

write_openssl_cnf() {
  cat >"$dir/openssl.cnf" <<'EOF'
[req]
distinguished_name = dn
prompt = no
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
# clientAuth too: Redis cluster nodes present this certificate to each other on the bus.
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EOF
}

newkey() { # name: an RSA key, PKCS#8 PEM (-----BEGIN PRIVATE KEY-----), mode 0600
  (umask 077 && openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$dir/$1.key" 2>/dev/null)
}

sign() { # name CN extensions-section: a certificate for $name.key signed by our CA
  openssl req -new -config "$dir/openssl.cnf" -key "$dir/$1.key" -subj "/CN=$2" -out "$dir/$1.csr"
  openssl x509 -req -in "$dir/$1.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days 30 -extfile "$dir/openssl.cnf" -extensions "$3" \
    -out "$dir/$1.pem" 2>/dev/null
  rm -f "$dir/$1.csr"
  chmod 0644 "$dir/$1.pem"
  openssl verify -CAfile "$dir/ca.pem" "$dir/$1.pem" >/dev/null
}

self_signed_ca() { # name CN
  openssl req -x509 -config "$dir/openssl.cnf" -extensions ca -key "$dir/$1.key" -subj "/CN=$2" \
    -days 30 -out "$dir/$1.pem"
  chmod 0644 "$dir/$1.pem"
}

# What the servers need: the CA and the server certificate (two RSA keys made in parallel).
make_server_certs() {
  newkey ca & local job=$!
  newkey server
  wait "$job"
  self_signed_ca ca "sendquota test CA"
  sign server localhost server
}

# What only the tests need; runs in the background while the servers start.
make_client_certs() {
  trap - EXIT
  newkey client & local job=$!
  newkey wrong-ca
  wait "$job"
  sign client guest client
  self_signed_ca wrong-ca "sendquota unrelated test CA"
  grep -q -- '-----BEGIN PRIVATE KEY-----' "$dir/client.key" || { echo "$me: client.key is not PKCS#8" >&2; exit 1; }
}

launch_rabbit() {
  local r=$dir/rabbitmq
  mkdir -p "$r/mnesia" "$r/log"
  cp "$dir/ca.pem" "$dir/server.pem" "$dir/server.key" "$r/"
  echo '[rabbitmq_auth_mechanism_ssl].' >"$r/enabled_plugins"
  cat >"$r/rabbitmq.conf" <<EOF
listeners.tcp = none
listeners.ssl.default = 127.0.0.1:$amqp_port
ssl_options.cacertfile = $r/ca.pem
ssl_options.certfile = $r/server.pem
ssl_options.keyfile = $r/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
loopback_users = none
EOF
  chown -R rabbitmq:rabbitmq "$r"
  chmod 0750 "$r"
  chmod 0600 "$r/server.key"
  echo "rabbitmq $node $dist_port" >>"$dir/state"
  say "starting rabbitmq $node on 127.0.0.1:$amqp_port (TLS only)"
  # In the foreground (not -detached, whose output is lost), in its own session, in the
  # background: a failed boot's reason (a config error, say) lands in server.out.
  rabbit_env setsid rabbitmq-server </dev/null >"$r/server.out" 2>&1 &
  rabbit_job=$!
}

proc_alive() { # pid: running, not a zombie
  local stat
  read -r stat 2>/dev/null <"/proc/$1/stat" || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

wait_rabbit() {
  local r=$dir/rabbitmq deadline=$((SECONDS + 120))
  local logs=("head:$r/server.out" "$r/log/$node.log")
  until tls_answers "$amqp_port"; do
    proc_alive "$rabbit_job" || fail "rabbitmq ($node, port $amqp_port): the node exited" "${logs[@]}"
    ((SECONDS < deadline)) || fail "rabbitmq ($node, port $amqp_port): no TLS listener within 120 s" "${logs[@]}"
    sleep 0.2
  done
  say "rabbitmq answers over TLS on 127.0.0.1:$amqp_port"
}

# Does a TLS server on port $1 answer with a certificate that verifies against our CA?
tls_answers() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null || return 1
  timeout 5 openssl s_client -connect "127.0.0.1:$1" -CAfile "$dir/ca.pem" -verify_ip 127.0.0.1 \
    -verify_return_error </dev/null 2>&1 | grep -q 'Verify return code: 0 (ok)'
}

start_postgres() { # runs in the background
  trap - EXIT
  local pg=$dir/pg
  mkdir -p "$pg"
  cp "$dir/ca.pem" "$dir/server.pem" "$dir/server.key" "$pg/"
  chown -R postgres:postgres "$pg"
  chmod 0755 "$pg"
  chmod 0600 "$pg/server.key"
  echo "postgres $pg/data" >>"$dir/state"
  runuser -u postgres -- "$PG_BIN/initdb" -D "$pg/data" -A trust -U postgres --no-sync -E UTF8 \
    --locale=C.UTF-8 >"$pg/initdb.log" 2>&1 || { echo "initdb failed" >>"$pg/initdb.log"; exit 1; }
  cat >>"$pg/data/postgresql.conf" <<EOF

# tls-servers.sh
listen_addresses = '127.0.0.1'
port = $pg_port
unix_socket_directories = '$pg'
ssl = on
ssl_cert_file = '$pg/server.pem'
ssl_key_file = '$pg/server.key'
ssl_ca_file = '$pg/ca.pem'
EOF
  cat >"$pg/data/pg_hba.conf" <<EOF
# tls-servers.sh: TLS only over TCP; the unix socket (in $pg) is for setup
local     all all              trust
hostssl   all all 127.0.0.1/32 trust
hostnossl all all 127.0.0.1/32 reject
EOF
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$pg/data" -l "$pg/postgres.log" -w -t 60 start \
    >"$pg/pg_ctl.log" 2>&1 || exit 1
  "$PG_BIN/psql" -h "$pg" -p "$pg_port" -U postgres -d postgres -qAtX -v ON_ERROR_STOP=1 \
    -c 'create database sendquota' >>"$pg/pg_ctl.log" 2>&1 || exit 1
}

redis_tls() { # port args...: redis-cli over TLS
  local p=$1; shift
  timeout 5 redis-cli --tls --cacert "$dir/ca.pem" -h 127.0.0.1 -p "$p" "$@"
}

launch_redis() { # port [extra redis-server args]
  local p=$1; shift
  echo "redis $p" >>"$dir/state"
  redis-server --port 0 --tls-port "$p" --bind 127.0.0.1 \
    --tls-cert-file "$dir/server.pem" --tls-key-file "$dir/server.key" \
    --tls-ca-cert-file "$dir/ca.pem" --tls-auth-clients optional \
    --save "" --appendonly no --daemonize yes --dir "$dir/redis" \
    --logfile "$dir/redis/redis-$p.log" --pidfile "$dir/redis/redis-$p.pid" "$@" \
    >>"$dir/redis/launch.log" 2>&1 || fail "redis (port $p)" "$dir/redis/launch.log" "$dir/redis/redis-$p.log"
}

wait_redis() { # port
  for _ in $(seq 1 100); do
    [ "$(redis_tls "$1" ping 2>/dev/null)" = PONG ] && return 0
    sleep 0.1
  done
  fail "redis (port $1): no PONG over TLS" "$dir/redis/redis-$1.log"
}

start_redis() {
  mkdir -p "$dir/redis"
  say "starting redis on 127.0.0.1:$redis_port and a redis cluster on ${cluster_ports[*]} (TLS only)"
  launch_redis "$redis_port"
  local p
  for p in "${cluster_ports[@]}"; do
    launch_redis "$p" --cluster-enabled yes --cluster-config-file "nodes-$p.conf" \
      --cluster-port $((p + 10000)) --tls-cluster yes --tls-replication yes
  done
  for p in "$redis_port" "${cluster_ports[@]}"; do wait_redis "$p"; done
  timeout 60 redis-cli --tls --cacert "$dir/ca.pem" --cluster create "${cluster_ports[@]/#/127.0.0.1:}" \
    --cluster-replicas 0 --cluster-yes >"$dir/redis/create.log" 2>&1 ||
    fail "redis cluster create" "$dir/redis/create.log"
  local ok=0
  for _ in $(seq 1 200); do
    ok=1
    for p in "${cluster_ports[@]}"; do
      redis_tls "$p" cluster info 2>/dev/null | grep -q 'cluster_state:ok' || { ok=0; break; }
    done
    [ "$ok" = 1 ] && break
    sleep 0.1
  done
  [ "$ok" = 1 ] || fail "redis cluster: no cluster_state:ok on every node within 20 s" \
    "$dir/redis/create.log" "${cluster_ports[@]/#/$dir/redis/redis-}"
  say "redis and the redis cluster answer over TLS"
}

start() {
  [ "$(id -u)" = 0 ] || die "must run as root (the servers run as users rabbitmq and postgres)"
  local bin
  for bin in openssl redis-server redis-cli rabbitmq-server rabbitmqctl runuser "$PG_BIN/initdb" \
    "$PG_BIN/pg_ctl" "$PG_BIN/psql"; do
    command -v "$bin" >/dev/null || die "$bin is not installed (deploy/local/services.sh installs the servers)"
  done
  [ ! -e "$dir/state" ] || die "$dir is in use already; run: $me stop $dir"
  mkdir -p "$dir"
  chmod 0755 "$dir"
  local user
  for user in rabbitmq postgres; do
    runuser -u "$user" -- test -x "$dir" ||
      die "user $user cannot reach $dir (a parent directory is not searchable by it); pick a DIR under /tmp"
  done
  : >"$dir/state"
  done_ok=0 pg_job= certs_job= rabbit_job=
  trap on_exit EXIT
  trap 'exit 130' INT TERM HUP

  say "generating certificates in $dir"
  write_openssl_cnf
  make_server_certs
  make_client_certs </dev/null >&2 2>"$dir/client-certs.log" &
  certs_job=$!
  pick_port redis_port
  cluster_ports=()
  for _ in 1 2 3; do pick_port p; cluster_ports+=("$p"); done
  pick_port amqp_port
  pick_port dist_port
  pick_port pg_port
  node=sqtls$amqp_port@localhost

  # RabbitMQ takes seconds to boot: launch it first, and Postgres in the background, then Redis.
  launch_rabbit
  say "starting postgres on 127.0.0.1:$pg_port (TLS only)"
  start_postgres </dev/null >&2 &
  pg_job=$!
  start_redis
  local st=0
  wait "$pg_job" || st=$?
  pg_job=
  [ "$st" = 0 ] || fail "postgres (port $pg_port)" "$dir/pg/initdb.log" "$dir/pg/pg_ctl.log" "$dir/pg/postgres.log"
  say "postgres answers on 127.0.0.1:$pg_port"
  st=0
  wait "$certs_job" || st=$?
  certs_job=
  [ "$st" = 0 ] || fail "generating the client certificates" "$dir/client-certs.log"
  wait_rabbit

  local urls
  urls=$(printf 'rediss://127.0.0.1:%s,' "${cluster_ports[@]}")
  cat >"$dir/env" <<EOF
export SENDQUOTA_TEST_TLS_CA=$dir/ca.pem
export SENDQUOTA_TEST_TLS_WRONG_CA=$dir/wrong-ca.pem
export SENDQUOTA_TEST_TLS_CLIENT_CERT=$dir/client.pem
export SENDQUOTA_TEST_TLS_CLIENT_KEY=$dir/client.key
export SENDQUOTA_TEST_TLS_REDIS_URL=rediss://127.0.0.1:$redis_port
export SENDQUOTA_TEST_TLS_REDIS_CLUSTER_URLS=${urls%,}
export SENDQUOTA_TEST_TLS_AMQP_URL=amqps://guest:guest@127.0.0.1:$amqp_port/%2f
export SENDQUOTA_TEST_TLS_DATABASE_URL=postgres://postgres@127.0.0.1:$pg_port/sendquota?sslmode=verify-full
export SENDQUOTA_TEST_TLS_DIR=$dir
EOF
  done_ok=1
  cat "$dir/env"
  say "all servers up (rabbitmq node $node, dist port $dist_port); stop them with: $me stop $dir"
}

on_exit() {
  local st=$?
  [ "$done_ok" = 1 ] && return 0
  [ -n "$pg_job" ] && wait "$pg_job" 2>/dev/null || true
  [ -n "$certs_job" ] && wait "$certs_job" 2>/dev/null || true
  # a RabbitMQ node just launched: let its beam.smp appear, so stop_servers finds it
  if [ -n "$rabbit_job" ]; then
    for _ in $(seq 1 50); do
      proc_alive "$rabbit_job" && [ -z "$(node_pids "$node")" ] || break
      sleep 0.1
    done
  fi
  say "start failed (status $st); stopping what was started; the logs stay in $dir ($me stop $dir removes it)"
  stop_servers || true
  exit 1
}

case "$cmd" in
  start) start ;;
  stop)
    [ "$(id -u)" = 0 ] || die "must run as root"
    [ -d "$dir" ] || exit 0
    stop_servers
    # Only a directory this script set up (or an empty one) is removed: a mistyped DIR is kept.
    if [ -f "$dir/state" ] || [ -z "$(ls -A "$dir")" ]; then
      rm -rf "$dir"
    else
      die "$dir was not set up by $me (no $dir/state); not removing it"
    fi
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

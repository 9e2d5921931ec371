#!/usr/bin/env bash
# Starts private Redis servers from the local redis-server on free ports, for the tests: they
# start empty, so nothing another program left in a shared Redis can slow or disturb the suite.
#   deploy/local/redis-private.sh single DIR    one standalone server; prints its URL
#   deploy/local/redis-private.sh cluster DIR   a 3-master Redis Cluster; prints the seed URLs, comma-separated
#   deploy/local/redis-private.sh stop DIR      stops every server started in DIR and removes DIR
set -euo pipefail
usage="usage: redis-private.sh single|cluster|stop DIR"
cmd=${1:?$usage}
dir=${2:?$usage}

# Ports below the kernel's ephemeral range (bus ports, +10000, too): a port in that range can
# be the local end of some outgoing connection, which refuses connects (so it looks free) but
# makes redis-server's bind fail.
ephemeral_low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
free_port() {
  local p
  for _ in $(seq 1 200); do
    p=$((10000 + RANDOM % (ephemeral_low - 20000)))
    if ! (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null && ! (exec 3<>/dev/tcp/127.0.0.1/$((p + 10000))) 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  echo "redis-private.sh: no free port found" >&2; return 1
}

installed() {
  command -v redis-server >/dev/null || { echo "redis-private.sh: redis-server is not installed (deploy/local/services.sh installs it)" >&2; exit 1; }
  mkdir -p "$dir"
}

wait_ping() { # port
  for _ in $(seq 1 40); do redis-cli -p "$1" ping >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "redis-private.sh: redis-server on port $1 did not answer; its log:" >&2
  tail -n 5 "$dir/redis-$1.log" >&2 2>/dev/null || true
  return 1
}

case "$cmd" in
  single)
    installed
    p=$(free_port)
    redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
      --dir "$dir" --logfile "$dir/redis-$p.log" --pidfile "$dir/redis-$p.pid"
    wait_ping "$p"
    echo "$p" >> "$dir/ports"
    echo "redis://127.0.0.1:$p"
    ;;
  cluster)
    installed
    ports=()
    for _ in 1 2 3; do
      p=$(free_port)
      while [[ " ${ports[*]} " == *" $p "* ]]; do p=$(free_port); done
      ports+=("$p")
      redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
        --dir "$dir" --cluster-enabled yes --cluster-config-file "nodes-$p.conf" \
        --logfile "$dir/redis-$p.log" --pidfile "$dir/redis-$p.pid"
    done
    for p in "${ports[@]}"; do wait_ping "$p"; done
    redis-cli --cluster create "${ports[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1 \
      || { cat "$dir/create.log" >&2; exit 1; }
    for _ in $(seq 1 100); do
      ok=1
      for p in "${ports[@]}"; do
        redis-cli -p "$p" cluster info 2>/dev/null | grep -q 'cluster_state:ok' || ok=0
      done
      [ "$ok" = 1 ] && break
      sleep 0.1
    done
    [ "$ok" = 1 ] || { echo "redis-private.sh: cluster did not become ready" >&2; exit 1; }
    printf '%s\n' "${ports[@]}" >> "$dir/ports"
    urls=$(printf 'redis://127.0.0.1:%s,' "${ports[@]}")
    echo "${urls%,}"
    ;;
  stop)
    if [ -f "$dir/ports" ]; then
      while read -r p; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done < "$dir/ports"
    fi
    rm -rf "$dir"
    ;;
  *) echo "$usage" >&2; exit 2 ;;
esac

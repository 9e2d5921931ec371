#!/usr/bin/env bash
# Starts a private 3-master Redis Cluster from the local redis-server on free ports, for tests.
#   deploy/local/redis-cluster.sh start DIR   prints the seed URLs, comma-separated
#   deploy/local/redis-cluster.sh stop DIR    stops it and removes DIR
set -euo pipefail
cmd=${1:?usage: redis-cluster.sh start|stop DIR}
dir=${2:?usage: redis-cluster.sh start|stop DIR}

free_port() {
  local p
  for _ in $(seq 1 200); do
    p=$((20000 + RANDOM % 20000))
    if ! (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null && ! (exec 3<>/dev/tcp/127.0.0.1/$((p + 10000))) 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  echo "redis-cluster.sh: no free port found" >&2; return 1
}

case "$cmd" in
  start)
    command -v redis-server >/dev/null || { echo "redis-cluster.sh: redis-server is not installed (deploy/local/services.sh installs it)" >&2; exit 1; }
    mkdir -p "$dir"
    ports=()
    for _ in 1 2 3; do
      p=$(free_port)
      while [[ " ${ports[*]} " == *" $p "* ]]; do p=$(free_port); done
      ports+=("$p")
      redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
        --dir "$dir" --cluster-enabled yes --cluster-config-file "nodes-$p.conf" \
        --logfile "$dir/redis-$p.log" --pidfile "$dir/redis-$p.pid"
    done
    for p in "${ports[@]}"; do
      for _ in $(seq 1 40); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
    done
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
    [ "$ok" = 1 ] || { echo "redis-cluster.sh: cluster did not become ready" >&2; exit 1; }
    printf '%s\n' "${ports[@]}" > "$dir/ports"
    urls=$(printf 'redis://127.0.0.1:%s,' "${ports[@]}")
    echo "${urls%,}"
    ;;
  stop)
    if [ -f "$dir/ports" ]; then
      while read -r p; do redis-cli -p "$p" shutdown nosave >/dev/null 2>&1 || true; done < "$dir/ports"
    fi
    rm -rf "$dir"
    ;;
  *) echo "usage: redis-cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
